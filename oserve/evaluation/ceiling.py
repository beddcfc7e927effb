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

Switching can be bounded the same way (`switching_ceiling`): cut the window into slices (a shifting
workload's phases), simulate every deployment on every slice alone (routed for that slice's own mean
class rates), and choose one deployment per slice so that the P99 over the whole window is lowest
(`best_schedule`). Each slice starts on idle replicas and a change costs nothing, so its P99 against
the best single deployment run the same way (the same slices, the same idle starts) is an optimistic
bound on what switching among these deployments at the slice boundaries can win, each slice's routing
fixed. It does not bound a policy that also re-weights its routing within a slice: on `shift` (8 GPUs,
18 minutes) the perfect-forecast reference, which re-routes every span, measured a P99 below this
schedule's (22.6 s against 23.5 s).

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
from oserve.decision import Decision
from oserve.errors import ConfigError, InfeasibleError
from oserve.evaluation.policies import Gateway
from oserve.planner.candidates import assign_even, weights_for
from oserve.planner.prior import Prior, client_tag
from oserve.planner.twin import ArrivalPattern
from oserve.scheduler.packing import place
from oserve.sim.kernel import SimConfig, SimResult, SpanView, latency_percentile, simulate
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


def placed_deployments(table: CapacityTable, cluster: ClusterSpec,
                       max_replicas: int) -> list[tuple[tuple[ReplicaShape, ...], Deployment]]:
    """Every multiset of `deployment_multisets` over the table's shapes that packs onto `cluster`'s nodes, placed.

    Raises:
        InfeasibleError: none of at most `max_replicas` replicas uses the cluster exactly.
    """
    placed = []
    for combo in deployment_multisets(table.shapes(cluster.num_gpus), cluster.num_gpus, max_replicas):
        try:
            placed.append((combo, place(list(combo), cluster)))
        except (ConfigError, InfeasibleError):
            continue  # does not pack onto the nodes
    if not placed:
        raise InfeasibleError(f"no deployment of at most {max_replicas} replicas uses all {cluster.num_gpus} "
                              f"GPUs of {cluster.name}")
    return placed


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
    placed = placed_deployments(table, cluster, max_replicas)
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


EXHAUSTIVE_SCHEDULES = 50_000
"""`best_schedule` tries every schedule when there are at most this many, else searches locally."""


def best_schedule(latencies: Sequence[Sequence[np.ndarray]], q: float = 99.0,
                  max_exhaustive: int = EXHAUSTIVE_SCHEDULES) -> tuple[tuple[int, ...], float]:
    """The deployment per slice whose union of latencies has the lowest percentile `q`.

    `latencies[d][s]`: deployment d's latency (s) of each admitted request of slice s, inf for one it never
    finished (`oserve.sim.kernel.latency_percentile`). Every schedule when there are at most
    `max_exhaustive`; else coordinate descent (one slice changed at a time, the best change taken, until none
    helps) from the best of the constant schedules and of each slice's own best, so the result is never
    worse than any constant schedule. Returns (deployment index per slice, percentile). Pure.
    """
    num_deps = len(latencies)
    if num_deps < 1 or not len(latencies[0]) or any(len(row) != len(latencies[0]) for row in latencies):
        raise ConfigError("best_schedule: need at least one deployment, and the same number (>= 1) of slices for each")
    num_slices = len(latencies[0])

    def scored(choice: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        return _ranked(latency_percentile(np.concatenate([latencies[d][s] for s, d in enumerate(choice)]), q)), choice

    if num_deps ** num_slices <= max_exhaustive:
        value, choice = min(scored(c) for c in itertools.product(range(num_deps), repeat=num_slices))
        return choice, value
    own = tuple(min(range(num_deps), key=lambda d, s=s: (_ranked(latency_percentile(latencies[d][s], q)), d))
                for s in range(num_slices))
    best = min(scored(c) for c in [own] + [(d,) * num_slices for d in range(num_deps)])
    while True:
        step = min((scored(best[1][:s] + (d,) + best[1][s + 1:]) for s in range(num_slices) for d in range(num_deps)
                    if d != best[1][s]), default=None)
        if step is None or not step[0] < best[0]:  # strictly lower each step: it ends
            return best[1], best[0]
        best = step


def _ranked(p99: float) -> float:
    """A percentile to rank by: NaN (no request) as the worst."""
    return math.inf if math.isnan(p99) else p99


@dataclass(frozen=True, slots=True)
class SwitchingCeiling:
    """`switching_ceiling`'s answer: the best deployment per slice, and the best single one run the same way."""

    slice_s: float
    labels: tuple[str, ...]
    """The deployment chosen for each slice."""
    p99_e2e_s: float
    """P99 over the window with each slice served by its deployment."""
    constant_label: str
    """The best single deployment, run slice by slice the same way (idle at each slice's start)."""
    constant_p99_e2e_s: float
    slice_p99_e2e_s: tuple[tuple[float, ...], ...]
    """[deployment][slice]: each deployment's P99 on each slice (the order of `deployment_labels`)."""
    deployment_labels: tuple[str, ...]

    @property
    def gain(self) -> float:
        """The most switching can win: the best single deployment's P99 over the best schedule's."""
        return self.constant_p99_e2e_s / self.p99_e2e_s if 0 < self.p99_e2e_s < math.inf else math.nan


def window_slices(window: Trace, slice_s: float) -> list[Trace]:
    """The window cut at multiples of `slice_s` from its time origin (0), each slice re-based to 0. Pure."""
    if not slice_s > 0:
        raise ConfigError(f"window_slices: slice_s must be > 0, got {slice_s}")
    end = float(window.arrival_s.max()) if len(window) else 0.0
    count = max(1, int(end // slice_s) + 1)
    return [window.slice_time(i * slice_s, (i + 1) * slice_s) for i in range(count)]


def switching_ceiling(model: ModelSpec, cluster: ClusterSpec, window: Trace, prior: Prior, slice_s: float,
                      max_replicas: int = 4, sim: SimConfig = SimConfig(),
                      progress: Callable[[int, int], None] | None = None) -> SwitchingCeiling:
    """Every deployment `fixed_deployment_outcomes` tries, simulated on each slice of `window` alone (routed for
    the slice's own mean class rates, as classed at arrival), and the best deployment per slice
    (`best_schedule`); see the module docstring. Empty slices are left out.

    Raises:
        InfeasibleError: no deployment of at most `max_replicas` replicas uses the cluster exactly.
    """
    table = prior.table
    slices = [part for part in window_slices(window, slice_s) if len(part)]
    placed = placed_deployments(table, cluster, max_replicas)
    latencies: list[list[np.ndarray]] = []
    total, done = len(placed) * len(slices), 0
    for combo, dep in placed:
        n = table.matrix(dep.shapes())
        row = []
        for part in slices:
            policy = FixedDeploymentPolicy(prior, dep, weights_for(assign_even(mean_class_rates(prior, part), n), n))
            res = simulate(model, cluster.gpu, cluster, part, policy, sim)
            row.append(np.where(res.finished, res.e2e_s, math.inf)[res.admitted])
            done += 1
            if progress is not None:
                progress(done, total)
        latencies.append(row)
    labels = tuple(" + ".join(str(s) for s in combo) for combo, _ in placed)
    choice, p99 = best_schedule(latencies)
    constants = [latency_percentile(np.concatenate(row), 99.0) for row in latencies]
    best_constant = min(range(len(placed)), key=lambda d: (_ranked(constants[d]), d))
    return SwitchingCeiling(slice_s, tuple(labels[d] for d in choice), p99, labels[best_constant],
                            constants[best_constant],
                            tuple(tuple(latency_percentile(x, 99.0) for x in row) for row in latencies), labels)
