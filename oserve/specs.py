"""Specs of models, GPUs, clusters and replica shapes, with the sharding and memory rules engines apply.

Pure: frozen dataclasses and arithmetic, no I/O. The sharding rules follow vLLM's tensor-parallel
layers (column-parallel QKV and MLP up/gate, row-parallel output projections, vocabulary-parallel
embedding and LM head) and its pipeline-parallel layer partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from oserve.defaults import GPUS_PER_NODE
from oserve.errors import ConfigError, UnknownNameError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, enough to size and time it."""

    name: str
    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Model width d_model."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (< num_heads for grouped-query attention)."""
    intermediate_size: int
    """MLP inner width."""
    vocab_size: int
    """Vocabulary size (embedding and LM-head rows)."""
    gated_mlp: bool
    """Gate and up projections (SwiGLU) instead of one up projection."""
    max_context_tokens: int
    """Longest sequence (prompt plus output) the model supports."""
    bytes_per_param: int = 2
    """2 for fp16/bf16 weights."""
    tied_embeddings: bool = False
    """LM head shares the embedding matrix (OPT)."""
    has_bias: bool = False
    """Linear layers carry biases (OPT)."""
    learned_positions: int = 0
    """Rows of a learned position embedding (OPT: max positions + 2); 0 for rotary models."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_context_tokens", "bytes_per_param"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelSpec {self.name!r}: {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"ModelSpec {self.name!r}: hidden_size {self.hidden_size} is not a multiple "
                              f"of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelSpec {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection output."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms)."""
        h, kv, ffn = self.hidden_size, self.kv_dim, self.intermediate_size
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.gated_mlp else 2) * h * ffn
        norms = 2 * h * (2 if self.has_bias else 1)  # LayerNorm has a bias, RMSNorm not
        bias = (h + 2 * kv + h + (2 if self.gated_mlp else 1) * ffn + h) if self.has_bias else 0
        return attn + mlp + norms + bias

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.learned_positions * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        final_norm = self.hidden_size * (2 if self.has_bias else 1)
        return self.num_layers * self.layer_params + self.embedding_params + self.lm_head_params + final_norm

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers of an unsharded model."""
        return 2 * self.num_layers * self.kv_dim * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator type."""

    name: str
    memory_bytes: int
    """Device memory as the driver reports it."""
    hbm_bytes_per_s: float
    """Peak HBM bandwidth."""
    peak_flops: float
    """Peak dense fp16/bf16 tensor-core FLOP/s (no sparsity)."""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_bytes_per_s", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"GPUSpec {self.name!r}: {name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Homogeneous GPU nodes joined by a network."""

    name: str
    num_nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    nvlink_bytes_per_s: float
    """Per-GPU NVLink bandwidth inside a node, one direction."""
    network_bytes_per_s: float
    """Per-GPU network bandwidth between nodes, one direction."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"ClusterSpec {self.name!r}: num_nodes and gpus_per_node must be >= 1, "
                              f"got {self.num_nodes} x {self.gpus_per_node}")
        if not (self.nvlink_bytes_per_s > 0 and self.network_bytes_per_s > 0):
            raise ConfigError(f"ClusterSpec {self.name!r}: link bandwidths must be positive")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu_id: int) -> int:
        """Node index of a global GPU id (ids are node-major: node * gpus_per_node + local)."""
        if not 0 <= gpu_id < self.num_gpus:
            raise ConfigError(f"GPU id {gpu_id} outside cluster {self.name!r} of {self.num_gpus} GPUs")
        return gpu_id // self.gpus_per_node


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """How a replica's GPU memory is budgeted, as vLLM does it."""

    gpu_memory_utilization: float = 0.90
    """Fraction of device memory the engine may use (vLLM's default)."""
    reserve_bytes: int = 2 * GiB
    """Per-GPU memory for activations, CUDA graphs and communication buffers, outside weights and KV."""
    min_kv_tokens: int | None = None
    """KV room a replica must have to be feasible; None means one sequence of the model's max context."""
    block_tokens: int = 16
    """Tokens per KV block (vLLM's default block size)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"MemoryConfig: gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.reserve_bytes < 0:
            raise ConfigError(f"MemoryConfig: reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.min_kv_tokens is not None and self.min_kv_tokens < 0:
            raise ConfigError(f"MemoryConfig: min_kv_tokens must be >= 0, got {self.min_kv_tokens}")
        if self.block_tokens < 1:
            raise ConfigError(f"MemoryConfig: block_tokens must be >= 1, got {self.block_tokens}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Batching limits of one engine, with vLLM's names and online-serving defaults."""

    max_num_seqs: int = 256
    """Sequences in one batch (per pipeline micro-batch)."""
    max_num_batched_tokens: int = 8192
    """Tokens (prefill plus decode) in one batch; longer prompts are chunked when chunked_prefill."""
    chunked_prefill: bool = True
    """Split long prompts over several iterations and mix them with decodes."""
    admit_whole_prompt: bool = True
    """Start a waiting prompt only when the free KV blocks hold all of it (beyond what the prompts already
    being prefilled still need), as vLLM's V0 block manager did. vLLM's V1 scheduler admits a chunk at a
    time; with long prompts it then preempts and re-admits them in a loop (vllm-project/vllm#21793,
    #21809): on Llama-3.1-70B TP8 with 60k-token prompts, at 0.8 of the capacity table's rate, such
    an engine preempted 870 times for 307 requests and its latency grew without bound. False models it."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"EngineConfig: max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"EngineConfig: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                              f"max_num_seqs ({self.max_num_seqs})")


@dataclass(frozen=True, slots=True, order=True)
class ReplicaShape:
    """Parallelism of one replica."""

    tp: int
    """Tensor-parallel degree; the GPUs of one stage, all in one node."""
    pp: int = 1
    """Pipeline stages."""

    def __post_init__(self) -> None:
        if not (isinstance(self.tp, int) and isinstance(self.pp, int)) or self.tp < 1 or self.pp < 1:
            raise ConfigError(f"ReplicaShape: tp and pp must be integers >= 1, got tp={self.tp!r} pp={self.pp!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as vLLM partitions them. Pure.

    Every stage gets num_layers // pp; the remainder goes one layer each to the stages before the
    last, counting back from the second-to-last (the last stage already carries the LM head).
    """
    if pp < 1 or pp > num_layers:
        raise ConfigError(f"pp={pp} must be between 1 and the layer count {num_layers}")
    parts = [num_layers // pp] * pp
    remainder = num_layers % pp
    for i in range(remainder):
        parts[(pp - 2 - i) % pp] += 1
    return tuple(parts)


def sharding_problems(model: ModelSpec, shape: ReplicaShape, gpus_per_node: int) -> list[str]:
    """Why `shape` cannot shard `model` on nodes of `gpus_per_node` GPUs; empty when it can. Pure."""
    problems: list[str] = []
    tp, pp = shape.tp, shape.pp
    if tp > gpus_per_node:
        problems.append(f"TP={tp} exceeds the {gpus_per_node} GPUs of one node")
    if model.num_heads % tp:
        problems.append(f"TP={tp} does not divide the {model.num_heads} attention heads")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        # vLLM splits KV heads when TP divides them and replicates them when they divide TP.
        problems.append(f"TP={tp} neither divides nor is a multiple of the {model.num_kv_heads} KV heads")
    if model.intermediate_size % tp:
        problems.append(f"TP={tp} does not divide the MLP width {model.intermediate_size}")
    if pp > model.num_layers:
        problems.append(f"PP={pp} exceeds the {model.num_layers} layers")
    return problems


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads each GPU of a TP group stores (replicated when TP exceeds the KV heads)."""
    return max(1, model.num_kv_heads // tp)


def stage_weight_bytes(model: ModelSpec, shape: ReplicaShape) -> tuple[int, ...]:
    """Weight bytes on each GPU of each pipeline stage. Pure.

    Linear layers and the vocabulary-parallel embedding/LM head split by TP; norms and biases of row-
    parallel layers are replicated but are negligible and counted split. The first stage holds the
    embedding, the last the LM head (a tied LM head still needs its own copy when PP > 1).
    """
    layers = stage_layers(model.num_layers, shape.pp)
    out = []
    for s, n in enumerate(layers):
        params = n * model.layer_params
        if s == 0:
            params += model.embedding_params
        if s == shape.pp - 1:
            params += model.lm_head_params + model.hidden_size
            if model.tied_embeddings and shape.pp > 1:
                params += model.vocab_size * model.hidden_size
        out.append(-(-params * model.bytes_per_param // shape.tp))
    return tuple(out)


def stage_kv_bytes_per_token(model: ModelSpec, shape: ReplicaShape) -> tuple[int, ...]:
    """KV bytes one token occupies on each GPU of each stage. Pure."""
    per_layer = 2 * kv_heads_per_gpu(model, shape.tp) * model.head_dim * model.bytes_per_param
    return tuple(n * per_layer for n in stage_layers(model.num_layers, shape.pp))


def kv_capacity_tokens(model: ModelSpec, gpu: GPUSpec, shape: ReplicaShape,
                       memory: MemoryConfig = MemoryConfig()) -> int:
    """Tokens of KV cache a replica holds, whole blocks only; <= 0 when the weights do not fit. Pure.

    vLLM allocates the same number of blocks on every worker, so the stage with the least room per
    token bounds the replica.
    """
    budget = int(gpu.memory_bytes * memory.gpu_memory_utilization) - memory.reserve_bytes
    tokens = min((budget - w) // kv for w, kv in
                 zip(stage_weight_bytes(model, shape), stage_kv_bytes_per_token(model, shape)))
    if tokens <= 0:
        return int(tokens)
    return int(tokens // memory.block_tokens * memory.block_tokens)


def shape_problems(model: ModelSpec, gpu: GPUSpec, shape: ReplicaShape, gpus_per_node: int,
                   memory: MemoryConfig = MemoryConfig()) -> list[str]:
    """Sharding problems plus memory feasibility; empty when the shape can serve the model. Pure."""
    problems = sharding_problems(model, shape, gpus_per_node)
    if problems:
        return problems
    need = model.max_context_tokens if memory.min_kv_tokens is None else memory.min_kv_tokens
    have = kv_capacity_tokens(model, gpu, shape, memory)
    if have < max(need, 1):
        weights = max(stage_weight_bytes(model, shape))
        problems.append(f"{shape} of {model.name} on {gpu.name}: {weights / GiB:.1f} GiB of weights per GPU "
                        f"leave room for {max(have, 0)} KV tokens, fewer than the {need} required")
    return problems


def valid_shapes(model: ModelSpec, gpu: GPUSpec, gpus_per_node: int, max_gpus: int,
                 memory: MemoryConfig = MemoryConfig()) -> tuple[ReplicaShape, ...]:
    """Every shape of at most `max_gpus` GPUs that can serve the model, sorted by (GPUs, TP). Pure."""
    shapes = []
    for tp in range(1, min(gpus_per_node, max_gpus) + 1):
        for pp in range(1, max_gpus // tp + 1):
            if pp > model.num_layers:
                break
            shape = ReplicaShape(tp, pp)
            if not shape_problems(model, gpu, shape, gpus_per_node, memory):
                shapes.append(shape)
    return tuple(sorted(shapes, key=lambda s: (s.num_gpus, s.tp)))


@dataclass(frozen=True, slots=True)
class Replica:
    """A replica placed on physical GPUs; `gpu_ids` are stage-major (stage s is gpu_ids[s*tp:(s+1)*tp])."""

    replica_id: str
    shape: ReplicaShape
    gpu_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.gpu_ids) != self.shape.num_gpus:
            raise ConfigError(f"replica {self.replica_id}: {self.shape} needs {self.shape.num_gpus} GPUs, "
                              f"got {len(self.gpu_ids)}")
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ConfigError(f"replica {self.replica_id}: a GPU appears twice in {self.gpu_ids}")

    def stage_gpus(self, stage: int) -> tuple[int, ...]:
        tp = self.shape.tp
        return self.gpu_ids[stage * tp:(stage + 1) * tp]

    def placement_problems(self, cluster: ClusterSpec) -> list[str]:
        """Why this placement is invalid on `cluster` (GPU outside it, a TP group across nodes)."""
        problems = []
        if any(not 0 <= g < cluster.num_gpus for g in self.gpu_ids):
            return [f"replica {self.replica_id}: GPU ids {self.gpu_ids} outside the {cluster.num_gpus}-GPU cluster"]
        for s in range(self.shape.pp):
            nodes = {cluster.node_of(g) for g in self.stage_gpus(s)}
            if len(nodes) > 1:
                problems.append(f"replica {self.replica_id}: stage {s} spans nodes {sorted(nodes)}")
        return problems


@dataclass(frozen=True, slots=True)
class Deployment:
    """The replicas serving the model; no GPU belongs to two replicas."""

    replicas: tuple[Replica, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        seen: dict[int, str] = {}  # gpu_id -> replica_id
        ids = set()
        for r in self.replicas:
            if r.replica_id in ids:
                raise ConfigError(f"deployment: replica id {r.replica_id!r} appears twice")
            ids.add(r.replica_id)
            for g in r.gpu_ids:
                if g in seen:
                    raise ConfigError(f"deployment: GPU {g} is in replicas {seen[g]!r} and {r.replica_id!r}")
                seen[g] = r.replica_id

    @classmethod
    def empty(cls) -> Deployment:
        return cls(())

    @property
    def num_gpus(self) -> int:
        return sum(r.shape.num_gpus for r in self.replicas)

    def shapes(self) -> tuple[ReplicaShape, ...]:
        return tuple(r.shape for r in self.replicas)


# --- presets -----------------------------------------------------------------------------------
# Architecture numbers from each model's published config.json.

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama2-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                  intermediate_size=28672, vocab_size=32000, gated_mlp=True, max_context_tokens=4096),
        ModelSpec("llama-30b", num_layers=60, hidden_size=6656, num_heads=52, num_kv_heads=52,
                  intermediate_size=17920, vocab_size=32000, gated_mlp=True, max_context_tokens=2048),
        ModelSpec("opt-30b", num_layers=48, hidden_size=7168, num_heads=56, num_kv_heads=56,
                  intermediate_size=28672, vocab_size=50272, gated_mlp=False, max_context_tokens=2048,
                  tied_embeddings=True, has_bias=True, learned_positions=2050),
        ModelSpec("opt-66b", num_layers=64, hidden_size=9216, num_heads=72, num_kv_heads=72,
                  intermediate_size=36864, vocab_size=50272, gated_mlp=False, max_context_tokens=2048,
                  tied_embeddings=True, has_bias=True, learned_positions=2050),
        ModelSpec("llama2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                  intermediate_size=11008, vocab_size=32000, gated_mlp=True, max_context_tokens=4096),
        ModelSpec("codellama-34b", num_layers=48, hidden_size=8192, num_heads=64, num_kv_heads=8,
                  intermediate_size=22016, vocab_size=32016, gated_mlp=True, max_context_tokens=16384),
        # Models served today (their config.json): Llama 3.1 reaches 128k tokens by its llama3 RoPE scaling.
        ModelSpec("llama3.1-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                  intermediate_size=14336, vocab_size=128256, gated_mlp=True, max_context_tokens=131072),
        ModelSpec("llama3.1-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                  intermediate_size=28672, vocab_size=128256, gated_mlp=True, max_context_tokens=131072),
        # Qwen2.5-72B-Instruct as shipped: 32k positions (128k only with YaRN added to its config).
        # Its Q/K/V projections carry biases (8 KiB of parameters per layer): left out, as they cost
        # nothing measurable in time or memory.
        ModelSpec("qwen2.5-72b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                  intermediate_size=29568, vocab_size=152064, gated_mlp=True, max_context_tokens=32768),
    )
}
MODEL_ALIASES = {"llama-2-70b": "llama2-70b", "llama-33b": "llama-30b", "llama2-7b-hf": "llama2-7b",
                 "llama-2-7b": "llama2-7b", "code-llama-34b": "codellama-34b", "llama-3.1-8b": "llama3.1-8b",
                 "llama-3.1-70b": "llama3.1-70b", "qwen2.5-72b-instruct": "qwen2.5-72b"}

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        # H100 SXM5 80GB: 81559 MiB as nvidia-smi reports it, 3.35 TB/s HBM3, 989.4 TFLOP/s dense bf16.
        GPUSpec("h100-80gb", memory_bytes=81559 * MiB, hbm_bytes_per_s=3.35e12, peak_flops=989.4e12),
        # A100 SXM4 80GB: 81920 MiB, 2.039 TB/s HBM2e, 312 TFLOP/s dense bf16.
        GPUSpec("a100-80gb", memory_bytes=81920 * MiB, hbm_bytes_per_s=2.039e12, peak_flops=312e12),
    )
}

CLUSTERS: dict[str, ClusterSpec] = {
    # The paper's testbed: 4 nodes x 8 H100, NVLink 400 GB/s inside a node, InfiniBand 200 GB/s between.
    "paper-4x8-h100": ClusterSpec("paper-4x8-h100", num_nodes=4, gpus_per_node=8, gpu=GPUS["h100-80gb"],
                                  nvlink_bytes_per_s=400e9, network_bytes_per_s=200e9),
}


def _lookup(kind: str, table: dict, name: str, aliases: dict[str, str] | None = None):
    key = name.strip().lower()
    key = (aliases or {}).get(key, key)
    if key not in table:
        raise UnknownNameError(kind, name, sorted(table))
    return table[key]


def model_preset(name: str) -> ModelSpec:
    """The model preset called `name` (case-insensitive); UnknownNameError lists the known ones."""
    return _lookup("model", MODELS, name, MODEL_ALIASES)


HF_LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
"""Hugging Face architectures whose weights `oserve.switch.layout` cuts as vLLM does (no biases, gated MLP)."""
HF_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def hf_model_spec(config: Mapping, name: str = "", dtype: str | None = None) -> ModelSpec:
    """The `ModelSpec` of a Hugging Face `config.json` (a Llama-architecture model), e.g. to plan a live
    switch of the model an engine really serves. `dtype` overrides the config's `torch_dtype`. Pure.

    Raises:
        ConfigError: another architecture, a missing field or a dtype of unknown size.
    """
    arch = list(config.get("architectures") or [])
    if not any(a in HF_LLAMA_ARCHITECTURES for a in arch):
        raise ConfigError(f"hf_model_spec: architectures {arch} are not among {list(HF_LLAMA_ARCHITECTURES)}")
    dt = dtype or str(config.get("torch_dtype", "bfloat16"))
    if dt not in HF_DTYPE_BYTES:
        raise ConfigError(f"hf_model_spec: dtype {dt!r} has no known size (known: {sorted(HF_DTYPE_BYTES)})")
    try:
        heads = int(config["num_attention_heads"])
        return ModelSpec(name or str(config.get("_name_or_path") or arch[0]), num_layers=int(config["num_hidden_layers"]),
                         hidden_size=int(config["hidden_size"]), num_heads=heads,
                         num_kv_heads=int(config.get("num_key_value_heads") or heads),
                         intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                         gated_mlp=True, max_context_tokens=int(config.get("max_position_embeddings", 2048)),
                         bytes_per_param=HF_DTYPE_BYTES[dt],
                         tied_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise ConfigError(f"hf_model_spec: config.json has no {exc.args[0]!r}") from None


def gpu_preset(name: str) -> GPUSpec:
    return _lookup("GPU", GPUS, name, {"h100": "h100-80gb", "a100": "a100-80gb"})


def cluster_preset(name: str) -> ClusterSpec:
    return _lookup("cluster", CLUSTERS, name)


def cluster_for_gpus(num_gpus: int, gpu: GPUSpec | str = "h100-80gb", gpus_per_node: int = GPUS_PER_NODE,
                     nvlink_bytes_per_s: float = 400e9, network_bytes_per_s: float = 200e9) -> ClusterSpec:
    """A cluster of `num_gpus` GPUs in full nodes (the paper's links by default); a partial node is refused."""
    gpu_spec = gpu_preset(gpu) if isinstance(gpu, str) else gpu
    if num_gpus < 1:
        raise ConfigError(f"num_gpus must be >= 1, got {num_gpus}")
    if num_gpus <= gpus_per_node:
        return ClusterSpec(f"{num_gpus}x{gpu_spec.name}", 1, num_gpus, gpu_spec,
                           nvlink_bytes_per_s, network_bytes_per_s)
    if num_gpus % gpus_per_node:
        raise ConfigError(f"num_gpus={num_gpus} is not a whole number of {gpus_per_node}-GPU nodes")
    return ClusterSpec(f"{num_gpus // gpus_per_node}x{gpus_per_node}-{gpu_spec.name}", num_gpus // gpus_per_node,
                       gpus_per_node, gpu_spec, nvlink_bytes_per_s, network_bytes_per_s)
