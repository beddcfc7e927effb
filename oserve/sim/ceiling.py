"""The best fixed deployment, by exhaustive search: how far choosing a deployment alone can go. Pure.

OServe's gain over `vllm-static` comes from the deployment it picks (replica shapes that suit the
mix, types kept apart) and from switching when the mix moves. The first part can be bounded by
measurement: simulate every deployment the cluster can hold (each multiset of replica shapes that
uses all its GPUs, up to `max_replicas` replicas) on the whole workload, each routed as OServe
routes (the exact even assignment of the workload's mean rates gives each type its replicas; among
them, the least loaded), and keep the lowest P99. That is the best any planner can do by choosing
one such deployment for this routing; beating it takes switching, re-routing as the mix moves, or
another router. One run per deployment, so the ranking carries the noise of one P99 sample.

Exhaustive, so costly: a 16-GPU Llama-2-70B cluster has tens of such deployments of up to four
replicas, each a full simulation of the workload.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from oserve.capacity import CapacityTable
from oserve.errors import ConfigError, InfeasibleError
from oserve.scheduler.packing import place
from oserve.sim.cluster import SimConfig, SimResult, simulate
from oserve.sim.policies import assign_even, least_loaded_among, weights_for
from oserve.sim.twin import FixedPolicy
from oserve.sim.workloads import Workload
from oserve.specs import ClusterSpec, Deployment, GPUSpec, ModelSpec, ReplicaShape


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


def fixed_deployment_policy(deployment: Deployment, table: CapacityTable, rates: np.ndarray) -> FixedPolicy:
    """One deployment for the whole run, routed as OServe routes: each type to the replicas the exact
    even assignment of `rates` gives it, and among them to the least loaded. Pure."""
    n = table.matrix(deployment.shapes())
    return FixedPolicy(deployment, weights_for(assign_even(np.asarray(rates, dtype=float), n), n),
                       least_loaded_among, name="fixed")


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


def fixed_deployment_outcomes(model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, workload: Workload,
                              table: CapacityTable, max_replicas: int = 4, sim: SimConfig = SimConfig(),
                              progress: Callable[[int, int], None] | None = None) -> list[FixedOutcome]:
    """Every deployment of `deployment_multisets` that packs on `cluster`, simulated on the whole
    `workload` with `fixed_deployment_policy` at the workload's mean rates; best first (`FixedOutcome.key`).

    Raises:
        InfeasibleError: no deployment of at most `max_replicas` replicas uses the cluster exactly.
    """
    k = len(table.type_names)
    duration = max(workload.duration_s, 1e-9)
    rates = np.bincount(workload.type_index, minlength=k).astype(float) / duration
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
        res: SimResult = simulate(model, gpu, cluster, workload.arrival_s, workload.input_tokens,
                                  workload.output_tokens, workload.type_index, k,
                                  fixed_deployment_policy(dep, table, rates), sim)
        p99 = res.percentile("e2e", 99) if (~res.dropped).any() else math.inf
        out.append(FixedOutcome(combo, p99 if math.isfinite(p99) else math.inf, int(res.dropped.sum())))
        if progress is not None:
            progress(i + 1, len(placed))
    return sorted(out, key=FixedOutcome.key)
