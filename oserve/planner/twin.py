"""A digital twin for plan selection: score a deployment by simulating the forecast span. Pure.

The capacity table rates every shape by throughput at a TBT target; for Llama-2-70B the best few
deployments lie within a few percent of each other there, yet their tail latencies differ by tens of
percent (how many replicas pool the bursts, how fast each decodes a long answer). The planner cannot
tell them apart from the table, so it asks the simulator: each candidate serves a synthetic span made
only of what the planner knows — the arrival times and classes the gateway saw in the last span (at
the forecast's counts; Poisson arrivals when there is no such span), each class's lengths drawn from
what requests of that class turned out to be: the requests of that class that finished in the last
`TwinConfig.recent_spans` spans when there are at least `TwinConfig.min_recent_lengths` of them
(`RecentLengths`), else the length samples the planner was given (measured on completions before the
window served) — with the routing rule every plan is served with
(`oserve.routing.least_loaded`), and the candidate with the shortest tail wins: the mean end-to-end
latency of the slowest 2% of the requests arriving after a warm-up (the P99 region, steadier than one
order statistic of one span).

It runs the same performance model as the simulated cluster, so in the simulator it is a perfectly
calibrated engine model; on real GPUs it would be calibrated by profiling (the paper profiles once).

Deterministic: the synthetic span is drawn from a fixed seed, and every candidate sees the same one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from oserve.capacity import LengthMix
from oserve.correction import CorrectionConfig, OutgrownMover
from oserve.decision import Decision
from oserve.defaults import SPAN_S
from oserve.errors import ConfigError
from oserve.perfmodel import PerfModel
from oserve.routing import ReplicaLoad, least_loaded
from oserve.sim.kernel import ArrivalInfo, BalancerView, Migration, SimConfig, SpanView, simulate
from oserve.specs import ClusterSpec, Deployment, GPUSpec, ModelSpec
from oserve.traces import Trace
from oserve.workload_types import WorkloadTypes


@dataclass(frozen=True, slots=True, eq=False)
class ArrivalPattern:
    """What the gateway saw arrive in one span: each request's offset from the span's start and its class."""

    offsets_s: np.ndarray
    classes: np.ndarray
    span_s: float = SPAN_S
    lengths: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    """Per class, the (input, output) lengths of the requests given that class at arrival that finished
    lately (`RecentLengths.lengths`); empty: none known."""

    def __post_init__(self) -> None:
        offsets = np.asarray(self.offsets_s, dtype=np.float64)
        classes = np.asarray(self.classes, dtype=np.int64)
        if offsets.shape != classes.shape or offsets.ndim != 1:
            raise ConfigError("ArrivalPattern: offsets_s and classes must be 1-D of equal length")
        if not self.span_s > 0:
            raise ConfigError(f"ArrivalPattern: span_s must be positive, got {self.span_s}")
        lengths = []
        for inputs, outputs in self.lengths:
            inputs, outputs = np.asarray(inputs, dtype=np.int64), np.asarray(outputs, dtype=np.int64)
            short = len(inputs) > 0 and min(int(inputs.min()), int(outputs.min())) < 1
            if inputs.shape != outputs.shape or inputs.ndim != 1 or short:
                raise ConfigError("ArrivalPattern: each class's lengths must be 1-D inputs and outputs of equal "
                                  "length, every one at least 1 token")
            lengths.append((inputs, outputs))
        object.__setattr__(self, "offsets_s", offsets)
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "lengths", tuple(lengths))

    def __len__(self) -> int:
        return len(self.offsets_s)


class RecentLengths:
    """What each class turned out to contain lately: the (input, output) lengths of the requests given each
    class at arrival that finished in the last `spans` spans (completions, whose lengths are known now).

    Completions by finish time, not the arrivals of a span that have finished: in a steady mix every request
    finishes, so what finishes in a window is a sample of what arrives (lagged by the answers' length),
    while the arrivals of the last span that have finished so far are the short ones. The simulator's
    gateway and the live scheduler keep one each, fed at every span boundary."""

    def __init__(self, num_classes: int, spans: int) -> None:
        if num_classes < 1 or spans < 1:
            raise ConfigError(f"RecentLengths: need num_classes >= 1 and spans >= 1, got {num_classes}, {spans}")
        self.k = num_classes
        self._spans: deque[list[tuple[int, int, int]]] = deque(maxlen=spans)

    def add_span(self, completed: Iterable[tuple[int, int, int]]) -> None:
        """One span's completions as (class at arrival, input tokens, output tokens); the oldest span is
        forgotten beyond `spans`. A class outside 0..k-1 (unclassed) or a length below 1 is left out."""
        self._spans.append([(int(c), int(i), int(o)) for c, i, o in completed if 0 <= c < self.k and i >= 1 and o >= 1])

    def lengths(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """Per class, (inputs, outputs) of what it kept, oldest span first (`ArrivalPattern.lengths`)."""
        pairs: list[tuple[list[int], list[int]]] = [([], []) for _ in range(self.k)]
        for span in self._spans:
            for c, i, o in span:
                pairs[c][0].append(i)
                pairs[c][1].append(o)
        return tuple((np.array(i, dtype=np.int64), np.array(o, dtype=np.int64)) for i, o in pairs)


@dataclass(frozen=True, slots=True)
class TwinConfig:
    """How candidate deployments are scored."""

    horizon_s: float = 180.0
    """Length of the synthetic span when there is no observed span to replay (Poisson arrivals)."""
    warmup_s: float = 60.0
    """Requests of a Poisson span arriving before this are served but not scored (the replicas start empty)."""
    replay_warmup_s: float = 30.0
    """A replayed span is preceded by its own last `replay_warmup_s` seconds, served but not scored, so the
    replicas meet it about as loaded as they would be: an answer of 500 tokens at the 100 ms TBT target
    decodes for 50 s, most for far less (Azure conversation: median 129 tokens)."""
    seed: int = 0
    max_num_requests: int = 12000
    """Cap on the synthetic span's requests. A Poisson span is shortened beyond it (the rates, which set
    the load, stay as forecast); a replayed span is then played alone, its first third warming up."""
    initial_horizon_s: float = 600.0
    """Length of the Poisson span that scores the first deployment (no observed span yet)."""
    initial_max_num_requests: int = 30000
    """Cap on that span's requests (it is shortened beyond it)."""
    recent_spans: int = 2
    """Spans of completions kept per class for the lengths (`RecentLengths`): two, so a class whose answers
    run longer than a span is seen finishing too."""
    min_recent_lengths: int = 20
    """A class's lengths are drawn from its recent completions when it has at least this many, else from the
    planner's samples (measured before the window). Set once, not tuned."""
    sim: SimConfig = field(default_factory=lambda: SimConfig(span_s=1e9, horizon_after_last_arrival_s=600.0))

    def __post_init__(self) -> None:
        if not self.replay_warmup_s >= 0:
            raise ConfigError(f"TwinConfig: replay_warmup_s must be >= 0, got {self.replay_warmup_s}")
        if not self.horizon_s > self.warmup_s >= 0 or not self.initial_horizon_s > self.warmup_s:
            raise ConfigError(f"TwinConfig: need horizon_s and initial_horizon_s > warmup_s >= 0, got "
                              f"{self.horizon_s}, {self.initial_horizon_s}, {self.warmup_s}")
        if self.recent_spans < 1 or self.min_recent_lengths < 1:
            raise ConfigError(f"TwinConfig: recent_spans and min_recent_lengths must be >= 1, got "
                              f"{self.recent_spans}, {self.min_recent_lengths}")
        if self.max_num_requests < 10 or self.initial_max_num_requests < 10:
            raise ConfigError(f"TwinConfig: max_num_requests and initial_max_num_requests must be >= 10, got "
                              f"{self.max_num_requests}, {self.initial_max_num_requests}")


class FixedPolicy:
    """A policy that serves one deployment for a whole run, each request of a known class routed by the
    routing rule among the replicas the weights give its class (the twin and the ceiling use it). With a
    `mover`, requests that outgrow their class move as OServe's gateway moves them (`oserve.correction`)."""

    def __init__(self, deployment: Deployment, weights: tuple[tuple[float, ...], ...], classes: np.ndarray,
                 name: str = "twin", mover: OutgrownMover | None = None) -> None:
        self.name = name
        self.decision = Decision(deployment, weights, 0.0, (), name)
        self._classes = np.asarray(classes, dtype=np.int64)
        self.mover = mover
        self.migration_interval_s = mover.config.interval_s if mover is not None else None

    def decide(self, view: SpanView) -> Decision | None:
        if self.mover is not None:
            for c in view.completed:
                self.mover.done(c.request_index)
        return self.decision if view.current is None else None

    def classify(self, arrival: ArrivalInfo) -> int:
        cls = int(self._classes[arrival.request_index])
        if self.mover is not None:
            self.mover.admit(arrival.request_index, arrival.input_tokens, cls)
        return cls

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        return least_loaded(loads, self.decision.eligible(class_index))

    def plan_migrations(self, replicas: list[BalancerView], now_s: float) -> list[Migration]:
        return self.mover.plan(replicas, self.decision.eligible) if self.mover is not None else []


class DigitalTwin:
    """Scores deployments on a synthetic span of the forecast (see the module docstring)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, types: LengthMix,
                 config: TwinConfig = TwinConfig(), perf: PerfModel | None = None,
                 classes: WorkloadTypes | None = None, correction: CorrectionConfig | None = None) -> None:
        """With `classes` and `correction`, requests that outgrow their class move as the gateway moves them
        (`oserve.correction`), reclassed by `classes`' centroids."""
        self.model, self.gpu, self.cluster, self.config = model, gpu, cluster, config
        self.classes = classes if correction is not None else None
        self.correction = correction
        self.perf = perf or PerfModel(model, gpu, gpus_per_node=cluster.gpus_per_node)
        self._lengths = [types.type_lengths(j) for j in range(len(types.names))]

    def workload(self, rates: np.ndarray, pattern: ArrivalPattern | None = None,
                 long: bool = False) -> tuple[Trace, np.ndarray, float]:
        """(trace, class of each request, warm-up seconds) of the synthetic span for per-class `rates`.

        With `pattern` (the last span's arrival offsets and classes), each class keeps its observed
        arrival times (resampled with replacement to the forecast's count when that differs), so the
        burstiness the gateway saw is replayed, after its own last `config.replay_warmup_s` seconds that
        warm the replicas up. Without it, Poisson arrivals over `config.horizon_s` (`config.initial_horizon_s` when
        `long`: the first deployment has no observed span to go by and is the costliest to change). Lengths
        come from `pattern.lengths` for a class with at least `config.min_recent_lengths` recent completions,
        else from the planner's samples of the class.
        """
        rates = np.maximum(np.asarray(rates, dtype=float), 0.0)
        rng = np.random.default_rng(self.config.seed)
        total = float(rates.sum())
        if total <= 0:
            none = np.zeros(0, dtype=np.int64)
            return Trace(np.zeros(0), none, none, name="twin"), none, 0.0
        times, kinds = [], []
        if pattern is not None and len(pattern) >= 10:
            offsets, types, span_s = pattern.offsets_s, pattern.classes, pattern.span_s
            for j, lam in enumerate(rates):
                seen = offsets[types == j]
                want = int(round(lam * span_s))
                if want == len(seen):
                    t = seen
                elif len(seen):
                    t = rng.choice(seen, size=want) + rng.normal(0.0, 0.05, size=want)
                else:
                    t = rng.random(want) * span_s
                times.append(np.clip(t, 0.0, span_s))
                kinds.append(np.full(len(t), j))
            one = np.concatenate(times)
            kind1 = np.concatenate(kinds)
            warm = min(self.config.replay_warmup_s, span_s)
            # strictly before the span's end: a copy of an arrival at the very end would land at `warm`,
            # where the scored span starts, and be counted twice
            tail = (one >= span_s - warm) & (one < span_s)
            if len(one) + int(tail.sum()) <= self.config.max_num_requests:
                arrival = np.concatenate([one[tail] - (span_s - warm), one + warm])
                kind = np.concatenate([kind1[tail], kind1])
            else:
                arrival, kind, warm = one, kind1, span_s / 3.0
        else:
            seconds = (min(self.config.initial_horizon_s, self.config.initial_max_num_requests / total) if long
                       else min(self.config.horizon_s, self.config.max_num_requests / total))
            for j, lam in enumerate(rates):
                n = int(rng.poisson(lam * seconds))
                times.append(rng.random(n) * seconds)
                kinds.append(np.full(n, j))
            arrival, kind = np.concatenate(times), np.concatenate(kinds)
            warm = min(self.config.warmup_s, seconds / 3.0)
        inp = np.zeros(len(arrival), dtype=np.int64)
        out = np.zeros(len(arrival), dtype=np.int64)
        recent = pattern.lengths if pattern is not None else ()
        for j in range(len(rates)):
            sel = np.nonzero(kind == j)[0]
            if not len(sel):
                continue
            if j < len(recent) and len(recent[j][0]) >= self.config.min_recent_lengths:
                inputs, outputs = recent[j]  # what the class turned out to contain lately
                pick = rng.integers(0, len(inputs), size=len(sel))
            else:
                inputs, outputs, weights = self._lengths[j]
                pick = rng.choice(len(inputs), size=len(sel), p=weights / weights.sum())
            inp[sel], out[sel] = inputs[pick], outputs[pick]
        order = np.argsort(arrival, kind="stable")
        return Trace(arrival[order], inp[order], out[order], name="twin"), kind[order].astype(np.int64), warm

    def score(self, deployment: Deployment, weights: tuple[tuple[float, ...], ...], rates: np.ndarray,
              pattern: ArrivalPattern | None = None, long: bool = False) -> float:
        """Tail latency (s): the mean end-to-end latency of the slowest 2% of the synthetic span's scored
        requests on `deployment` (see `workload`); a request left unfinished counts as infinitely late."""
        trace, classes, warm = self.workload(rates, pattern, long)
        if len(trace) < 10 or not deployment.replicas:
            return 0.0 if deployment.replicas else float("inf")
        mover = None
        if self.classes is not None and self.correction is not None:
            log_outputs = np.array(self.classes.centroids_log)[:, 1]
            mover = OutgrownMover(self.model, self.cluster, self.classes.classify_one, lambda: log_outputs,
                                  self.correction)
        res = simulate(self.model, self.gpu, self.cluster, trace, FixedPolicy(deployment, weights, classes, mover=mover),
                       self.config.sim, self.perf)
        scored = (res.arrival_s >= warm) & res.admitted
        e2e = np.sort(res.e2e_s[scored])
        if not len(e2e):
            return 0.0
        # the mean of the slowest 2%: the P99 region, steadier than one order statistic of one span
        return float(e2e[int(len(e2e) * 0.98):].mean())
