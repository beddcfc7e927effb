"""Scenarios: a history and a window of requests, scaled to a cluster. Pure.

Randomness comes in as a seed; files are read only through `load_trace` and `load_servegen`.

A scenario is what an evaluation serves (the window) and what came before it (the history). Policies
fit everything they know on the history (`oserve.planner.prior`) and are measured on the window only,
so nothing a policy uses was fitted on the requests it serves:
- A real trace (azure-conv, azure-code, a file): the history is its first `history_minutes`, the
  window what follows.
- The paper's compositions S1-S5 (Table 1) and sequences T1-T4 (Table 2): Poisson arrivals whose
  types follow the mix, each request a real request of its type drawn from the Azure conversation
  trace. The history (the first phase's mix) draws from the trace's first `POOL_SPLIT_S` seconds, the
  window from the rest: the requests a policy learns from are never those it serves.
- `shift`: the same kind of sequence over `SHIFT_MIXES` (short prompts, long prompts, short again), at
  `load` of the least of its phases' best homogeneous capacities.
- `quiet-busy`: a quiet phase of chats with long answers, a busy phase of
  short tasks, quiet again (`QUIET_BUSY_PHASES`), each phase at its own fraction of `load` x its own
  best homogeneous capacity (with `load` 0.8: 0.3, then 0.9); the history is a quiet phase then a busy
  one, so what is fitted on it (the static deployment too) has seen the peak.
- A ServeGen slice (servegen-m-large, servegen-m-mid): the history is the `history_minutes` before the
  slice, generated the same way (`oserve.servegen`).

Volume (as the paper scales its traces): every request of a real trace is copied floor(f) times, plus
once more with probability frac(f), each copy at a uniformly jittered time inside its minute; f puts
the window's 90th-percentile minute at `load` x the capacity of the best homogeneous deployment.
The history is scaled by the same f. Compositions run at `load` x that capacity for their mix.

The types a scenario is described and scaled with (`Scenario.types`, fitted on the whole source
trace) are the experimenter's, for reporting; no policy sees them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oserve.capacity import CapacityTable, LatencyTarget
from oserve.errors import ConfigError
from oserve.planner.candidates import homogeneous_deployment, static_capacity_rps
from oserve.specs import ClusterSpec, ModelSpec
from oserve.traces import Trace, load_trace
from oserve.workload_types import COMPOSITIONS, NAMES_4, SEQUENCES, WorkloadTypes, fit_types

HISTORY_MINUTES = 10.0
"""Minutes of history before each window: enough to fit four types and a capacity table (about 3,000
requests of the Azure conversation trace at its own rate), little enough to leave most of an hour
to measure."""
POOL_SPLIT_S = 1200.0
"""Compositions and sequences: history requests come from the pool trace's first 20 minutes, window
requests from the rest."""


@dataclass(frozen=True, eq=False)
class Scenario:
    """A window to serve, the history before it, and the experimenter's description of them."""

    name: str
    history: Trace
    """Requests before the window, times from the history's start; it ends where the window starts."""
    history_s: float
    window: Trace
    """The requests measured, times from the window's start."""
    types: WorkloadTypes
    """The experimenter's types (true lengths), for the description and the volume; no policy sees them."""
    cv: float
    """Coefficient of variation of the window's type shares (of its mean mix): how skewed the mix is."""


def true_types(trace: Trace, types: WorkloadTypes) -> np.ndarray:
    """Each request's type by its true lengths (the experimenter's view, known after the fact). Pure."""
    return types.classify(trace.input_tokens, trace.output_tokens)


def mean_mix(trace: Trace, types: WorkloadTypes) -> np.ndarray:
    counts = np.bincount(true_types(trace, types), minlength=types.k).astype(float)
    return counts / max(counts.sum(), 1.0)


def mix_cv_of(shares: dict[str, float] | tuple[float, ...] | np.ndarray) -> float:
    """Coefficient of variation of a mix's type shares (how skewed it is). Pure."""
    vals = np.array(list(shares.values()) if isinstance(shares, dict) else shares, dtype=float)
    vals = vals / vals.sum()
    return float(vals.std() / vals.mean())


def scale_volume(trace: Trace, factor: float, rng: np.random.Generator, window_s: float = 60.0) -> Trace:
    """The same minutes with `factor` times the requests (see the module docstring). Pure given rng."""
    if not factor > 0:
        raise ConfigError(f"scale factor must be positive, got {factor}")
    if not len(trace):
        return trace
    base = int(np.floor(factor))
    copies = np.full(len(trace), base) + (rng.random(len(trace)) < factor - base)
    idx = np.repeat(np.arange(len(trace)), copies)
    window = np.floor(trace.arrival_s[idx] / window_s)
    arrival = (window + rng.random(len(idx))) * window_s
    # keep the original time of the first copy so an unscaled trace (factor 1) is unchanged
    first = np.ones(len(idx), dtype=bool)
    first[1:] = idx[1:] != idx[:-1]
    arrival = np.where(first, trace.arrival_s[idx], arrival)
    arrival = np.minimum(arrival, trace.arrival_s.max())
    return trace.take(idx, arrival, name=f"{trace.name}x{factor:.2f}")


def minute_loads(trace: Trace, types: WorkloadTypes, table: CapacityTable, cluster: ClusterSpec,
                 window_s: float = 60.0) -> np.ndarray:
    """Each minute's demand as a fraction of the capacity of the best homogeneous deployment (for the
    trace's mean mix): sum_j rate_j / N_j, where N_j is what that deployment serves of type j alone. Pure."""
    k = types.k
    shape = static_capacity_rps(table, cluster, mean_mix(trace, types))[0][1]
    count = len(homogeneous_deployment(cluster, shape).replicas)
    per_type = np.array([table.rate(shape, j) for j in range(k)]) * count
    minute = ((trace.arrival_s - trace.arrival_s.min()) // window_s).astype(int)
    counts = np.zeros((int(minute.max()) + 1, k))
    np.add.at(counts, (minute, true_types(trace, types)), 1)
    return (counts / window_s / per_type).sum(axis=1)


def scale_for_load(trace: Trace, types: WorkloadTypes, table: CapacityTable, cluster: ClusterSpec, load: float,
                   quantile: float = 0.9) -> float:
    """Volume factor that puts the trace's `quantile` busiest minute at `load` x the capacity of the best
    homogeneous deployment (see `minute_loads`). Pure.

    A quantile, not the mean: real traces are bursty (the Azure code trace's busiest minute carries 4.4x
    its mean load in this sense, 4.2x its mean request count), so scaling the mean to 0.8 overruns every
    policy for minutes on end and the comparison measures queues that only grow. At the 0.9 quantile
    the cluster is "neither idle nor overrun", as the paper scales its traces; for the Poisson
    compositions the quantile is within a few percent of the mean.
    """
    if not 0 < quantile <= 1:
        raise ConfigError(f"scale_for_load: quantile must be in (0, 1], got {quantile}")
    loads = minute_loads(trace, types, table, cluster)
    if len(loads) > 1 and loads[-1] < 0.5 * float(np.median(loads)):
        loads = loads[:-1]  # a short last minute is not a quiet one
    return load / float(np.quantile(loads, quantile))


def composition(shares: dict[str, float], pool: Trace, pool_types: np.ndarray, types: WorkloadTypes,
                rate_rps: float, duration_s: float, rng: np.random.Generator, start_s: float = 0.0,
                name: str = "custom") -> Trace:
    """Poisson arrivals at `rate_rps` whose types follow `shares` (percent by type name); each request is
    a `pool` request of its type (`pool_types`), drawn with replacement. Pure given rng."""
    probs = np.zeros(types.k)
    for type_name, pct in shares.items():
        probs[types.index(type_name)] = pct
    if probs.sum() <= 0:
        raise ConfigError(f"composition {name!r} has no weight")
    probs /= probs.sum()
    n = rng.poisson(rate_rps * duration_s)
    arrival = np.sort(start_s + rng.random(n) * duration_s)
    kinds = rng.choice(types.k, size=n, p=probs)
    pick = np.empty(n, dtype=np.int64)
    for j in range(types.k):
        sel = np.nonzero(kinds == j)[0]
        members = np.nonzero(pool_types == j)[0]
        if len(sel) and not len(members):
            raise ConfigError(f"the pool has no request of type {types.names[j]}")
        pick[sel] = members[rng.integers(0, len(members), size=len(sel))]
    return pool.take(pick, arrival, name=name)


def sequence(phases: tuple[str, ...], pool: Trace, pool_types: np.ndarray, types: WorkloadTypes, rate_rps: float,
             phase_s: float, rng: np.random.Generator, name: str = "custom",
             mixes: dict[str, dict[str, float]] = COMPOSITIONS) -> Trace:
    """Compositions (named in `mixes`) one after another, `phase_s` each (the paper's shifting workloads).
    Pure given rng."""
    parts = [composition(mixes[p], pool, pool_types, types, rate_rps, phase_s, rng, start_s=i * phase_s)
             for i, p in enumerate(phases)]
    return Trace.concat(parts, name)


def require_paper_names(types: WorkloadTypes) -> None:
    if tuple(types.names) != NAMES_4:
        raise ConfigError(f"the paper's compositions need the four types {NAMES_4}, got {types.names}")


def build_scenario(name: str, model: ModelSpec, cluster: ClusterSpec, load: float = 0.8,
                   minutes: float | None = None, seed: int = 0, target: LatencyTarget = LatencyTarget(),
                   history_minutes: float = HISTORY_MINUTES, pool_trace: str = "azure-conv") -> Scenario:
    """A scenario by name: a trace (path, azure-conv, azure-code), a composition S1-S5, a sequence T1-T4,
    or a ServeGen slice (servegen-m-large, servegen-m-mid, or a servegen_*.csv path); see the module
    docstring. `minutes` cuts the window (or sets a composition's length; a sequence's phases share it).
    Deterministic for a seed."""
    if not history_minutes > 0:
        raise ConfigError(f"history_minutes must be > 0, got {history_minutes}")
    rng = np.random.default_rng(seed)
    history_s = history_minutes * 60.0
    if name in COMPOSITIONS or name in SEQUENCES or name == "shift":
        return _paper_scenario(name, model, cluster, load, minutes, rng, target, history_s, pool_trace)
    if name == "quiet-busy":
        return _quiet_busy_scenario(model, cluster, load, minutes, rng, target, history_s, pool_trace)
    if name.startswith("servegen-") or Path(name).name.startswith("servegen_"):
        return _servegen_scenario(name, model, cluster, load, minutes, rng, target, history_s)
    trace = load_trace(name)
    if trace.duration_s <= history_s + 60.0:
        raise ConfigError(f"{trace.name}: {trace.duration_s / 60:.1f} minutes leave no window after "
                          f"{history_minutes:g} minutes of history")
    types = fit_types(trace.input_tokens, trace.output_tokens)
    table = CapacityTable(model, cluster.gpu, types, target, gpus_per_node=cluster.gpus_per_node)
    end_s = history_s + minutes * 60.0 if minutes else trace.duration_s + 1.0
    window = trace.slice_time(history_s, end_s)
    factor = scale_for_load(window, types, table, cluster, load)
    history = scale_volume(trace.slice_time(0.0, history_s), factor, rng)
    window = scale_volume(window, factor, rng)
    return Scenario(trace.name, history, history_s, window, types, mix_cv_of(mean_mix(window, types)))


SHIFT_MIXES: dict[str, dict[str, float]] = {
    "inputs-short": {"SISO": 50.0, "SILO": 30.0, "LISO": 10.0, "LILO": 10.0},
    "inputs-long": {"SISO": 10.0, "SILO": 10.0, "LISO": 40.0, "LILO": 40.0},
}
"""The `shift` scenario's phases (percent by type): a mix that moves between short and long prompts, the
kind of shift a gateway can see at arrival (the input length is known then, the output length is not)."""
SHIFT_PHASES: tuple[str, ...] = ("inputs-short", "inputs-long", "inputs-short")

QUIET_BUSY_MIXES: dict[str, dict[str, float]] = {
    "answers-long": {"SILO": 45.0, "LILO": 45.0, "SISO": 5.0, "LISO": 5.0},
    "answers-short": {"SISO": 55.0, "LISO": 45.0},
}
QUIET_BUSY_PHASES: tuple[tuple[str, float], ...] = (("answers-long", 0.375), ("answers-short", 1.125),
                                                     ("answers-long", 0.375))
"""The `quiet-busy` scenario's phases: (mix, fraction of `load`). Quiet hours of long chats, where the
fastest replicas (few, wide) give the lowest latency, and a busy hour of short tasks, where only a
deployment built for throughput keeps up: the latency-throughput trade-off that makes switching pay.
Measured on 8 GPUs (Llama-2-70B, 6-minute phases, `oserve bench ceiling --slice-minutes 6`): TP8 in the
quiet phases, TP4xPP2 in the busy one gives a P99 1.26x lower than the best single deployment."""


def _typed_pool(pool_trace: str, model: ModelSpec, cluster: ClusterSpec,
                target: LatencyTarget) -> tuple[Trace, WorkloadTypes, np.ndarray, CapacityTable]:
    """The trace the paper's kind of scenario draws its requests from, its four types, each request's type, and
    the capacity table for those types."""
    pool = load_trace(pool_trace)
    types = fit_types(pool.input_tokens, pool.output_tokens)
    require_paper_names(types)
    table = CapacityTable(model, cluster.gpu, types, target, gpus_per_node=cluster.gpus_per_node)
    return pool, types, true_types(pool, types), table


def _paper_scenario(name: str, model: ModelSpec, cluster: ClusterSpec, load: float, minutes: float | None,
                    rng: np.random.Generator, target: LatencyTarget, history_s: float, pool_trace: str) -> Scenario:
    """A composition, a sequence, or `shift`. The paper's run at `load` x the best homogeneous capacity of
    their mean mix; `shift` at `load` x the least of its phases' best homogeneous capacities, so the
    deployment best for each phase is never overrun while the one best for another may be."""
    pool, types, pool_types, table = _typed_pool(pool_trace, model, cluster, target)
    mixes = {**COMPOSITIONS, **SHIFT_MIXES}
    phases = (name,) if name in COMPOSITIONS else SHIFT_PHASES if name == "shift" else SEQUENCES[name]
    total_min = minutes or (20.0 if name in COMPOSITIONS else 30.0)

    def mix_of(phase_names: tuple[str, ...]) -> np.ndarray:
        shares = np.zeros(types.k)
        for p in phase_names:
            for type_name, pct in mixes[p].items():
                shares[types.index(type_name)] += pct / len(phase_names)
        return shares / shares.sum()
    mix = mix_of(phases)
    if name == "shift":
        rate = load * min(static_capacity_rps(table, cluster, mix_of((p,)))[0][0] for p in phases)
    else:
        rate = load * static_capacity_rps(table, cluster, mix)[0][0]
    early = pool.arrival_s < POOL_SPLIT_S
    history_pool, window_pool = pool.take(np.nonzero(early)[0]), pool.take(np.nonzero(~early)[0])
    history = composition(mixes[phases[0]], history_pool, pool_types[early], types, rate, history_s, rng,
                          name=f"{name}-history")
    phase_s = total_min * 60.0 / len(phases)
    window = sequence(phases, window_pool, pool_types[~early], types, rate, phase_s, rng, name=name, mixes=mixes)
    return Scenario(name, history, history_s, window, types, mix_cv_of(mix))


def _quiet_busy_scenario(model: ModelSpec, cluster: ClusterSpec, load: float, minutes: float | None,
                         rng: np.random.Generator, target: LatencyTarget, history_s: float,
                         pool_trace: str) -> Scenario:
    """`quiet-busy` (`QUIET_BUSY_PHASES`): each phase at its own rate, the history a quiet then a busy phase."""
    pool, types, pool_types, table = _typed_pool(pool_trace, model, cluster, target)

    def mix_of(phase: str) -> np.ndarray:
        shares = np.zeros(types.k)
        for type_name, pct in QUIET_BUSY_MIXES[phase].items():
            shares[types.index(type_name)] = pct
        return shares / shares.sum()

    def rate_of(phase: str, fraction: float) -> float:
        return fraction * load * static_capacity_rps(table, cluster, mix_of(phase))[0][0]

    def phases(plan: tuple[tuple[str, float], ...], phase_s: float, source: Trace, source_types: np.ndarray,
               name: str) -> Trace:
        return Trace.concat([composition(QUIET_BUSY_MIXES[p], source, source_types, types, rate_of(p, f), phase_s,
                                         rng, start_s=i * phase_s) for i, (p, f) in enumerate(plan)], name)
    early = pool.arrival_s < POOL_SPLIT_S
    history = phases(QUIET_BUSY_PHASES[:2], history_s / 2, pool.take(np.nonzero(early)[0]), pool_types[early],
                     "quiet-busy-history")
    total_min = minutes or 18.0
    window = phases(QUIET_BUSY_PHASES, total_min * 60.0 / len(QUIET_BUSY_PHASES), pool.take(np.nonzero(~early)[0]),
                    pool_types[~early], "quiet-busy")
    return Scenario("quiet-busy", history, history_s, window, types, mix_cv_of(mean_mix(window, types)))


def _servegen_scenario(name: str, model: ModelSpec, cluster: ClusterSpec, load: float, minutes: float | None,
                       rng: np.random.Generator, target: LatencyTarget, history_s: float) -> Scenario:
    """The default slice of a ServeGen trace (a busy hour whose mix shifts) and the history before it; the
    volume set by regenerating arrivals at a rate scale (not by copying requests: that would flatten
    ServeGen's bursty gaps) so the window's 90th-percentile minute is at `load`, as for the Azure traces."""
    from oserve.servegen import default_start_s, load_servegen, servegen_trace, slice_mean_rps

    data = load_servegen(name)
    mins = minutes or 60.0
    start = default_start_s(data, min(360.0, max(10.0, 10.0 * math.ceil(mins / 10.0))))  # whole windows
    if start < history_s:
        raise ConfigError(f"{data.name}: the slice at {start:.0f} s leaves no {history_s / 60:g} minutes of history")
    pilot_scale = min(1.0, 20.0 / max(slice_mean_rps(data, start, mins), 1e-9))  # ~20 requests/s: the shape only
    pilot = servegen_trace(data, start_s=start, minutes=mins, rate_scale=pilot_scale,
                           rng=np.random.default_rng(rng.integers(1 << 31)))
    types = fit_types(pilot.input_tokens, pilot.output_tokens)
    table = CapacityTable(model, cluster.gpu, types, target, gpus_per_node=cluster.gpus_per_node)
    rate_scale = pilot_scale * scale_for_load(pilot, types, table, cluster, load)
    history = servegen_trace(data, start_s=start - history_s, minutes=history_s / 60.0, rate_scale=rate_scale,
                             rng=rng, name=f"{data.name}-history")
    window = servegen_trace(data, start_s=start, minutes=mins, rate_scale=rate_scale, rng=rng, name=data.name)
    return Scenario(window.name, history, history_s, window, types, mix_cv_of(mean_mix(window, types)))
