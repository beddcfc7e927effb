"""Capacity learned from what replicas really serve, blended with the model's prior. Pure.

The planner plans against the capacity table `n[shape][class]` of the performance model. Real engines
differ from any model (GPU generation, engine version, prefix caching, what the model leaves out), so
the table is corrected from the engines' own telemetry, per (shape, class):

**What is estimated.** `u[k][j]`: how many times longer than the performance model a replica of shape k
really takes per request of class j (1: the model is right; 2: it serves half the modelled rate). The
learned table is the same capacity model (`oserve.capacity.CorrectedTable`) with the engine's time
for (k, j) stretched by `u[k][j]`, so the latency target is applied to the corrected speed: a replica
that decodes 2x slower meets the TBT target only at a smaller batch and loses more than half its rate.

**What is observed.** Per replica and span, from counters every engine reports (completions by class,
and the seconds its steps ended with requests still waiting, `ReplicaStats.saturated_s`):
- *Saturated* (requests waited through at least `saturated_frac` of the span, and through the span before:
  the first span of a saturation is skipped, its batch was still filling): the replica served all it
  could, so the work it finished filled the span. In the model's units, finishing c_j requests of each
  class j takes a full model replica `T_model(c)` seconds (`saturated_rate`: the simulated engine, on the
  performance model, fed that mix with its queue never empty), shared among the classes as their
  pure-class costs are: `a_j`. That gives one linear observation `sum_j a_j * u[k][j] = T` (T the span).
- *Not saturated*: the replica finished what it was sent with time to spare, so `sum_j a_j u[k][j] <= T`:
  a one-sided observation, used (as if saturated) only when the estimate breaks it by more than
  `unsaturated_slack` (the engine is faster than believed).

**The estimator.** Bayesian linear regression over every (shape, class) pair at once (a Kalman filter on
a constant state). The prior is `u ~ N(1, S)`, S made of four parts (`prior_covariance`): an error
common to all pairs (the GPU generation, the engine version), one per shape (its parallelism's costs),
one per class across shapes (long contexts), one per pair; about +-50% on one pair. What one replica's
mix reveals then moves the pairs it says nothing about as far as they are expected to share its error.
Each observation has noise sd `T * sqrt(noise_frac^2 + 1 / completions)` (requests in flight at the
span's ends, and counting noise). The posterior mean is the estimate, its sd the confidence. No
evidence: the prior exactly; more evidence: never further from the truth in the posterior's own metric
(for consistent observations), and never further than the prior was in the prior's metric.
Assumptions: the model's error for a (shape, class) is a time scale (the shapes of its cost curves are
right); a span's completions stand for the work done in it; classes are those the gateway routes by
(what each really contains is the prior's business, `FixedLengths.from_observed`).

Estimates are published rounded to `quantum` (log steps) so a planner built for them is reused until
the evidence moves them by a step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from oserve.capacity import CapacityTable, CorrectedTable, LatencyTarget
from oserve.errors import ConfigError
from oserve.specs import ReplicaShape

Scales = dict[tuple[ReplicaShape, int], float]


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """How capacity is learned (see the module docstring)."""

    prior_sd_parts: tuple[float, float, float, float] = (0.2, 0.35, 0.2, 0.15)
    """Prior sd of the time scales' parts: common to every pair, per shape, per class, per pair
    (`prior_covariance`); together about +-50% on one pair."""
    noise_frac: float = 0.25
    """Relative noise of one span's observation beyond counting noise (requests in flight at its ends)."""
    saturated_frac: float = 0.95
    """A replica whose steps ended with requests waiting through at least this fraction of the span was
    saturated: it served all it could."""
    min_completions: int = 3
    """Spans in which a replica finished fewer requests say nothing (too noisy, or it was starting)."""
    unsaturated_slack: float = 0.1
    """An unsaturated replica breaks the estimate when the estimate says its span's work took more than
    (1 + this) of the span."""
    quantum: float = 0.05
    """Published scales are rounded to steps of this in log (about 5%)."""
    mix_quantum: float = 0.05
    """A window's class mix is rounded to this before its full-replica rate is simulated (and cached)."""
    probe_batches: int = 6
    """A full-replica probe queues this many batches' worth of requests (`saturated_rate`)."""
    scale_bounds: tuple[float, float] = (0.2, 8.0)

    def __post_init__(self) -> None:
        if any(not p > 0 for p in self.prior_sd_parts) or len(self.prior_sd_parts) != 4:
            raise ConfigError(f"LearnerConfig: prior_sd_parts must be four values > 0, got {self.prior_sd_parts}")
        if not self.noise_frac > 0 or not 0 < self.saturated_frac <= 1:
            raise ConfigError(f"LearnerConfig: noise_frac must be > 0, saturated_frac in (0, 1]: {self}")
        if self.min_completions < 1 or not self.quantum > 0 or self.unsaturated_slack < 0 or self.probe_batches < 2:
            raise ConfigError(f"LearnerConfig: min_completions >= 1, quantum > 0, unsaturated_slack >= 0: {self}")
        lo, hi = self.scale_bounds
        if not 0 < lo < 1 < hi:
            raise ConfigError(f"LearnerConfig: scale_bounds must straddle 1, got {self.scale_bounds}")


@dataclass(frozen=True, slots=True)
class ReplicaWindow:
    """What one replica did over one span: its shape, completions per class, the span's seconds and the
    seconds its steps ended with requests still waiting."""

    shape: ReplicaShape
    completed: tuple[float, ...]
    seconds: float
    saturated_s: float
    after_saturated: bool = True
    """The replica was saturated through the span before too. The first saturated span of a streak is
    not a measurement: its batch was filling up, so it finished less than it worked on."""
    tpot_s: float = float("nan")
    """Mean time per output token of the requests it finished in the span (NaN: none had two tokens)."""

    def __post_init__(self) -> None:
        if not self.seconds > 0 or self.saturated_s < 0 or any(c < 0 for c in self.completed):
            raise ConfigError(f"ReplicaWindow: seconds > 0, saturated_s and completions >= 0: {self}")


@dataclass(frozen=True)
class Correction:
    """The learned time scales in force (rounded), their posterior sd and the evidence behind them."""

    scales: Scales = field(default_factory=dict)
    """(shape, class) -> u, only for pairs that differ from 1 after rounding."""
    sd: Scales = field(default_factory=dict)
    """(shape, class) -> posterior sd of u, for every pair with evidence."""
    windows: dict[ReplicaShape, int] = field(default_factory=dict)
    """Observations (replica spans) that moved each shape's estimate."""

    @property
    def key(self) -> tuple:
        return tuple(sorted((s.tp, s.pp, j, round(v, 6)) for (s, j), v in self.scales.items()))

    def shape_scale(self, shape: ReplicaShape, work: np.ndarray) -> float:
        """One time scale for `shape` over classes weighted by `work` (each class's share of its time). Pure."""
        work = np.asarray(work, dtype=float)
        if work.sum() <= 0:
            return 1.0
        u = np.array([self.scales.get((shape, j), 1.0) for j in range(len(work))])
        return float(np.dot(work, u) / work.sum())

    def to_dict(self) -> dict:
        """JSON-ready (the live scheduler keeps it in the strategy bucket and publishes it)."""
        return {
            "scales": [[s.tp, s.pp, j, v] for (s, j), v in sorted(self.scales.items())],
            "sd": [[s.tp, s.pp, j, v] for (s, j), v in sorted(self.sd.items())],
            "windows": [[s.tp, s.pp, n] for s, n in sorted(self.windows.items())],
        }


class CapacityLearner:
    """Learns the per-(shape, class) time scales from replica spans (module docstring). The state is one
    mean and one covariance over every (shape, class) pair of `shapes`; `to_dict` / `load_dict` carry it
    across restarts."""

    def __init__(self, table: CapacityTable, shapes: Iterable[ReplicaShape],
                 config: LearnerConfig = LearnerConfig()) -> None:
        self.table = table
        self.config = config
        self.k = len(table.type_names)
        self.shapes: tuple[ReplicaShape, ...] = tuple(sorted(set(shapes)))
        if not self.shapes:
            raise ConfigError("CapacityLearner: no shapes to learn")
        self._index = {s: i for i, s in enumerate(self.shapes)}
        self._saturated: dict[tuple, float] = {}
        self.full_table = CapacityTable(table.model, table.gpu, table.types,
                                        LatencyTarget(tbt_s=1e9, kv_headroom_frac=table.target.kv_headroom_frac,
                                                      kv_sigmas=table.target.kv_sigmas),
                                        table.memory, table.gpus_per_node, table.engine, table.perf,
                                        table.max_replica_gpus, table.max_pp)
        """The capacity model without a latency bound (a full replica's rate, analytically): cheap weights for
        a shape's classes where a simulated probe is not worth its cost (the twin's per-shape scale)."""
        self._mean = np.ones(len(self.shapes) * self.k)
        self._cov = prior_covariance(len(self.shapes), self.k, config)
        self._windows: dict[ReplicaShape, int] = {}
        self._tables: dict[tuple, CorrectedTable] = {}

    # --- state ------------------------------------------------------------------------------------

    def _slice(self, shape: ReplicaShape) -> slice:
        if shape not in self._index:
            raise ConfigError(f"CapacityLearner: shape {shape} is not one of {', '.join(map(str, self.shapes))}")
        i = self._index[shape] * self.k
        return slice(i, i + self.k)

    def mean(self, shape: ReplicaShape) -> np.ndarray:
        """Posterior mean of u for `shape` (the prior, all ones, when nothing was seen), bounded. Pure."""
        lo, hi = self.config.scale_bounds
        return np.clip(self._mean[self._slice(shape)], lo, hi)

    def sd(self, shape: ReplicaShape) -> np.ndarray:
        """Posterior sd of u for `shape`. Pure."""
        sl = self._slice(shape)
        return np.sqrt(np.maximum(np.diag(self._cov)[sl], 0.0))

    def work(self, shape: ReplicaShape, completed: Iterable[float]) -> np.ndarray:
        """Replica-seconds the model says each class's completions cost on `shape` when it is full: the
        seconds a full model replica takes to finish that many of that mix (`saturated_rate` of the mix,
        rounded to `mix_quantum`), shared among the classes as their pure-class costs are. Pure."""
        c = np.asarray(tuple(completed), dtype=float)
        if len(c) != self.k:
            raise ConfigError(f"CapacityLearner: {len(c)} completion counts for {self.k} classes")
        if c.sum() <= 0:
            return np.zeros(self.k)
        pure = c / self.saturated_rates(shape)
        q = self.config.mix_quantum
        mix = tuple(int(round(v / q)) for v in c / c.sum())
        key = (shape, mix)
        rate = self._saturated.get(key)
        if rate is None:
            rate = self._saturated[key] = saturated_rate(self.table, shape, np.maximum(np.array(mix, float), 0) + 1e-9,
                                                         self.config.probe_batches)
        return pure * (float(c.sum()) / rate) / float(pure.sum())

    def saturated_rates(self, shape: ReplicaShape) -> np.ndarray:
        """Per class, the rate a full replica of `shape` serves in the performance model: a replica of the
        simulated engine fed only that class with its queue never empty (`saturated_rate`); cached."""
        out = []
        for j in range(self.k):
            hit = self._saturated.get((shape, j))
            if hit is None:
                hit = self._saturated[(shape, j)] = saturated_rate(self.table, shape, np.eye(self.k)[j],
                                                                   self.config.probe_batches)
            out.append(hit)
        return np.array(out)

    # --- learning ---------------------------------------------------------------------------------

    def observe(self, window: ReplicaWindow) -> bool:
        """Learn from one replica span; True when it moved the estimate."""
        cfg = self.config
        c = np.asarray(window.completed, dtype=float)
        total = float(c.sum())
        if total < cfg.min_completions or window.shape not in self._index:
            return False
        sl = self._slice(window.shape)
        a = np.zeros(len(self._mean))
        a[sl] = self.work(window.shape, c)
        y = window.seconds
        saturated = window.saturated_s >= cfg.saturated_frac * window.seconds
        if saturated and not window.after_saturated:
            return False  # the onset of a saturation: not a measurement of what it serves
        if not saturated and float(a @ self._mean) <= y * (1.0 + cfg.unsaturated_slack):
            return False  # it had time to spare and the estimate agrees: nothing learned
        var = (y * y) * (cfg.noise_frac ** 2 + 1.0 / total)
        pa = self._cov @ a
        gain = pa / (float(a @ pa) + var)
        self._mean = self._mean + gain * (y - float(a @ self._mean))
        self._cov = self._cov - np.outer(gain, pa)
        self._cov = (self._cov + self._cov.T) / 2.0
        self._windows[window.shape] = self._windows.get(window.shape, 0) + 1
        return True

    # --- what the planner uses -------------------------------------------------------------------

    def correction(self) -> Correction:
        """The estimates in force, rounded to `quantum` (pairs at 1 after rounding left out)."""
        q = self.config.quantum
        scales, sds = {}, {}
        for shape in self.shapes:
            mean, sd = self.mean(shape), self.sd(shape)
            for j in range(self.k):
                sds[(shape, j)] = float(sd[j])
                u = float(math.exp(round(math.log(mean[j]) / q) * q))
                if abs(u - 1.0) > 1e-9:
                    scales[(shape, j)] = u
        return Correction(scales, sds, dict(self._windows))

    def corrected_table(self, correction: Correction) -> CapacityTable:
        """The capacity table with `correction`'s time scales (the prior table itself without any); cached."""
        if not correction.scales:
            return self.table
        hit = self._tables.get(correction.key)
        if hit is None:
            t = self.table
            hit = CorrectedTable(t.model, t.gpu, t.types, t.target, t.memory, t.gpus_per_node, t.engine, t.perf,
                                 t.max_replica_gpus, time_scales=dict(correction.scales))
            if len(self._tables) > 64:
                self._tables.clear()
            self._tables[correction.key] = hit
        return hit

    def report(self, shapes: Iterable[ReplicaShape] | None = None) -> list[dict]:
        """Model against learned capacity (requests/s) per shape and class, with the estimate's sd and
        evidence: what the report shows (every shape with evidence when `shapes` is None)."""
        corr = self.correction()
        table = self.corrected_table(corr)
        rows = []
        for shape in (shapes if shapes is not None else [s for s in self.shapes if s in self._windows]):
            for j, name in enumerate(self.table.type_names):
                rows.append({"shape": str(shape), "class": name, "model_rps": self.table.rate(shape, j),
                             "learned_rps": table.rate(shape, j), "scale": corr.scales.get((shape, j), 1.0),
                             "sd": corr.sd.get((shape, j), math.nan), "windows": corr.windows.get(shape, 0)})
        return rows

    # --- persistence -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"classes": list(self.table.type_names), "shapes": [[s.tp, s.pp] for s in self.shapes],
                "mean": self._mean.tolist(), "cov": self._cov.tolist(),
                "windows": [[s.tp, s.pp, n] for s, n in sorted(self._windows.items())]}

    def load_dict(self, state: dict) -> None:
        """Resume from `to_dict`'s output; a state for other classes or shapes is refused (another prior)."""
        shapes = tuple(ReplicaShape(int(tp), int(pp)) for tp, pp in state.get("shapes", []))
        if list(state.get("classes", [])) != list(self.table.type_names) or shapes != self.shapes:
            raise ConfigError(f"CapacityLearner: saved state is for classes {state.get('classes')} and shapes "
                              f"{[str(s) for s in shapes]}, not {list(self.table.type_names)} and "
                              f"{[str(s) for s in self.shapes]}")
        mean, cov = np.asarray(state["mean"], dtype=float), np.asarray(state["cov"], dtype=float)
        n = len(self._mean)
        if mean.shape != (n,) or cov.shape != (n, n) or not (np.isfinite(mean).all() and np.isfinite(cov).all()):
            raise ConfigError("CapacityLearner: saved state has the wrong size or non-finite values")
        self._mean, self._cov = mean, cov
        self._windows = {ReplicaShape(int(tp), int(pp)): int(c) for tp, pp, c in state.get("windows", [])}
        self._tables.clear()


def saturated_rate(table: CapacityTable, shape: ReplicaShape, mix: np.ndarray, batches: int = 6,
                   seed: int = 0) -> float:
    """Requests/s a replica of `shape` serves of a class `mix` (fractions) with its queue never empty, in
    the performance model: `batches` times as many requests as the engine's batch holds, each of a class
    drawn from `mix` with that class's lengths, queued at once on one simulated engine
    (`oserve.engine_model.SimReplica`); the rate measured between the 30th and the 80th percentile of
    their finish times (past the ramp-up, before the queue runs dry). What a saturated real replica is
    compared with: the same engine model that times the simulator and the twin, so the model's own
    effects (preemption, chunked prefill, mixed batches, pipeline bubbles) are not mistaken for an engine
    error. Deterministic. Pure."""
    from oserve.engine_model import SimReplica, SimRequest
    from oserve.specs import kv_capacity_tokens

    model = table.model
    mix = np.asarray(mix, dtype=float)
    if mix.min() < 0 or not mix.sum() > 0:
        raise ConfigError(f"saturated_rate: mix must be >= 0 with a positive sum, got {mix.tolist()}")
    num_requests = max(200, batches * table.engine.max_num_seqs * shape.pp)
    rng = np.random.default_rng(seed)
    classes = rng.choice(len(mix), size=num_requests, p=mix / mix.sum())
    inp = np.zeros(num_requests, dtype=np.int64)
    out = np.zeros(num_requests, dtype=np.int64)
    for j in np.unique(classes):
        sel = np.nonzero(classes == j)[0]
        inputs, outputs, weights = table.types.type_lengths(int(j))
        pick = rng.choice(len(inputs), size=len(sel), p=np.asarray(weights, dtype=float) / np.sum(weights))
        inp[sel], out[sel] = np.asarray(inputs)[pick], np.asarray(outputs)[pick]
    inp = np.minimum(inp, model.max_context_tokens - 1)
    out = np.maximum(np.minimum(out, model.max_context_tokens - inp), 1)
    kv = kv_capacity_tokens(model, table.gpu, shape, table.memory)
    rep = SimReplica("probe", shape, table.perf.timer(shape), table.engine, kv, table.memory.block_tokens)
    end = None
    for i in range(num_requests):
        e = rep.enqueue(SimRequest(i, int(classes[i]), 0.0, int(inp[i]), int(out[i])), 0.0)
        end = e if e is not None else end
    finish: list[float] = []
    while end is not None:
        step = rep.on_step_end(end)
        finish += [end] * len(step.finished)
        end = step.next_end_s
    if len(finish) < 10:
        raise ConfigError(f"saturated_rate: {shape} finished {len(finish)} of {num_requests} requests")
    f = np.sort(np.asarray(finish))
    lo, hi = int(0.3 * len(f)), int(0.8 * len(f))
    return float((hi - lo) / max(f[hi] - f[lo], 1e-9))


def prior_covariance(num_shapes: int, k: int, config: LearnerConfig) -> np.ndarray:
    """The prior covariance of u over (shape, class) pairs, shape-major: a common error of the whole model
    (GPU generation, engine version), one per shape (its parallelism's costs), one per class across shapes
    (long contexts, say) and one per pair, independent. What one replica's mix reveals then moves the
    pairs it says nothing about as far as they are expected to share its error. Pure."""
    g, s, t, e = config.prior_sd_parts
    n = num_shapes * k
    shape_of = np.repeat(np.arange(num_shapes), k)
    class_of = np.tile(np.arange(k), num_shapes)
    same_shape = (shape_of[:, None] == shape_of[None, :]).astype(float)
    same_class = (class_of[:, None] == class_of[None, :]).astype(float)
    return g * g * np.ones((n, n)) + s * s * same_shape + t * t * same_class + e * e * np.eye(n)


def replica_windows(stats_before: dict, stats_now: Iterable, completions: Iterable, num_classes: int,
                    span_s: float, saturated_before: frozenset | set = frozenset()) -> list[ReplicaWindow]:
    """One `ReplicaWindow` per replica that served the whole span, from its cumulative counters at the span's
    start (`stats_before`: gpu ids -> stats) and end, and the completions of the span (by the GPUs of the
    replica that finished each); `saturated_before` holds the GPUs of the replicas saturated through the
    span before. A replica new in the span (no counters at its start) or not ready is skipped: it was
    switching in. Pure."""
    counts: dict[tuple[int, ...], np.ndarray] = {}
    tpot: dict[tuple[int, ...], list[float]] = {}
    for c in completions:
        gpus = tuple(c.replica_gpus)
        row = counts.setdefault(gpus, np.zeros(num_classes))
        if 0 <= c.routed_class < num_classes:
            row[c.routed_class] += 1
        first = getattr(c, "first_token_s", math.nan)
        if c.output_tokens > 1 and math.isfinite(first):
            tpot.setdefault(gpus, []).append((c.finish_s - first) / (c.output_tokens - 1))
    out = []
    for s in stats_now:
        before = stats_before.get(tuple(s.gpu_ids))
        if before is None or before.shape != s.shape or not s.ready or not before.ready:
            continue
        sat = max(s.saturated_s - before.saturated_s, 0.0)
        row = counts.get(tuple(s.gpu_ids), np.zeros(num_classes))
        gaps = tpot.get(tuple(s.gpu_ids))
        out.append(ReplicaWindow(s.shape, tuple(float(v) for v in row), span_s, min(sat, span_s),
                                 tuple(s.gpu_ids) in saturated_before, float(np.mean(gaps)) if gaps else math.nan))
    return out


def saturated_gpus(stats_before: dict, stats_now: Iterable, span_s: float, saturated_frac: float) -> set:
    """The GPUs of the replicas saturated through the span (for the next span's `replica_windows`). Pure."""
    out = set()
    for s in stats_now:
        before = stats_before.get(tuple(s.gpu_ids))
        if before is not None and s.saturated_s - before.saturated_s >= saturated_frac * span_s:
            out.add(tuple(s.gpu_ids))
    return out
