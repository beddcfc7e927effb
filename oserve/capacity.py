"""Capacity n[shape][type]: the request rate one replica sustains for a workload type. Pure.

This is what the paper gets from one-time profiling on real GPUs; here it comes from the performance
model under a steady-state model of continuous batching:

- B sequences decode concurrently, split into `pp` micro-batches of b = B / pp that take turns on the
  pipeline; every turn, each stage spends `T_stage(b)` on a micro-batch's decode step.
- Every request also brings its prompt, whose marginal cost on the slowest stage (the time it adds to
  an iteration that already carries b decodes, chunked as the engine would) is `dT(I)`.
- In steady state the slowest stage is busy all the time, so one request costs it
  `dT(I) + O * T_stage(b) / b`, and the sustainable rate is

      lambda(B) = 1 / E[dT(I) + O * T_stage(b) / b]

  over the type's (input I, output O) length samples.
- The average time between two tokens of one sequence is then
  `TBT(B) = pp * T_stage(b) / (1 - lambda * E[dT(I)])` (decode rounds are stretched by the prefill
  share), and it must stay within the latency target.
- B is bounded by the KV cache (B sequences of mean in-flight context, weighted by how long each is
  in flight, plus `kv_sigmas` standard deviations of their total, with `kv_headroom_frac` kept free), by `max_num_seqs` per micro-batch, and by
  the TBT target; the capacity is the best rate over the feasible B.
A shape that meets the target at no batch size still gets its B = 1 rate, so capacity is positive and
finite for every valid shape (the scheduler sees it as a slow replica rather than a missing one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from oserve.defaults import GPUS_PER_NODE
from oserve.errors import ConfigError
from oserve.perfmodel import Batch, PerfModel, ScaledTimer, ShapeTimer
from oserve.specs import EngineConfig, GPUSpec, MemoryConfig, ModelSpec, ReplicaShape, kv_capacity_tokens, valid_shapes


class LengthMix(Protocol):
    """What the capacity table needs of workload types (WorkloadTypes satisfies it)."""

    names: tuple[str, ...]

    def type_lengths(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass(frozen=True, slots=True)
class FixedLengths:
    """Workload types given directly as length samples: names[j] has inputs[j], outputs[j] (equal weights)."""

    names: tuple[str, ...]
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.inputs) == len(self.outputs)) or not self.names:
            raise ConfigError("FixedLengths: names, inputs and outputs must have the same non-zero length")
        for name, i, o in zip(self.names, self.inputs, self.outputs):
            if len(i) != len(o) or not i:
                raise ConfigError(f"FixedLengths: type {name!r} needs as many input as output samples, at least one")
            if min(i) < 1 or min(o) < 1:
                raise ConfigError(f"FixedLengths: type {name!r} has a length below 1 token")

    def type_lengths(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self.inputs[j])
        return np.array(self.inputs[j]), np.array(self.outputs[j]), np.full(n, 1.0 / n)

    @classmethod
    def from_observed(cls, names: tuple[str, ...], classes: np.ndarray, input_tokens: np.ndarray,
                      output_tokens: np.ndarray, fallback: LengthMix, num_samples: int = 32) -> FixedLengths:
        """What each class really contains: for class j, `num_samples` observed (input, output) pairs of
        the requests given class j, at evenly spaced quantiles of their output length (a stratified
        sample of real pairs, so a class that mixes short and long answers keeps both, each with its own
        prompt). A class with no request takes `fallback`'s lengths. Pure."""
        classes = np.asarray(classes)
        inp, out = np.asarray(input_tokens, dtype=np.int64), np.asarray(output_tokens, dtype=np.int64)
        if not (len(classes) == len(inp) == len(out)) or num_samples < 1:
            raise ConfigError("FixedLengths.from_observed: classes, inputs and outputs must match, num_samples >= 1")
        ins, outs = [], []
        for j in range(len(names)):
            sel = np.nonzero(classes == j)[0]
            if not len(sel):
                a, b, _ = fallback.type_lengths(j)
                ins.append(tuple(int(v) for v in a))
                outs.append(tuple(int(v) for v in b))
                continue
            order = sel[np.lexsort((inp[sel], out[sel]))]
            pick = order[((np.arange(num_samples) + 0.5) * len(order) / num_samples).astype(np.int64)]
            ins.append(tuple(int(max(v, 1)) for v in inp[pick]))
            outs.append(tuple(int(max(v, 1)) for v in out[pick]))
        return cls(tuple(names), tuple(ins), tuple(outs))


@dataclass(frozen=True, slots=True)
class LatencyTarget:
    """The latency a replica must keep while serving at its capacity."""

    tbt_s: float = 0.1
    """Mean time between two output tokens of one request."""
    kv_headroom_frac: float = 0.1
    """Fraction of the KV cache kept free at capacity, so bursts do not force preemption."""
    kv_sigmas: float = 2.0
    """Standard deviations of the batch's total context kept free on top (length variance)."""

    def __post_init__(self) -> None:
        if not self.tbt_s > 0:
            raise ConfigError(f"LatencyTarget: tbt_s must be positive, got {self.tbt_s}")
        if self.kv_sigmas < 0:
            raise ConfigError(f"LatencyTarget: kv_sigmas must be >= 0, got {self.kv_sigmas}")
        if not 0.0 <= self.kv_headroom_frac < 1.0:
            raise ConfigError(f"LatencyTarget: kv_headroom_frac must be in [0, 1), got {self.kv_headroom_frac}")


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """How a replica of one shape serves one type at capacity."""

    rate_per_s: float
    batch_seqs: int
    """Concurrent sequences B at capacity."""
    tbt_s: float
    limit: str
    """What bounds B: 'kv', 'max_num_seqs', 'tbt', or 'tbt-unmet' when even B = 1 misses the target."""


@dataclass
class CapacityTable:
    """Cached n[shape][type] for one model, GPU type and set of workload types."""

    model: ModelSpec
    gpu: GPUSpec
    types: LengthMix
    target: LatencyTarget = field(default_factory=LatencyTarget)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    gpus_per_node: int = GPUS_PER_NODE
    engine: EngineConfig = field(default_factory=EngineConfig)
    perf: PerfModel | None = None
    max_replica_gpus: int = 16
    """Largest replica considered: beyond two nodes, pipeline bubbles and network hops only cost."""
    max_pp: int | None = None
    """Deepest pipeline the engines run (None: no limit). vLLM 0.32's CPU build runs none (1): a PP2 engine
    started, then died at its first step; a planner that does not know it picks shapes no engine can serve."""
    _cache: dict = field(default_factory=dict, init=False, repr=False)
    _curves: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.perf is None:
            self.perf = PerfModel(self.model, self.gpu, gpus_per_node=self.gpus_per_node)
        self._samples = [self.types.type_lengths(j) for j in range(len(self.types.names))]

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(self.types.names)

    def shapes(self, max_gpus: int) -> tuple[ReplicaShape, ...]:
        """Valid shapes of at most `max_gpus` (and `max_replica_gpus`) GPUs, sorted by (GPUs, TP)."""
        shapes = valid_shapes(self.model, self.gpu, self.gpus_per_node, min(max_gpus, self.max_replica_gpus),
                              self.memory)
        return shapes if self.max_pp is None else tuple(s for s in shapes if s.pp <= self.max_pp)

    def rate(self, shape: ReplicaShape, type_index: int) -> float:
        """Requests per second a replica of `shape` sustains for type `type_index` (cached)."""
        return self.detail(shape, type_index).rate_per_s

    def matrix(self, shapes: tuple[ReplicaShape, ...] | list[ReplicaShape]) -> np.ndarray:
        """n[k][j] for the given shapes (rows) and every type (columns)."""
        return np.array([[self.rate(s, j) for j in range(len(self.type_names))] for s in shapes])

    def detail(self, shape: ReplicaShape, type_index: int) -> ReplicaCapacity:
        key = (shape, type_index)
        hit = self._cache.get(key)
        if hit is None:
            if not 0 <= type_index < len(self._samples):
                raise ConfigError(f"type index {type_index} outside 0..{len(self._samples) - 1}")
            hit = self._compute(shape, type_index)
            self._cache[key] = hit
        return hit

    def _timer_for(self, shape: ReplicaShape, j: int):
        """The evaluator the capacity of (`shape`, type `j`) is computed with (`CorrectedTable` stretches it)."""
        return self.perf.timer(shape)

    def _compute(self, shape: ReplicaShape, j: int) -> ReplicaCapacity:
        kv_tokens = kv_capacity_tokens(self.model, self.gpu, shape, self.memory)
        if kv_tokens <= 0:
            raise ConfigError(f"{shape} cannot hold {self.model.name} on {self.gpu.name}: no room for KV cache")
        timer = self._timer_for(shape, j)
        inputs, outputs, weights = self._samples[j]
        inputs = np.minimum(inputs, self.model.max_context_tokens - 1)
        outputs = np.maximum(np.minimum(outputs, self.model.max_context_tokens - inputs), 1)
        mean_out = float(np.dot(weights, outputs))
        # Mean context of an in-flight sequence, weighted by the time it spends decoding (its output).
        ctx = float(np.dot(weights, outputs * (inputs + outputs / 2.0)) / mean_out)
        pp = shape.pp
        # Spread of that context (u uniform over the output): B sequences hold about B * ctx tokens
        # give or take sqrt(B) * sd; keep `kv_sigmas` of that spread free so preemption stays rare.
        second = float(np.dot(weights, outputs * (inputs ** 2 + inputs * outputs + outputs ** 2 / 3.0)) / mean_out)
        sd = math.sqrt(max(second - ctx * ctx, 0.0))
        usable = kv_tokens * (1.0 - self.target.kv_headroom_frac)
        z = self.target.kv_sigmas
        root = (-z * sd + math.sqrt(z * z * sd * sd + 4.0 * ctx * usable)) / (2.0 * ctx)
        b_kv = max(1, int(root * root))
        b_max = min(b_kv, self.engine.max_num_seqs * pp)
        limit = "kv" if b_kv <= self.engine.max_num_seqs * pp else "max_num_seqs"

        def evaluate(b_total: int) -> tuple[float, float]:
            b = max(1, round(b_total / pp))
            decode = Batch(num_tokens=b, num_decode_seqs=b, decode_context_tokens=int(b * ctx), num_logit_rows=b)
            t_stage = timer.bottleneck_seconds(decode)
            d_prefill = _mean_prefill_cost(timer, decode, t_stage, inputs, weights, self.engine)
            per_request = d_prefill + mean_out * t_stage / b
            rate = 1.0 / per_request
            busy_prefill = min(rate * d_prefill, 0.999)
            tbt = pp * t_stage / (1.0 - busy_prefill)
            return rate, tbt

        # Rate is not monotone in B everywhere (the prefill chunk budget shrinks and GEMM tiles
        # quantise), so take the best feasible B among fixed candidates; the candidates do not depend
        # on the target, so a looser target can only enlarge the feasible set.
        best: ReplicaCapacity | None = None
        curve = []
        for b_total in _candidates(b_max):
            rate, tbt = evaluate(b_total)
            curve.append((rate, tbt))
            if tbt <= self.target.tbt_s and (best is None or rate > best.rate_per_s):
                best = ReplicaCapacity(rate, b_total, tbt, limit if b_total == b_max else "tbt")
        self._curves[(shape, j)] = tuple(curve)
        if best is None:
            rate, tbt = evaluate(1)
            best = ReplicaCapacity(rate, 1, tbt, "tbt-unmet")
        return best

    def tbt_at(self, shape: ReplicaShape, type_index: int, rate_per_s: float) -> float:
        """The model's mean time between two tokens of a replica of `shape` serving type `type_index` at
        `rate_per_s`: at the smallest batch of the capacity model's candidates that sustains that rate (the
        largest batch's when none does). What the planner expects a replica's time per output token to
        be at the load it plans for it."""
        self.detail(shape, type_index)
        curve = self._curves.get((shape, type_index))
        if curve is None:  # computed before curves were kept (a copied cache)
            self._cache.pop((shape, type_index), None)
            self.detail(shape, type_index)
            curve = self._curves[(shape, type_index)]
        for rate, tbt in curve:
            if rate >= rate_per_s:
                return tbt
        return curve[-1][1]


@dataclass
class CorrectedTable(CapacityTable):
    """A capacity table computed by the same capacity model with the engine's time per (shape, type)
    stretched by `time_scales[(shape, j)]` (1 for a pair not named): what a replica that runs type j
    that much slower (above 1) or faster than the performance model serves under the same latency
    target. The learned table of `oserve.planner.learned` is one."""

    time_scales: dict = field(default_factory=dict)

    def _timer_for(self, shape: ReplicaShape, j: int):
        scale = float(self.time_scales.get((shape, j), 1.0))
        base = self.perf.timer(shape)
        return base if scale == 1.0 else ScaledTimer(base, scale)


def _candidates(b_max: int) -> list[int]:
    """Batch sizes 1..b_max in steps of about 25%, always including b_max."""
    out, b = [], 1
    while b < b_max:
        out.append(b)
        b = max(b + 1, int(b * 1.25))
    out.append(b_max)
    return out


def _mean_prefill_cost(timer: ShapeTimer, decode: Batch, t_decode: float, inputs: np.ndarray,
                       weights: np.ndarray, engine: EngineConfig) -> float:
    """E[time a prompt adds to the slowest stage], chunked by the engine's token budget, over samples."""
    inputs = np.asarray(inputs, dtype=np.int64)
    budget = max(engine.max_num_batched_tokens - decode.num_tokens, 1) if engine.chunked_prefill else None
    if budget is None:
        n_chunks = np.ones_like(inputs)
    else:
        n_chunks = -(-inputs // budget)
    owner = np.repeat(np.arange(len(inputs)), n_chunks)  # chunk -> its sample
    first = np.cumsum(n_chunks) - n_chunks
    index = np.arange(len(owner)) - first[owner]  # chunk's position within its prompt
    done = index * (budget or 0)
    chunk = np.minimum(inputs[owner] - done, budget) if budget is not None else inputs[owner]
    last = (index == n_chunks[owner] - 1).astype(float)
    pairs = chunk * (done + (chunk + 1) / 2.0)
    kv = decode.decode_context_tokens + decode.num_tokens + done + chunk
    t = timer.bottleneck_seconds_many(decode.num_tokens + chunk, pairs, kv, decode.num_logit_rows + last)
    cost = np.bincount(owner, weights=t - t_decode, minlength=len(inputs))
    return float(np.dot(weights, cost))


def homogeneous_rate(table: CapacityTable, shape: ReplicaShape, mix: np.ndarray) -> float:
    """Total request rate one replica of `shape` sustains for a mix of types (fractions summing to 1).

    Each request of type j uses 1 / n[j] of the replica, so the mix rate is 1 / sum_j(mix_j / n_j). Pure.
    """
    mix = np.asarray(mix, dtype=float)
    if mix.min() < 0 or not math.isclose(mix.sum(), 1.0, rel_tol=1e-6):
        raise ConfigError(f"mix fractions must be >= 0 and sum to 1, got {mix.tolist()}")
    n = np.array([table.rate(shape, j) for j in range(len(mix))])
    return float(1.0 / np.sum(mix / n))
