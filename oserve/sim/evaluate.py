"""Run every policy on one workload, side by side: the engine behind `oserve simulate` and `bench e2e`.

Pure apart from the optional progress callback. Each policy gets its best configuration, as the
paper gave its baselines:
- `vllm-static`: the homogeneous deployments with the highest modelled capacity for the workload's
  mean mix are each simulated on the whole trace and the one with the lowest P99 end-to-end latency is
  kept ("found by trying them"; the `static_candidates` best by the model are tried, 3 by default).
- `llumnix`: the same replica shape as the chosen static deployment, least-loaded dispatch.
- `vllm-reload`, `oserve`: plan every span from a forecast (the last span's rates unless a forecaster
  is given); `oracle`: the true rates of the coming span and free switching.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from oserve.capacity import CapacityTable, LatencyTarget, homogeneous_rate
from oserve.errors import ConfigError, UnknownNameError
from oserve.sim.cluster import SimConfig, SimResult, simulate
from oserve.sim.policies import (Forecaster, OServePolicy, PlanningContext, StaticPolicy, SwitchCosts,
                                 VllmReloadPolicy, homogeneous_deployment, llumnix)
from oserve.sim.workloads import Workload
from oserve.specs import ClusterSpec, GPUSpec, ModelSpec, ReplicaShape

POLICIES = ("oserve", "vllm-static", "vllm-reload", "llumnix", "oracle")


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """How a comparison is run."""

    sim: SimConfig = field(default_factory=SimConfig)
    target: LatencyTarget = field(default_factory=LatencyTarget)
    costs: SwitchCosts = field(default_factory=SwitchCosts)
    static_candidates: int = 3
    """Homogeneous deployments simulated to pick vllm-static (the best by modelled capacity)."""

    def __post_init__(self) -> None:
        if self.static_candidates < 1:
            raise ConfigError(f"EvalConfig: static_candidates must be >= 1, got {self.static_candidates}")


@dataclass
class Comparison:
    """Every policy's result on one workload."""

    workload: str
    results: dict[str, SimResult]
    static_shape: str
    static_tried: dict[str, float]
    """shape -> simulated P99 e2e of each static candidate tried."""

    def speedup_p99(self, reference: str = "oserve") -> dict[str, float]:
        """Other policy's P99 e2e over the reference's (>1: the reference is better)."""
        ref = self.results[reference].percentile("e2e", 99)
        return {name: r.percentile("e2e", 99) / ref for name, r in self.results.items() if name != reference}


def mean_mix(w: Workload, num_types: int) -> np.ndarray:
    counts = np.bincount(w.type_index, minlength=num_types).astype(float)
    return counts / counts.sum()


def static_capacity_rps(table: CapacityTable, cluster: ClusterSpec, mix: np.ndarray) -> list[tuple[float, ReplicaShape]]:
    """Modelled capacity of every homogeneous deployment for a mix, best first."""
    out = []
    for shape in table.shapes(cluster.num_gpus):
        count = len(homogeneous_deployment(cluster, shape).replicas)
        out.append((homogeneous_rate(table, shape, mix) * count, shape))
    return sorted(out, key=lambda x: (-x[0], x[1].num_gpus))


def compare(model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, workload: Workload, table: CapacityTable,
            policies: tuple[str, ...] = POLICIES, config: EvalConfig = EvalConfig(),
            forecaster_factory: Callable[[], Forecaster] | None = None,
            progress: Callable[[str, float], None] | None = None) -> Comparison:
    """Simulate each named policy on the workload. Deterministic."""
    for name in policies:
        if name not in POLICIES:
            raise UnknownNameError("policy", name, POLICIES)
    k = len(table.type_names)
    span_s = config.sim.span_s
    ctx = PlanningContext(model, cluster, table, config.costs, initial_rps=workload.first_span_rps(span_s, k))
    results: dict[str, SimResult] = {}

    def run(policy, label: str) -> SimResult:
        cb = (lambda f: progress(label, f)) if progress else None
        return simulate(model, gpu, cluster, workload.arrival_s, workload.input_tokens, workload.output_tokens,
                        workload.type_index, k, policy, config.sim, progress=cb)

    static_tried: dict[str, float] = {}
    static_shape = ""
    needs_static = any(p in policies for p in ("vllm-static", "llumnix"))
    if needs_static:
        ranked = static_capacity_rps(table, cluster, mean_mix(workload, k))[:config.static_candidates]
        best = None
        for _, shape in ranked:
            dep = homogeneous_deployment(ctx, shape)
            res = run(StaticPolicy(ctx, dep), f"vllm-static {shape}")
            p99 = res.percentile("e2e", 99)
            static_tried[str(shape)] = p99
            key = (res.dropped.sum(), p99 if math.isfinite(p99) else math.inf)
            if best is None or key < best[0]:
                best = (key, dep, res)
        static_shape = str(best[1].replicas[0].shape)
        if "vllm-static" in policies:
            results["vllm-static"] = best[2]
        if "llumnix" in policies:
            results["llumnix"] = run(llumnix(ctx, best[1]), "llumnix")
    fc = forecaster_factory or (lambda: None)
    if "vllm-reload" in policies:
        results["vllm-reload"] = run(VllmReloadPolicy(ctx, fc()), "vllm-reload")
    if "oserve" in policies:
        results["oserve"] = run(OServePolicy(ctx, fc()), "oserve")
    if "oracle" in policies:
        results["oracle"] = run(OServePolicy(ctx, oracle=True), "oracle")
    ordered = {name: results[name] for name in POLICIES if name in results}
    return Comparison(workload.name, ordered, static_shape, static_tried)


def scale_for_load(workload: Workload, table: CapacityTable, cluster: ClusterSpec, load: float) -> float:
    """Volume factor that puts the workload's mean demand at `load` x the best homogeneous capacity."""
    k = len(table.type_names)
    best = static_capacity_rps(table, cluster, mean_mix(workload, k))[0][0]
    mean_rps = len(workload) / max(workload.duration_s, 1e-9)
    return load * best / mean_rps


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named workload scaled to a cluster, with the types and capacity table it was planned with."""

    name: str
    workload: Workload
    types: object
    table: CapacityTable
    cv: float
    """Coefficient of variation of the type shares (of the mean mix): how skewed the mix is."""


def build_scenario(name: str, model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, load: float = 0.8,
                   minutes: float | None = None, seed: int = 0, target: LatencyTarget = LatencyTarget(),
                   pool_trace: str = "azure-conv") -> Scenario:
    """A workload by name: a trace (path, azure-conv, azure-code), a composition S1-S5 or a sequence T1-T4.

    Traces keep their minutes and type mix and are scaled in volume to `load` x the best homogeneous
    capacity; compositions and sequences draw real requests of each type from `pool_trace` at that
    load. `minutes` cuts a trace (or sets a composition's length; a sequence's phases share it).
    """
    from oserve.sim.workloads import (COMPOSITIONS, SEQUENCES, composition, from_trace, mix_cv_of, scale_volume,
                                      sequence)
    from oserve.workload import fit_types, load_trace

    rng = np.random.default_rng(seed)
    if name in COMPOSITIONS or name in SEQUENCES:
        pool_t = load_trace(pool_trace)
        types = fit_types(pool_t.input_tokens, pool_t.output_tokens)
        pool = from_trace(pool_t, types)
        table = CapacityTable(model, gpu, types, target, gpus_per_node=cluster.gpus_per_node)
        phases = (name,) if name in COMPOSITIONS else SEQUENCES[name]
        total_min = minutes or (20.0 if name in COMPOSITIONS else 30.0)
        shares = np.zeros(types.k)
        for p in phases:
            for type_name, pct in COMPOSITIONS[p].items():
                shares[types.index(type_name)] += pct / len(phases)
        mix = shares / shares.sum()
        rate = load * static_capacity_rps(table, cluster, mix)[0][0]
        if name in COMPOSITIONS:
            w = composition(name, pool, types, rate, total_min * 60.0, rng)
        else:
            w = sequence(name, pool, types, rate, total_min * 60.0 / len(phases), rng)
        return Scenario(name, w, types, table, mix_cv_of(tuple(mix)))
    trace = load_trace(name)
    if minutes:
        trace = trace.slice_time(0.0, minutes * 60.0)
    types = fit_types(trace.input_tokens, trace.output_tokens)
    table = CapacityTable(model, gpu, types, target, gpus_per_node=cluster.gpus_per_node)
    base = from_trace(trace, types, name=trace.name)
    factor = scale_for_load(base, table, cluster, load)
    w = scale_volume(base, factor, rng)
    mix = mean_mix(w, types.k)
    return Scenario(trace.name, w, types, table, mix_cv_of(tuple(mix)))
