"""Where every byte of the model and of the KV cache lives, per GPU, as engines shard them. Pure.

Every tensor is a 2-D row-major array (`TensorSpec`: rows x cols of `bytes_per_elem` bytes) with one
*split axis*: the axis tensor parallelism cuts. A *line* is one row (split axis 0) or one column (split
axis 1); what a GPU holds of a tensor is an `IntervalSet` of line indices, and the bytes it holds are
those lines (`Shard.byte_ranges` expands them to flat byte intervals over the full tensor). Since every
deployment cuts a given tensor along the same axis, "what a target GPU needs and does not hold" is a
1-D interval difference.

Weights follow vLLM's tensor-parallel layers and its names for Llama-style modules (`PyTorch` weight
shape `[out_features, in_features]`):

- `self_attn.qkv_proj` (QKVParallelLinear, column-parallel, rows split): the fused tensor is
  `[q (num_heads*head_dim); k (num_kv_heads*head_dim); v (same)]` and rank r holds its query heads plus
  its KV heads' rows of k and of v (three intervals). When TP exceeds the KV heads, each KV head is
  replicated on TP / num_kv_heads consecutive ranks (`shard = rank // replicas`, as vLLM loads it).
- `mlp.gate_up_proj` (MergedColumnParallelLinear): fused `[gate; up]`, rank r holds its slice of each;
  without a gated MLP the single `mlp.up_proj` (OPT's fc1) is split the same way.
- `self_attn.o_proj`, `mlp.down_proj` (RowParallelLinear): columns split. Their biases are replicated.
- `embed_tokens` and `lm_head` (VocabParallelEmbedding / ParallelLMHead): rows split over the
  vocabulary padded to a multiple of 64, each rank `ceil(padded / tp)` rows, the padding rows not
  stored (they hold no checkpoint bytes). A tied LM head reuses the embedding; with PP > 1 the last
  stage holds its own copy of its vocabulary slice (vLLM loads the embedding weight into it).
- Norms and learned position embeddings: replicated (`split_axis` 0 over their only line axis).
- Layers: split across pipeline stages by `specs.stage_layers`; the first stage holds the embeddings,
  the last the final norm and LM head.

The KV cache of a running request is one tensor per layer, `kv.<request_id>.<layer>`, laid out as
`[2 (K, V), num_kv_heads, tokens, head_dim]` = rows `(kind, head, token)` x cols `head_dim`, split axis 0:
a GPU's KV heads are two row intervals (its K heads and its V heads, every token), and any token range
of any head slice is again a row interval, so KV pieces plug into the same planner as weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from oserve.errors import ConfigError
from oserve.specs import Deployment, ModelSpec, Replica, ReplicaShape, sharding_problems, stage_layers
from oserve.switch.intervals import EMPTY, IntervalSet, length, normalize

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE: the vocabulary is padded to a multiple of this before it is split."""

# gpu_id -> tensor name -> lines held
Holdings = Mapping[str, IntervalSet]
Layout = Mapping[int, Holdings]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One full (unsharded) tensor: a row-major rows x cols array cut along `split_axis`."""

    name: str
    rows: int
    cols: int
    split_axis: int
    """0: rows are split (column-parallel weights, vocabulary, KV heads, replicated vectors); 1: columns."""
    bytes_per_elem: int
    layer: int | None = None
    """Transformer block the tensor belongs to; None for embeddings, final norm, LM head."""

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1 or self.bytes_per_elem < 1 or self.split_axis not in (0, 1):
            raise ConfigError(f"TensorSpec {self.name!r}: bad shape {self.rows}x{self.cols}, "
                              f"axis {self.split_axis}, {self.bytes_per_elem} B/elem")

    @property
    def num_lines(self) -> int:
        """Lines along the split axis."""
        return self.rows if self.split_axis == 0 else self.cols

    @property
    def line_bytes(self) -> int:
        """Bytes of one line (one row for split axis 0, one column for split axis 1)."""
        return (self.cols if self.split_axis == 0 else self.rows) * self.bytes_per_elem

    @property
    def num_bytes(self) -> int:
        return self.rows * self.cols * self.bytes_per_elem

    @property
    def all_lines(self) -> IntervalSet:
        return ((0, self.num_lines),)


@dataclass(frozen=True, slots=True)
class Shard:
    """The lines of one tensor that one GPU holds (or one piece that moves)."""

    tensor: TensorSpec
    lines: IntervalSet

    @property
    def num_bytes(self) -> int:
        return length(self.lines) * self.tensor.line_bytes

    def byte_ranges(self) -> IntervalSet:
        """The flat byte intervals this shard covers in the full row-major tensor. Pure.

        Rows (split axis 0) are contiguous; a column range (split axis 1) is one interval per row.
        """
        t = self.tensor
        b = t.bytes_per_elem
        if t.split_axis == 0:
            return normalize((lo * t.cols * b, hi * t.cols * b) for lo, hi in self.lines)
        return normalize(((r * t.cols + lo) * b, (r * t.cols + hi) * b) for r in range(t.rows) for lo, hi in self.lines)


# --- weights -----------------------------------------------------------------------------------

def _prefix(layer: int) -> str:
    return f"model.layers.{layer}."


@lru_cache(maxsize=64)
def model_tensors(model: ModelSpec) -> Mapping[str, TensorSpec]:
    """Every weight tensor of the model, by name, in model order (embeddings, blocks, final norm, head). Pure.

    Their bytes add up to `model.weight_bytes` exactly.
    """
    h, nh, nkv, hd = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    f, v, b = model.intermediate_size, model.vocab_size, model.bytes_per_param
    out: dict[str, TensorSpec] = {}

    def add(name: str, rows: int, cols: int, axis: int, layer: int | None = None) -> None:
        out[name] = TensorSpec(name, rows, cols, axis, b, layer)

    add("model.embed_tokens.weight", v, h, 0)
    if model.learned_positions:
        add("model.embed_positions.weight", model.learned_positions, h, 0)
    qkv_rows = (nh + 2 * nkv) * hd
    up_rows = (2 if model.gated_mlp else 1) * f
    up_name = "mlp.gate_up_proj" if model.gated_mlp else "mlp.up_proj"
    for i in range(model.num_layers):
        p = _prefix(i)
        add(p + "input_layernorm.weight", h, 1, 0, i)
        if model.has_bias:
            add(p + "input_layernorm.bias", h, 1, 0, i)
        add(p + "self_attn.qkv_proj.weight", qkv_rows, h, 0, i)
        if model.has_bias:
            add(p + "self_attn.qkv_proj.bias", qkv_rows, 1, 0, i)
        add(p + "self_attn.o_proj.weight", h, nh * hd, 1, i)
        if model.has_bias:
            add(p + "self_attn.o_proj.bias", h, 1, 0, i)
        add(p + "post_attention_layernorm.weight", h, 1, 0, i)
        if model.has_bias:
            add(p + "post_attention_layernorm.bias", h, 1, 0, i)
        add(p + up_name + ".weight", up_rows, h, 0, i)
        if model.has_bias:
            add(p + up_name + ".bias", up_rows, 1, 0, i)
        add(p + "mlp.down_proj.weight", h, f, 1, i)
        if model.has_bias:
            add(p + "mlp.down_proj.bias", h, 1, 0, i)
    add("model.norm.weight", h, 1, 0)
    if model.has_bias:
        add("model.norm.bias", h, 1, 0)
    if not model.tied_embeddings:
        add("lm_head.weight", v, h, 0)
    return MappingProxyType(out)


def vocab_range(vocab_size: int, tp: int, rank: int, padding: int = VOCAB_PADDING) -> tuple[int, int]:
    """Rows [lo, hi) of the vocabulary rank `rank` of `tp` stores (padding rows excluded). Pure."""
    padded = -(-vocab_size // padding) * padding
    per = -(-padded // tp)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def kv_head_range(model: ModelSpec, tp: int, rank: int) -> tuple[int, int]:
    """KV heads [lo, hi) rank `rank` of a TP group of `tp` holds (one replicated head when TP > KV heads)."""
    nkv = model.num_kv_heads
    if tp <= nkv:
        per = nkv // tp
        return rank * per, (rank + 1) * per
    replicas = tp // nkv
    return rank // replicas, rank // replicas + 1


def _check_shape(model: ModelSpec, shape: ReplicaShape) -> None:
    # Node size does not matter for sharding; pass one large enough to skip that check.
    problems = sharding_problems(model, shape, max(shape.tp, 1))
    if problems:
        raise ConfigError(f"{shape} cannot shard {model.name}: {'; '.join(problems)}")


@lru_cache(maxsize=4096)
def gpu_weight_shards(model: ModelSpec, shape: ReplicaShape, stage: int, rank: int) -> Holdings:
    """Lines of every weight tensor held by TP rank `rank` of stage `stage` of a `shape` replica. Pure.

    The returned mapping is read-only and shared by every GPU in the same role (callers rely on its
    identity to memoise).
    """
    _check_shape(model, shape)
    tp, pp = shape.tp, shape.pp
    if not (0 <= stage < pp and 0 <= rank < tp):
        raise ConfigError(f"stage {stage} / rank {rank} outside {shape}")
    tensors = model_tensors(model)
    h, nh, nkv, hd, f = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size
    layers = stage_layers(model.num_layers, pp)
    first = sum(layers[:stage])
    q_per = nh // tp
    kv_lo, kv_hi = kv_head_range(model, tp, rank)
    qkv = normalize([(rank * q_per * hd, (rank + 1) * q_per * hd),
                     (nh * hd + kv_lo * hd, nh * hd + kv_hi * hd),
                     ((nh + nkv) * hd + kv_lo * hd, (nh + nkv) * hd + kv_hi * hd)])
    f_per = f // tp
    up = normalize([(rank * f_per, (rank + 1) * f_per)] +
                   ([(f + rank * f_per, f + (rank + 1) * f_per)] if model.gated_mlp else []))
    out_cols = ((rank * (nh * hd // tp), (rank + 1) * (nh * hd // tp)),)
    down_cols = ((rank * f_per, (rank + 1) * f_per),)
    v_lo, v_hi = vocab_range(model.vocab_size, tp, rank)
    vocab = normalize([(v_lo, v_hi)])
    out: dict[str, IntervalSet] = {}

    def full(name: str) -> None:
        out[name] = tensors[name].all_lines

    if stage == 0:
        out["model.embed_tokens.weight"] = vocab
        if model.learned_positions:
            full("model.embed_positions.weight")
    up_name = "mlp.gate_up_proj" if model.gated_mlp else "mlp.up_proj"
    for i in range(first, first + layers[stage]):
        p = _prefix(i)
        for name in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight"):
            full(name)
        out[p + "self_attn.qkv_proj.weight"] = qkv
        out[p + "self_attn.o_proj.weight"] = out_cols
        out[p + up_name + ".weight"] = up
        out[p + "mlp.down_proj.weight"] = down_cols
        if model.has_bias:
            for name in (p + "input_layernorm.bias", p + "post_attention_layernorm.bias",
                         p + "self_attn.o_proj.bias", p + "mlp.down_proj.bias"):
                full(name)
            out[p + "self_attn.qkv_proj.bias"] = qkv
            out[p + up_name + ".bias"] = up
    if stage == pp - 1:
        full("model.norm.weight")
        if model.has_bias:
            full("model.norm.bias")
        if model.tied_embeddings:
            out["model.embed_tokens.weight"] = vocab
        else:
            out["lm_head.weight"] = vocab
    # Drop empty shards (a rank past the end of a small vocabulary).
    return MappingProxyType({k: v for k, v in out.items() if v})


def replica_weight_layout(model: ModelSpec, replica: Replica) -> dict[int, Holdings]:
    """gpu_id -> the weight lines it holds, for one placed replica. Pure."""
    tp = replica.shape.tp
    return {g: gpu_weight_shards(model, replica.shape, i // tp, i % tp) for i, g in enumerate(replica.gpu_ids)}


def deployment_weight_layout(model: ModelSpec, deployment: Deployment) -> dict[int, Holdings]:
    """gpu_id -> the weight lines it holds, for every GPU of the deployment. Pure."""
    out: dict[int, Holdings] = {}
    for r in deployment.replicas:
        out.update(replica_weight_layout(model, r))
    return out


def gpu_role(replica: Replica, gpu_id: int) -> tuple[int, int]:
    """(stage, TP rank) of `gpu_id` inside `replica`."""
    i = replica.gpu_ids.index(gpu_id)
    return i // replica.shape.tp, i % replica.shape.tp


# --- KV cache ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request in flight on a replica, with the KV cache it has built so far."""

    request_id: str
    replica_id: str
    context_tokens: int
    """Prompt plus generated tokens whose K and V are cached."""

    def __post_init__(self) -> None:
        if self.context_tokens < 1:
            raise ConfigError(f"request {self.request_id}: context_tokens must be >= 1, got {self.context_tokens}")
        if "." in self.request_id:
            raise ConfigError(f"request id {self.request_id!r} must not contain '.' (it names KV tensors)")


def kv_tensor_name(request_id: str, layer: int) -> str:
    return f"kv.{request_id}.{layer}"


def kv_tensor(model: ModelSpec, request_id: str, layer: int, tokens: int) -> TensorSpec:
    """The KV tensor of one request and layer: rows (kind, head, token), cols head_dim."""
    return TensorSpec(kv_tensor_name(request_id, layer), 2 * model.num_kv_heads * tokens, model.head_dim, 0,
                      model.bytes_per_param, layer)


def kv_lines(model: ModelSpec, tp: int, rank: int, tokens: int, token_range: tuple[int, int] | None = None) -> IntervalSet:
    """Rows of a request's per-layer KV tensor a TP rank holds: its heads of K and of V, over `token_range`."""
    lo_h, hi_h = kv_head_range(model, tp, rank)
    t_lo, t_hi = token_range if token_range is not None else (0, tokens)
    nkv = model.num_kv_heads
    return normalize((base + h * tokens + t_lo, base + h * tokens + t_hi)
                     for base in (0, nkv * tokens) for h in range(lo_h, hi_h))


def replica_kv_layout(model: ModelSpec, replica: Replica, requests: Iterable[RunningRequest],
                      ) -> tuple[dict[str, TensorSpec], dict[int, dict[str, IntervalSet]]]:
    """KV tensors of `requests` placed on `replica`, and gpu_id -> the KV lines each GPU holds. Pure."""
    tp = replica.shape.tp
    layers = stage_layers(model.num_layers, replica.shape.pp)
    tensors: dict[str, TensorSpec] = {}
    out: dict[int, dict[str, IntervalSet]] = {g: {} for g in replica.gpu_ids}
    for req in requests:
        first = 0
        for stage, n in enumerate(layers):
            for layer in range(first, first + n):
                t = kv_tensor(model, req.request_id, layer, req.context_tokens)
                tensors[t.name] = t
                for rank in range(tp):
                    out[replica.gpu_ids[stage * tp + rank]][t.name] = kv_lines(model, tp, rank, req.context_tokens)
            first += n
    return tensors, out


def holdings_bytes(holdings: Holdings, tensors: Mapping[str, TensorSpec]) -> int:
    """Bytes of a GPU's holdings."""
    return sum(length(lines) * tensors[name].line_bytes for name, lines in holdings.items())


def empty_holdings() -> Holdings:
    return MappingProxyType({})


__all__ = [
    "EMPTY", "Holdings", "Layout", "RunningRequest", "Shard", "TensorSpec", "VOCAB_PADDING",
    "deployment_weight_layout", "empty_holdings", "gpu_role", "gpu_weight_shards", "holdings_bytes",
    "kv_head_range", "kv_lines", "kv_tensor", "kv_tensor_name", "model_tensors", "replica_kv_layout",
    "replica_weight_layout", "vocab_range",
]
