"""Time of one engine iteration for a replica shape on a GPU type. Pure.

Linear layers, element-wise operators and collectives use coefficients fitted to measured H100
profiles (fitted by `oserve.calibration`; they ship in `oserve/data/perf_coefficients.json`). Attention has
no measured data, so it is modelled from first principles under the assumptions in `AttentionModel`.

An iteration runs one batch: prefill chunks (new prompt tokens, each after some cached tokens) and
decode sequences (one new token each, with their context lengths). Per pipeline stage:

    stage time = layers x (linear(M) + attention + 2 all-reduces of M x hidden if TP > 1)
                 [+ embedding on the first stage] [+ LM head on the last stage]

with M the batch's tokens. A batch's latency through the pipeline is the sum of its stage times plus
one send/recv of M x hidden per stage boundary plus a fixed per-iteration engine overhead. With
pipeline parallelism, micro-batches overlap, so a replica's throughput is set by its slowest stage.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from oserve.data import data_path
from oserve.defaults import GPUS_PER_NODE
from oserve.errors import ConfigError
from oserve.specs import GPUSpec, ModelSpec, ReplicaShape, kv_heads_per_gpu, stage_layers

# --- the model's formulas (fitted by `oserve.calibration`) ---------------------------------------

COEFFICIENTS_FILE = "perf_coefficients.json"
"""The fitted coefficients, shipped in `oserve.data` and rebuilt by `oserve calibrate`."""
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
GEMM_TILE_ROWS = 128


def gemm_dims(hidden: np.ndarray, heads: np.ndarray, kv_heads: np.ndarray, ffn: np.ndarray,
              tp: np.ndarray, gated: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(K, N) of each per-GPU GEMM of one layer under TP. Pure; works on scalars or arrays."""
    head_dim = hidden // heads
    kv = np.maximum(1, kv_heads // tp) * head_dim
    return {
        "attn_pre_proj": (hidden, hidden // tp + 2 * kv),
        "attn_post_proj": (hidden // tp, hidden),
        "mlp_up_proj": (hidden, (2 if gated else 1) * ffn // tp),
        "mlp_down_proj": (ffn // tp, hidden),
    }


def elementwise_widths(hidden, heads, kv_heads, ffn, tp, gated: bool = True) -> dict[str, object]:
    """Elements per token each element-wise operator touches on one GPU. Pure."""
    head_dim = hidden // heads
    return {
        "input_layernorm": hidden,
        "post_attention_layernorm": hidden,
        "add": hidden,
        "attn_rope": heads // tp * head_dim + np.maximum(1, kv_heads // tp) * head_dim,
        "mlp_act": ffn // tp * (2 if gated else 1),
    }


def gemm_seconds(theta: dict[str, float] | np.ndarray, m, k, n, peak_flops: float, hbm_bytes_per_s: float,
                 bytes_per_elem: int = 2):
    """Roofline time of an (m x k) @ (k x n) GEMM, its rows padded to the kernel's tile (`theta["tile_rows"]`,
    else `GEMM_TILE_ROWS`). Pure; vectorised over m, k, n."""
    tile = GEMM_TILE_ROWS
    if isinstance(theta, dict):
        t0, eff_f, eff_b, p = theta["t0_s"], theta["eff_flops"], theta["eff_bw"], theta["p"]
        tile = theta.get("tile_rows", GEMM_TILE_ROWS)
    else:
        t0, eff_f, eff_b, p = theta
    m_tiles = np.ceil(np.asarray(m, dtype=float) / tile) * tile
    compute = 2.0 * m_tiles * k * n / (eff_f * peak_flops)
    memory = bytes_per_elem * (k * n + np.asarray(m, float) * k + np.asarray(m, float) * n) / (eff_b * hbm_bytes_per_s)
    return t0 + (compute ** p + memory ** p) ** (1.0 / p)


def collective_seconds(curve: dict[str, list[float]], size_bytes):
    """Time of one collective from its fitted curve; linear in size beyond the measured range. Pure."""
    xs = np.asarray(curve["size_bytes"])
    ys = np.asarray(curve["seconds"])
    s = np.maximum(np.asarray(size_bytes, dtype=float), 1.0)
    inside = np.exp(np.interp(np.log(s), np.log(xs), np.log(ys)))
    # Beyond the largest size: the last segment's bandwidth; below the smallest: its latency floor.
    tail_bw = (xs[-1] - xs[-2]) / max(ys[-1] - ys[-2], 1e-12)
    return np.where(s > xs[-1], ys[-1] + (s - xs[-1]) / tail_bw, inside)


@lru_cache(maxsize=1)
def shipped_coefficients() -> dict:
    """The fitted coefficients shipped with the package (read once)."""
    with open(data_path(COEFFICIENTS_FILE)) as f:
        return json.load(f)


@dataclass(frozen=True, slots=True)
class AttentionModel:
    """First-principles attention timing; no profile covers attention kernels, so these are assumptions.

    - Prefill attention (FlashAttention-style, causal): 4 x heads x head_dim FLOPs per (query, key) pair
      (QK^T and PV, a multiply-add each), at `prefill_flops_frac` of the GPU's peak; FlashAttention-2
      reaches 35-50% of H100 peak in the forward pass and FlashAttention-3 up to 75%: 0.5 is between.
    - Decode attention (paged): memory-bound, reading every cached K and V byte of every sequence
      once, at `decode_bw_frac` of peak HBM bandwidth (paged-attention kernels with many sequences
      reach 70-85%).
    - Writing new K/V into the cache: one write of the new tokens' K and V at the same bandwidth.
    - `kernel_s`: launch overhead of the attention kernels of one layer.
    """

    prefill_flops_frac: float = 0.5
    decode_bw_frac: float = 0.75
    kernel_s: float = 8e-6


@dataclass(frozen=True, slots=True)
class Batch:
    """Aggregate of one iteration's work; build it with `Batch.of` or accumulate the sums directly.

    The performance model depends on a batch only through these sums, which lets a simulator keep
    them incrementally instead of rebuilding lists.
    """

    num_tokens: int = 0
    """Tokens computed this iteration: prefill chunk tokens plus one per decode sequence."""
    prefill_pairs: float = 0.0
    """Causal (query, key) pairs of the prefill chunks: sum of chunk * (cached + (chunk + 1) / 2)."""
    prefill_cached_tokens: int = 0
    """Cached tokens the prefill chunks attend to (read from the KV cache)."""
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    """Sum of the decode sequences' context lengths (tokens read from the KV cache)."""
    num_logit_rows: int = 0
    """Rows the LM head computes: decode sequences plus prefills that finish this iteration."""
    num_prefill_seqs: int = 0
    """Prompts with a chunk in this iteration (0 from callers that do not count them: one when any prompt
    token is computed)."""

    @classmethod
    def of(cls, prefill_chunks: list[tuple[int, int]] | tuple = (), decode_contexts: list[int] | tuple = (),
           finishing_prefills: int | None = None) -> Batch:
        """Batch from (chunk_tokens, cached_tokens) prefill chunks and decode context lengths.

        `finishing_prefills` defaults to every chunk (each chunk ends its prompt).
        """
        pairs = sum(c * (p + (c + 1) / 2) for c, p in prefill_chunks)
        n_pf = len(prefill_chunks) if finishing_prefills is None else finishing_prefills
        return cls(num_tokens=sum(c for c, _ in prefill_chunks) + len(decode_contexts), prefill_pairs=pairs,
                   prefill_cached_tokens=sum(p for _, p in prefill_chunks), num_decode_seqs=len(decode_contexts),
                   decode_context_tokens=sum(decode_contexts), num_logit_rows=n_pf + len(decode_contexts),
                   num_prefill_seqs=len(prefill_chunks))

    def __add__(self, other: Batch) -> Batch:
        return Batch(self.num_tokens + other.num_tokens, self.prefill_pairs + other.prefill_pairs,
                     self.prefill_cached_tokens + other.prefill_cached_tokens,
                     self.num_decode_seqs + other.num_decode_seqs,
                     self.decode_context_tokens + other.decode_context_tokens,
                     self.num_logit_rows + other.num_logit_rows, self.num_prefill_seqs + other.num_prefill_seqs)


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Iteration times of `model` on `gpu`; `timer(shape)` gives a fast per-shape evaluator."""

    model: ModelSpec
    gpu: GPUSpec
    gpus_per_node: int = GPUS_PER_NODE
    """Decides whether pipeline stages talk over NVLink or the network."""
    iteration_overhead_s: float = 1.5e-3
    """Engine time per iteration outside the GPU kernels (scheduling, sampling, launch), an assumption."""
    sequence_overhead_s: float = 0.0
    """Engine time per sequence that gets a token in an iteration, outside the GPU kernels (sampling over the
    vocabulary, handing its output over), counted with the LM head. 0 in the H100 model (where it is inside
    `iteration_overhead_s`); fitted for a CPU engine by `oserve.fidelity` (55-130 µs a sequence there: a third or
    more of a 64-sequence decode step)."""
    prefill_overhead_s: float = 0.0
    """Engine time per prompt that has a chunk in an iteration, beside `iteration_overhead_s`: the prefill path's
    own cost per prompt (on the CPU engine, attention runs prompt by prompt; on CUDA, a step with prompts runs
    outside the decode CUDA graphs). 0 in the H100 model (its profiles time operators, not iterations); fitted
    for a CPU engine by `oserve.fidelity`."""
    attention: AttentionModel = field(default_factory=AttentionModel)
    coefficients: dict | None = field(default=None, hash=False, compare=False)
    """Fitted coefficients; None uses the shipped ones."""

    def timer(self, shape: ReplicaShape) -> ShapeTimer:
        """The evaluator for `shape`; cached for the shipped coefficients (they take no part in equality,
        so a model with its own coefficients gets a fresh timer every time)."""
        if self.coefficients is not None:
            return ShapeTimer(self, shape)
        return _timer(self, shape)

    def iteration_seconds(self, shape: ReplicaShape, batch: Batch) -> float:
        """Latency of one batch through every stage of a replica of `shape`."""
        return self.timer(shape).iteration_seconds(batch)


@lru_cache(maxsize=4096)
def _timer(perf: PerfModel, shape: ReplicaShape) -> ShapeTimer:
    return ShapeTimer(perf, shape)


class ShapeTimer:
    """Per-shape evaluator with every constant folded; all methods are pure."""

    def __init__(self, perf: PerfModel, shape: ReplicaShape) -> None:
        coeffs = perf.coefficients or shipped_coefficients()
        m, gpu, tp = perf.model, perf.gpu, shape.tp
        self.shape = shape
        self.model = m
        self.layers = stage_layers(m.num_layers, shape.pp)
        self._bytes = m.bytes_per_param
        self._gemm = coeffs["gemm"]
        self._peak, self._hbm = gpu.peak_flops, gpu.hbm_bytes_per_s
        # Element-wise costs were measured on the calibration GPU; they scale with HBM bandwidth.
        bw_scale = coeffs["gpu"]["hbm_bytes_per_s"] / gpu.hbm_bytes_per_s
        dims = gemm_dims(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, tp, m.gated_mlp)
        self._gemm_kn = tuple(dims[op] for op in GEMM_OPS)
        widths = elementwise_widths(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, tp,
                                        m.gated_mlp)
        ew = coeffs["elementwise"]
        self._elem_a = sum(ew[op]["a_s"] for op in ELEMENTWISE_OPS)
        self._elem_b = sum(ew[op]["b_s_per_elem"] * float(widths[op]) for op in ELEMENTWISE_OPS) * bw_scale
        # Embedding lookup and final norm: element-wise over hidden, like a residual add.
        self._embed_b = ew["add"]["b_s_per_elem"] * m.hidden_size * bw_scale
        self._lm_head_kn = (m.hidden_size, -(-m.vocab_size // tp))
        att = perf.attention
        heads_gpu = m.num_heads // tp
        kv_bytes_per_token_layer = 2 * kv_heads_per_gpu(m, tp) * m.head_dim * m.bytes_per_param
        self._attn_kernel_s = att.kernel_s
        self._pair_s = 4.0 * heads_gpu * m.head_dim / (att.prefill_flops_frac * gpu.peak_flops)
        self._kv_read_s = kv_bytes_per_token_layer / (att.decode_bw_frac * gpu.hbm_bytes_per_s)
        self._act_bytes_per_token = m.hidden_size * m.bytes_per_param
        collectives = coeffs["collectives"]
        self._all_reduce = _all_reduce_curve(collectives, tp) if tp > 1 else None
        spans_nodes = shape.num_gpus > perf.gpus_per_node
        self._send_recv = collectives["send_recv_inter" if spans_nodes else "send_recv_intra"]
        self.iteration_overhead_s = perf.iteration_overhead_s
        self._prefill_s = getattr(perf, "prefill_overhead_s", 0.0)
        self._row_s = perf.sequence_overhead_s
        self._linear_cache: dict[int, float] = {}
        self._token_cache: dict[int, tuple[float, float]] = {}
        self._lm_cache: dict[int, float] = {}
        self._num_layers = sum(self.layers)

    # --- pieces ---------------------------------------------------------------------------------

    def linear_seconds(self, num_tokens: int) -> float:
        """One layer's GEMMs and element-wise operators for `num_tokens` tokens (cached by count)."""
        hit = self._linear_cache.get(num_tokens)
        if hit is not None:
            return hit
        t = self._elem_a + self._elem_b * num_tokens
        for k, n in self._gemm_kn:
            t += float(gemm_seconds(self._gemm, num_tokens, k, n, self._peak, self._hbm))
        if len(self._linear_cache) < 65536:
            self._linear_cache[num_tokens] = t
        return t

    def attention_seconds(self, batch: Batch) -> float:
        """One layer's attention for the batch (assumptions in AttentionModel)."""
        if batch.num_tokens == 0:
            return 0.0
        kv_tokens = batch.decode_context_tokens + batch.prefill_cached_tokens + batch.num_tokens  # read + write
        return self._attn_kernel_s + batch.prefill_pairs * self._pair_s + kv_tokens * self._kv_read_s

    def all_reduce_seconds(self, num_tokens: int) -> float:
        if self._all_reduce is None or num_tokens == 0:
            return 0.0
        return float(collective_seconds(self._all_reduce, num_tokens * self._act_bytes_per_token))

    def send_recv_seconds(self, num_tokens: int) -> float:
        if self.shape.pp == 1 or num_tokens == 0:
            return 0.0
        return float(collective_seconds(self._send_recv, num_tokens * self._act_bytes_per_token))

    def lm_head_seconds(self, rows: int) -> float:
        if rows == 0:
            return 0.0
        k, n = self._lm_head_kn
        return float(gemm_seconds(self._gemm, rows, k, n, self._peak, self._hbm)) + self._row_s * rows

    # --- whole iterations ----------------------------------------------------------------------

    def _token_costs(self, m: int) -> tuple[float, float]:
        """(per-layer linear + 2 all-reduces, stage-boundary send/recv) for m tokens; cached by m."""
        hit = self._token_cache.get(m)
        if hit is None:
            hit = (self.linear_seconds(m) + 2.0 * self.all_reduce_seconds(m), self.send_recv_seconds(m))
            if len(self._token_cache) < 65536:
                self._token_cache[m] = hit
        return hit

    def _lm_head(self, rows: int) -> float:
        hit = self._lm_cache.get(rows)
        if hit is None:
            hit = self.lm_head_seconds(rows)
            if len(self._lm_cache) < 65536:
                self._lm_cache[rows] = hit
        return hit

    def stage_seconds(self, batch: Batch) -> tuple[float, ...]:
        """GPU time of each pipeline stage for the batch."""
        if batch.num_tokens == 0:
            return tuple(0.0 for _ in self.layers)
        m = batch.num_tokens
        per_layer = self._token_costs(m)[0] + self.attention_seconds(batch)
        out = [n * per_layer for n in self.layers]
        out[0] += self._embed_b * m
        out[-1] += self._lm_head(batch.num_logit_rows) + self._embed_b * m
        return tuple(out)

    def iteration_seconds(self, batch: Batch) -> float:
        """Latency of the batch through all stages, with stage-boundary transfers and engine overhead."""
        m = batch.num_tokens
        if m == 0:
            return 0.0
        per_layer, send_recv = self._token_costs(m)
        per_layer += self.attention_seconds(batch)
        return (self._num_layers * per_layer + 2.0 * self._embed_b * m + self._lm_head(batch.num_logit_rows)
                + (self.shape.pp - 1) * send_recv + self.iteration_overhead_s + self._step_overhead(batch))

    def _step_overhead(self, batch: Batch) -> float:
        """The prefill path's cost: per prompt with a chunk in the batch (one when the batch does not count them)."""
        if not self._prefill_s or batch.num_tokens <= batch.num_decode_seqs:
            return 0.0
        return self._prefill_s * max(batch.num_prefill_seqs, 1)

    def pipelined_step_seconds(self, micro: Batch) -> float:
        """With `pp` micro-batches like `micro` in flight, the time between two steps of one sequence:
        max(latency of `micro` through every stage, pp x the bottleneck stage's busy time). The same
        arithmetic as `max(iteration_seconds(micro), pp * bottleneck_seconds(micro))`, the shared terms
        computed once (the simulated engine's hot path for PP replicas)."""
        m = micro.num_tokens
        if m == 0:
            return 0.0
        pp = self.shape.pp
        token, send_recv = self._token_costs(m)
        attn = self.attention_seconds(micro)
        lm_head = self._lm_head(micro.num_logit_rows)
        embed = self._embed_b * m
        step = self.iteration_overhead_s + self._step_overhead(micro)
        latency = self._num_layers * (token + attn) + 2.0 * embed + lm_head + (pp - 1) * send_recv + step
        per_layer = token + attn  # as stage_seconds computes it
        layers = self.layers
        first, last = layers[0] * per_layer + embed, layers[-1] * per_layer + lm_head + embed
        stage = max(first, last) if len(layers) > 1 else layers[0] * per_layer + embed + lm_head + embed
        for n in layers[1:-1]:
            stage = max(stage, n * per_layer)
        bottleneck = stage + send_recv + step / pp
        return max(latency, pp * bottleneck)

    def bottleneck_seconds(self, batch: Batch) -> float:
        """Time the slowest stage is busy with the batch (with its share of overhead and transfer).

        With PP micro-batches in flight, a replica completes one micro-batch per bottleneck time.
        """
        if batch.num_tokens == 0:
            return 0.0
        return max(self.stage_seconds(batch)) + self._token_costs(batch.num_tokens)[1] + \
            (self.iteration_overhead_s + self._step_overhead(batch)) / self.shape.pp

    def bottleneck_seconds_many(self, num_tokens: np.ndarray, prefill_pairs: np.ndarray,
                                kv_tokens: np.ndarray, logit_rows: np.ndarray) -> np.ndarray:
        """`bottleneck_seconds` for many batches at once, given as arrays of their sums. Pure.

        `kv_tokens` is the KV traffic of a batch: decode contexts plus cached prefill tokens plus the
        batch's own tokens (written); a batch with prefill pairs has one prompt (`PerfModel.prefill_overhead_s`
        counted once). Matches the scalar path to rounding.
        """
        m = np.asarray(num_tokens, dtype=float)
        linear = self._elem_a + self._elem_b * m
        for k, n in self._gemm_kn:
            linear = linear + gemm_seconds(self._gemm, m, k, n, self._peak, self._hbm)
        attn = self._attn_kernel_s + np.asarray(prefill_pairs) * self._pair_s + np.asarray(kv_tokens) * self._kv_read_s
        per_layer = linear + attn
        if self._all_reduce is not None:
            per_layer = per_layer + 2.0 * collective_seconds(self._all_reduce, m * self._act_bytes_per_token)
        rows = np.asarray(logit_rows, dtype=float)
        k, n = self._lm_head_kn
        lm_head = np.where(rows > 0, gemm_seconds(self._gemm, np.maximum(rows, 1), k, n, self._peak, self._hbm)
                           + self._row_s * rows, 0.0)
        stages = [n_layers * per_layer for n_layers in self.layers]
        stages[0] = stages[0] + self._embed_b * m
        stages[-1] = stages[-1] + lm_head + self._embed_b * m
        out = np.max(np.stack(stages), axis=0)
        if self.shape.pp > 1:
            out = out + collective_seconds(self._send_recv, m * self._act_bytes_per_token)
        step = self.iteration_overhead_s + np.where(np.asarray(prefill_pairs) > 0, self._prefill_s, 0.0)
        return np.where(m > 0, out + step / self.shape.pp, 0.0)


def _all_reduce_curve(collectives: dict, tp: int) -> dict[str, list[float]]:
    """The all-reduce curve for a group of `tp` GPUs; unmeasured sizes interpolate in log time.

    Measured groups are 2, 4 and 8; a group of 3 lies between 2 and 4, of 5-7 between 4 and 8
    (weights by log of the group size), which keeps time monotone in the group size.
    """
    measured = sorted(int(k.rsplit("_", 1)[1]) for k in collectives if k.startswith("all_reduce_"))
    if tp in measured:
        return collectives[f"all_reduce_{tp}"]
    lo = max([n for n in measured if n < tp], default=measured[0])
    hi = min([n for n in measured if n > tp], default=measured[-1])
    a, b = collectives[f"all_reduce_{lo}"], collectives[f"all_reduce_{hi}"]
    w = 0.0 if hi == lo else (math.log(tp) - math.log(lo)) / (math.log(hi) - math.log(lo))
    sizes = sorted(set(a["size_bytes"]) | set(b["size_bytes"]))
    ta = np.log(collective_seconds(a, sizes))
    tb = np.log(collective_seconds(b, sizes))
    return {"size_bytes": list(map(float, sizes)), "seconds": np.exp((1 - w) * ta + w * tb).tolist()}


class ScaledTimer:
    """A `ShapeTimer` whose times are `time_scale` times longer, its attention `attention_scale` times
    longer on top (prefill pairs and KV reads: long contexts suffer most). Pure.

    What an engine that differs from the performance model looks like (the robustness harness's injected
    errors, `oserve.evaluation.robustness`) and what a corrected model believes (`oserve.capacity.
    CorrectedTable`, the twin's scaled engine): the same cost curves, stretched."""

    __slots__ = ("base", "time_scale", "attention_scale", "shape", "layers", "model")

    def __init__(self, base: ShapeTimer, time_scale: float = 1.0, attention_scale: float = 1.0) -> None:
        if not time_scale > 0 or not attention_scale > 0:
            raise ConfigError(f"ScaledTimer: scales must be positive, got {time_scale}, {attention_scale}")
        if attention_scale != 1.0:
            fresh = ShapeTimer.__new__(ShapeTimer)
            fresh.__dict__.update(base.__dict__)
            fresh._linear_cache, fresh._token_cache, fresh._lm_cache = {}, {}, {}
            fresh._pair_s = base._pair_s * attention_scale
            fresh._kv_read_s = base._kv_read_s * attention_scale
            fresh._attn_kernel_s = base._attn_kernel_s * attention_scale
            base = fresh
        self.base, self.time_scale, self.attention_scale = base, float(time_scale), float(attention_scale)
        self.shape, self.layers, self.model = base.shape, base.layers, base.model

    def linear_seconds(self, num_tokens: int) -> float:
        return self.time_scale * self.base.linear_seconds(num_tokens)

    def attention_seconds(self, batch: Batch) -> float:
        return self.time_scale * self.base.attention_seconds(batch)

    def stage_seconds(self, batch: Batch) -> tuple[float, ...]:
        return tuple(self.time_scale * t for t in self.base.stage_seconds(batch))

    def iteration_seconds(self, batch: Batch) -> float:
        return self.time_scale * self.base.iteration_seconds(batch)

    def pipelined_step_seconds(self, micro: Batch) -> float:
        return self.time_scale * self.base.pipelined_step_seconds(micro)

    def bottleneck_seconds(self, batch: Batch) -> float:
        return self.time_scale * self.base.bottleneck_seconds(batch)

    def bottleneck_seconds_many(self, num_tokens: np.ndarray, prefill_pairs: np.ndarray,
                                kv_tokens: np.ndarray, logit_rows: np.ndarray) -> np.ndarray:
        return self.time_scale * self.base.bottleneck_seconds_many(num_tokens, prefill_pairs, kv_tokens, logit_rows)


class ScaledPerf:
    """A `PerfModel` whose replicas of some shapes run slower or faster: `scales[shape]` is (time scale,
    attention scale); shapes not named run as `default` (1, 1 unless given). Duck-types `PerfModel`
    for the simulator, the capacity table and the twin. Pure."""

    def __init__(self, base: PerfModel, scales: dict[ReplicaShape, tuple[float, float]] | None = None,
                 default: tuple[float, float] = (1.0, 1.0)) -> None:
        self.base = base
        self.scales = dict(scales or {})
        self.default = default
        self._timers: dict[ReplicaShape, ShapeTimer | ScaledTimer] = {}

    model = property(lambda self: self.base.model)
    gpu = property(lambda self: self.base.gpu)
    gpus_per_node = property(lambda self: self.base.gpus_per_node)
    iteration_overhead_s = property(lambda self: self.base.iteration_overhead_s)
    sequence_overhead_s = property(lambda self: getattr(self.base, "sequence_overhead_s", 0.0))
    prefill_overhead_s = property(lambda self: getattr(self.base, "prefill_overhead_s", 0.0))

    def scale_of(self, shape: ReplicaShape) -> tuple[float, float]:
        return self.scales.get(shape, self.default)

    def timer(self, shape: ReplicaShape) -> ShapeTimer | ScaledTimer:
        hit = self._timers.get(shape)
        if hit is None:
            time_scale, attention_scale = self.scale_of(shape)
            base = self.base.timer(shape)
            hit = base if time_scale == 1.0 and attention_scale == 1.0 else ScaledTimer(base, time_scale,
                                                                                         attention_scale)
            self._timers[shape] = hit
        return hit

    def iteration_seconds(self, shape: ReplicaShape, batch: Batch) -> float:
        return self.timer(shape).iteration_seconds(batch)
