"""A digital twin for plan selection: score candidate deployments by simulating the forecast span. Pure.

The capacity table rates every shape by throughput at a TBT target; for Llama-2-70B the best few
deployments lie within a few percent of each other there, yet their tail latencies differ by tens of
percent (how many replicas pool the bursts, how fast each decodes a long answer). The planner cannot
tell them apart from the table, so it asks the simulator: each candidate serves a synthetic span made
only of what the planner knows — the arrival times and types the gateway saw in the last span (at the
forecast's counts; Poisson arrivals when there is no such span), each type's lengths drawn from its
fitted length samples — with the same routing OServe uses, and the candidate with the shortest tail
wins: the mean end-to-end latency of the slowest 2% of the requests arriving after a warm-up (the
P99 region, steadier than one order statistic of one span).

What the twin knows that a deployment would have to learn: the length samples come from the workload
types, which the evaluation fits on the whole trace it then serves (as the capacity table does), and
it runs the same performance model as the simulated cluster, so it is a perfectly calibrated engine
model. On real GPUs both would come from profiling and the completed requests of earlier hours. As
the paper profiles the real engine once, OServe here consults its calibrated engine model online.

Deterministic: the synthetic span is drawn from a fixed seed, and every candidate sees the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from oserve.capacity import LengthMix
from oserve.errors import ConfigError
from oserve.perfmodel import PerfModel
from oserve.sim.cluster import Decision, SimConfig, SpanView, simulate
from oserve.sim.engine import SimReplica, SimRequest
from oserve.specs import ClusterSpec, Deployment, GPUSpec, ModelSpec, ReplicaShape

Route = Callable[[list[SimReplica], tuple[float, ...] | None], int | None]


@dataclass(frozen=True, slots=True)
class TwinConfig:
    """How candidate deployments are scored."""

    horizon_s: float = 180.0
    """Length of the synthetic span when there is no observed span to replay (Poisson arrivals)."""
    warmup_s: float = 60.0
    """Requests arriving before this are served but not scored (the replicas start empty)."""
    seed: int = 0
    max_num_requests: int = 12000
    """Cap on the synthetic span's requests. A Poisson span is shortened beyond it (the rates, which set
    the load, stay as forecast); a replayed span is then played once, its first third warming up,
    instead of twice."""
    initial_horizon_s: float = 600.0
    """Length of the Poisson span that scores the first deployment (no observed span yet)."""
    initial_max_num_requests: int = 30000
    """Cap on that span's requests (it is shortened beyond it)."""
    sim: SimConfig = field(default_factory=lambda: SimConfig(span_s=1e9, horizon_after_last_arrival_s=600.0))

    def __post_init__(self) -> None:
        if not self.horizon_s > self.warmup_s >= 0 or not self.initial_horizon_s > self.warmup_s:
            raise ConfigError(f"TwinConfig: need horizon_s and initial_horizon_s > warmup_s >= 0, got "
                              f"{self.horizon_s}, {self.initial_horizon_s}, {self.warmup_s}")
        if self.max_num_requests < 10 or self.initial_max_num_requests < 10:
            raise ConfigError(f"TwinConfig: max_num_requests and initial_max_num_requests must be >= 10, got "
                              f"{self.max_num_requests}, {self.initial_max_num_requests}")


class FixedPolicy:
    """A policy that serves one deployment for the whole run: fixed weights give each type its
    replicas, and `route` picks among them (the twin and `oserve.sim.ceiling` pass OServe's)."""

    def __init__(self, deployment: Deployment, weights: tuple[tuple[float, ...], ...], route: Route,
                 name: str = "twin") -> None:
        self.name = name
        self.decision = Decision(deployment, weights, 0.0, (), name)
        self._route = route

    def decide(self, view: SpanView) -> Decision | None:
        return self.decision if view.current is None else None

    def route(self, req: SimRequest, replicas: list[SimReplica]) -> int | None:
        w = self.decision.weights
        return self._route(replicas, w[req.type_index] if req.type_index < len(w) else None)


class DigitalTwin:
    """Scores deployments on a synthetic span of the forecast (see the module docstring)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, types: LengthMix,
                 config: TwinConfig = TwinConfig(), perf: PerfModel | None = None) -> None:
        self.model, self.gpu, self.cluster, self.config = model, gpu, cluster, config
        self.perf = perf or PerfModel(model, gpu, gpus_per_node=cluster.gpus_per_node)
        self._lengths = [types.type_lengths(j) for j in range(len(types.names))]

    def workload(self, rates: np.ndarray, pattern: tuple[np.ndarray, np.ndarray] | None = None,
                 span_s: float = 60.0,
                 long: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
        """(arrival_s, input, output, type, warm-up seconds) of the synthetic span for per-type `rates`.

        With `pattern` (the last span's arrival offsets and types), each type keeps its observed
        arrival times (resampled with replacement to the forecast's count when that differs), so the
        burstiness the gateway saw is replayed; the span is played twice and the first copy warms the
        replicas up. Without it, Poisson arrivals over `config.horizon_s` (`config.initial_horizon_s` when
        `long`: the first deployment has no observed span to go by and is the costliest to change).
        """
        rates = np.maximum(np.asarray(rates, dtype=float), 0.0)
        rng = np.random.default_rng(self.config.seed)
        total = float(rates.sum())
        if total <= 0:
            none = np.zeros(0, dtype=np.int64)
            return np.zeros(0), none, none, none, 0.0
        times, kinds = [], []
        if pattern is not None and len(pattern[0]) >= 10:
            offsets, types = np.asarray(pattern[0], dtype=float), np.asarray(pattern[1])
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
            if 2 * len(one) <= self.config.max_num_requests:
                arrival = np.concatenate([one, one + span_s])
                kind = np.concatenate([kind1, kind1])
                warm = span_s
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
        for j in range(len(rates)):
            sel = np.nonzero(kind == j)[0]
            if len(sel):
                inputs, outputs, weights = self._lengths[j]
                pick = rng.choice(len(inputs), size=len(sel), p=weights / weights.sum())
                inp[sel], out[sel] = inputs[pick], outputs[pick]
        order = np.argsort(arrival, kind="stable")
        return arrival[order], inp[order], out[order], kind[order].astype(np.int64), warm

    def score(self, deployment: Deployment, weights: tuple[tuple[float, ...], ...], rates: np.ndarray,
              route: Route, pattern: tuple[np.ndarray, np.ndarray] | None = None, span_s: float = 60.0,
              long: bool = False) -> float:
        """Tail latency (s): the mean end-to-end latency of the slowest 2% of the synthetic span's scored
        requests on `deployment` (see `workload`); a request left unfinished counts as infinitely late."""
        arrival, inp, out, kind, warm = self.workload(rates, pattern, span_s, long)
        if len(arrival) < 10 or not deployment.replicas:
            return 0.0 if deployment.replicas else float("inf")
        res = simulate(self.model, self.gpu, self.cluster, arrival, inp, out, kind, len(self._lengths),
                       FixedPolicy(deployment, weights, route), self.config.sim, self.perf)
        scored = res.arrival_s >= warm
        e2e = np.sort(np.where(res.dropped, np.inf, res.e2e_s)[scored])
        if not len(e2e):
            return 0.0
        # the mean of the slowest 2%: the P99 region, steadier than one order statistic of one span
        return float(e2e[int(len(e2e) * 0.98):].mean())


Multiset = tuple[ReplicaShape, ...]
"""A deployment's replica shapes, sorted."""


def neighbours(shapes: Sequence[ReplicaShape], valid: Sequence[ReplicaShape]) -> set[Multiset]:
    """Deployments one move from the multiset `shapes`, each as a sorted tuple of `valid` shapes. Pure.

    A move replaces one replica by another shape of as many GPUs, splits one replica into two whose
    GPUs sum to its own, or merges two replicas into one shape of their summed GPUs. So every
    neighbour uses exactly the GPUs `shapes` uses, and the relation is symmetric (a split undoes a
    merge). Whether a neighbour packs onto the cluster's nodes is not checked here.
    """
    by_gpus: dict[int, list[ReplicaShape]] = {}
    for shape in dict.fromkeys(valid):
        by_gpus.setdefault(shape.num_gpus, []).append(shape)
    combo = sorted(shapes)
    out: set[Multiset] = set()
    for i, shape in enumerate(combo):
        rest = combo[:i] + combo[i + 1:]
        for other in by_gpus.get(shape.num_gpus, []):
            if other != shape:
                out.add(tuple(sorted(rest + [other])))
        for a in range(1, shape.num_gpus // 2 + 1):
            for x in by_gpus.get(a, []):
                for y in by_gpus.get(shape.num_gpus - a, []):
                    out.add(tuple(sorted(rest + [x, y])))
        for j in range(i + 1, len(combo)):
            rest2 = [c for t, c in enumerate(combo) if t not in (i, j)]
            for merged in by_gpus.get(shape.num_gpus + combo[j].num_gpus, []):
                out.add(tuple(sorted(rest2 + [merged])))
    out.discard(tuple(combo))
    return out


def local_search(start: Sequence[ReplicaShape], start_score: float, valid: Sequence[ReplicaShape],
                 score: Callable[[Multiset], float | None], max_steps: int,
                 min_gain: float = 0.0) -> tuple[Multiset, float]:
    """Steepest descent over `neighbours` from `start` (scored `start_score`): at most `max_steps` moves,
    each to the best-scoring neighbour while it beats the current score by more than the fraction
    `min_gain`. `score` returns None for a deployment that is not allowed (it does not pack, or gives
    up too much capacity); it is called at most once per multiset. Returns the deployment reached and
    its score. Pure given `score`."""
    seen: dict[Multiset, float | None] = {}
    best, best_score = tuple(sorted(start)), start_score
    seen[best] = start_score
    for _ in range(max_steps):
        step = None
        for nb in sorted(neighbours(best, valid)):
            if nb not in seen:
                seen[nb] = score(nb)
            value = seen[nb]
            if value is not None and value < best_score * (1 - min_gain) and (step is None or value < step[1]):
                step = (nb, value)
        if step is None:
            break
        best, best_score = step
    return best, best_score
