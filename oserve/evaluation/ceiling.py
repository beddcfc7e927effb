"""The best fixed deployment, by exhaustive search: how far choosing a deployment alone can go. Pure.

OServe's gain over `vllm-static` comes from the deployment it picks (replica shapes that suit the
mix, types kept apart) and from switching when the mix moves. The first part can be bounded by
measurement: simulate every deployment the cluster can hold (each multiset of replica shapes that
uses all its GPUs, up to `max_replicas` replicas) on the whole window, each routed as OServe routes
(its gateway classes each request at arrival; the exact even assignment of the window's mean class
rates gives each class its replicas; among them, the least loaded), and keep the lowest P99. That is
the best a planner can do by choosing one such deployment for this routing, with hindsight (the mean
rates are the window's); beating it takes switching, re-routing as the mix moves, or another router.
One run per deployment, so the ranking carries the noise of one P99 sample.

Exhaustive, so costly: a 16-GPU Llama-2-70B cluster has tens of such deployments of up to four
replicas, each a full simulation of the workload.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from oserve.decision import Decision
from oserve.errors import ConfigError, InfeasibleError
from oserve.evaluation.policies import Gateway
from oserve.planner.candidates import assign_even, weights_for
from oserve.planner.prior import Prior, client_tag
from oserve.planner.twin import ArrivalPattern
from oserve.scheduler.packing import place
from oserve.sim.kernel import SimConfig, SimResult, SpanView, simulate
from oserve.specs import ClusterSpec, Deployment, ModelSpec, ReplicaShape
from oserve.traces import Trace


def deployment_multisets(shapes: Sequence[ReplicaShape], num_gpus: int,
                         max_replicas: int) -> list[tuple[ReplicaShape, ...]]:
    """Every multiset of `shapes` with at most `max_replicas` members whose GPUs sum to `num_gpus`
    (members in the order of `shapes`; whether it packs onto nodes is not checked here). Pure."""
    if max_replicas < 1:
        raise ConfigError(f"deployment_multisets: max_replicas must be >= 1, got {max_replicas}")
    unique = list(dict.fromkeys(shapes))
    out = []
    for count in range(1, max_replicas + 1):
        for combo in itertools.combinations_with_replacement(unique, count):
            if sum(s.num_gpus for s in combo) == num_gpus:
                out.append(combo)
    return out


class FixedDeploymentPolicy(Gateway):
    """One deployment for the whole run, routed as OServe routes: the gateway classes each request at
    arrival, and the least loaded of the replicas `weights` give its class takes it."""

    def __init__(self, prior: Prior, deployment: Deployment, weights: tuple[tuple[float, ...], ...],
                 name: str = "fixed") -> None:
        super().__init__(name, len(prior.class_names), prior.fresh_estimator())
        self.decision = Decision(deployment, weights, 0.0, (), name)

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        return self.decision if view.current is None else None


def mean_class_rates(prior: Prior, window: Trace) -> np.ndarray:
    """The window's mean arrival rate per class, each request classed as the gateway would class it at
    arrival (with hindsight: the window's own requests)."""
    est = prior.fresh_estimator()
    classes = [est.predict_one(int(i), tag=client_tag(int(c)), max_tokens=int(m) or None)
               for i, c, m in zip(window.input_tokens, window.client_ids, window.max_tokens)]
    return np.bincount(classes, minlength=len(prior.class_names)) / max(window.duration_s, 1e-9)


@dataclass(frozen=True, slots=True)
class FixedOutcome:
    """One deployment's simulated run."""

    shapes: tuple[ReplicaShape, ...]
    p99_e2e_s: float
    """P99 end-to-end latency of the finished requests (inf when none finished)."""
    dropped: int

    @property
    def label(self) -> str:
        return " + ".join(str(s) for s in self.shapes)

    def key(self) -> tuple[int, float, int]:
        """Ranking: fewest dropped requests, then lowest P99, then fewest replicas."""
        return (self.dropped, self.p99_e2e_s, len(self.shapes))


def fixed_deployment_outcomes(model: ModelSpec, cluster: ClusterSpec, window: Trace, prior: Prior,
                              max_replicas: int = 4, sim: SimConfig = SimConfig(),
                              progress: Callable[[int, int], None] | None = None) -> list[FixedOutcome]:
    """Every deployment of `deployment_multisets` that packs on `cluster`, simulated on the whole
    `window` with a `FixedDeploymentPolicy` for the window's mean class rates; best first (`FixedOutcome.key`).

    Raises:
        InfeasibleError: no deployment of at most `max_replicas` replicas uses the cluster exactly.
    """
    table = prior.table
    rates = mean_class_rates(prior, window)
    combos = deployment_multisets(table.shapes(cluster.num_gpus), cluster.num_gpus, max_replicas)
    placed = []
    for combo in combos:
        try:
            placed.append((combo, place(list(combo), cluster)))
        except (ConfigError, InfeasibleError):
            continue  # does not pack onto the nodes
    if not placed:
        raise InfeasibleError(f"no deployment of at most {max_replicas} replicas uses all {cluster.num_gpus} "
                              f"GPUs of {cluster.name}")
    out = []
    for i, (combo, dep) in enumerate(placed):
        n = table.matrix(dep.shapes())
        policy = FixedDeploymentPolicy(prior, dep, weights_for(assign_even(rates, n), n))
        res: SimResult = simulate(model, cluster.gpu, cluster, window, policy, sim)
        p99 = res.percentile("e2e", 99)
        out.append(FixedOutcome(combo, p99 if math.isfinite(p99) else math.inf, int(res.dropped.sum())))
        if progress is not None:
            progress(i + 1, len(placed))
    return sorted(out, key=FixedOutcome.key)
