"""The model OServe's vLLM engines serve when no model folder is given: a small Llama, nothing downloaded.

`oserve/data/tiny_llama_config.json` is a Llama-architecture config (hidden 256, 4 layers, 8 heads,
4 KV heads, vocabulary 32,000; about 19 M parameters, 38 MB in bfloat16). `materialize` writes it with
weights drawn from a seeded generator into a folder vLLM loads like any Hugging Face checkpoint
(`config.json` + `model.safetensors`), so every engine started from the same seed holds bit-identical
weights, and a folder is reused only when its recorded seed and checksum match.

The model has no trained tokenizer. `HashTokenizer` stands in for one, consistently with the gateway's
count of a text prompt (`oserve.streams.schemas.BYTES_PER_TOKEN` bytes a token): a prompt's UTF-8 bytes,
cut every 4 bytes, each piece hashed to a token id; an answer's token ids decode to syllables, one
word per token. Random weights answer with random tokens; what matters here is that they are real
tokens from a real engine, and deterministic under greedy sampling.

Pure, except `materialize` (it writes the folder) and torch/safetensors being imported there only.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from oserve.data import data_path
from oserve.errors import ConfigError
from oserve.streams.schemas import BYTES_PER_TOKEN

TINY_MODEL = "tiny-llama"
"""The shipped model's name (what `--model-path` defaults to, and what spans and metrics call it)."""
CONFIG_FILE = "tiny_llama_config.json"
MANIFEST = "oserve-model.json"
"""Written beside the weights: the seed they were drawn from and a checksum of every tensor."""
INIT_STD = 0.02
"""Standard deviation of the seeded weights (Llama's `initializer_range`); norms are ones."""
FIRST_ID = 3
"""Ids below this are special (0 unk, 1 bos, 2 eos) and are never produced by the tokenizer."""


LARGER_MODEL = "llama-200m"
"""A second shipped config, 10.9x the parameters of `TINY_MODEL` (hidden 1,024, 12 layers, 16 heads, 8 KV heads;
207 M parameters, 414 MB in bfloat16): what `oserve bench switch --live` measures a switch of a model too big to
move in a blink with. Written with seeded weights as the small one is; no engine serves it by default."""
CONFIGS = {TINY_MODEL: CONFIG_FILE, LARGER_MODEL: "llama_200m_config.json"}


def tiny_config() -> dict:
    """The shipped config (a fresh copy)."""
    return json.loads(data_path(CONFIG_FILE).read_text())


def shipped_config(model: str = TINY_MODEL) -> dict:
    """A shipped model's config (a fresh copy): `TINY_MODEL` or `LARGER_MODEL`.

    Raises:
        ConfigError: another name.
    """
    if model not in CONFIGS:
        raise ConfigError(f"no shipped model {model!r}; shipped: {', '.join(CONFIGS)}")
    return json.loads(data_path(CONFIGS[model]).read_text())


def default_dir(seed: int, model: str = TINY_MODEL) -> Path:
    """Where a shipped model is written: `$OSERVE_MODEL_DIR/<model>-s<seed>`, else under ~/.cache/oserve."""
    root = os.environ.get("OSERVE_MODEL_DIR") or str(Path.home() / ".cache" / "oserve" / "models")
    return Path(root) / f"{model}-s{seed}"


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a `LlamaForCausalLM` checkpoint with this config, by its Hugging Face name. Pure."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * head_dim, h),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
                   p + "self_attn.o_proj.weight": (h, heads * head_dim),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return shapes


def seeded_weights(config: dict, seed: int) -> dict:
    """The checkpoint's tensors drawn from `seed` (bfloat16): N(0, INIT_STD) matrices, norms of ones; the
    same seed gives the same bits on any machine (drawn in float32 on the CPU generator, in name order)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(parameter_shapes(config).items()):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def tensor_checksum(tensor) -> str:
    """SHA-256 of a tensor's bytes (its dtype and shape included), on the CPU."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def materialize(folder: Path | None = None, seed: int = 0, model: str = TINY_MODEL) -> Path:
    """Write a shipped model (`TINY_MODEL` unless `model` says `LARGER_MODEL`) with weights from `seed` into
    `folder` (default `default_dir(seed, model)`) and return it; a folder whose manifest records the same seed
    and config is reused as it is."""
    from safetensors.torch import save_file

    config = shipped_config(model)
    folder = Path(folder) if folder is not None else default_dir(seed, model)
    manifest_path = folder / MANIFEST
    if manifest_path.exists() and (folder / "model.safetensors").exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("seed") == seed and manifest.get("config") == config:
                return folder
        except (OSError, ValueError):
            pass  # unreadable: write it again
    folder.mkdir(parents=True, exist_ok=True)
    tensors = seeded_weights(config, seed)
    tmp = folder / f"model.safetensors.{os.getpid()}.{threading.get_ident()}.tmp"  # one a writer: atomic replace
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    manifest = {"model": model, "seed": seed, "config": config,
                "checksums": {name: tensor_checksum(t) for name, t in sorted(tensors.items())}}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return folder


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder carries a Hugging Face tokenizer (else `HashTokenizer` stands in)."""
    return any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)


@dataclass(frozen=True, slots=True)
class HashTokenizer:
    """A stand-in tokenizer for a model without one (see the module docstring). Pure."""

    vocab_size: int = 32000
    bytes_per_token: int = BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if self.vocab_size <= FIRST_ID or self.bytes_per_token < 1:
            raise ConfigError(f"HashTokenizer: invalid vocab_size {self.vocab_size} or bytes_per_token "
                              f"{self.bytes_per_token}")

    def encode(self, text: str) -> list[int]:
        """Token ids of a text: one per `bytes_per_token` bytes of its UTF-8 (so as many as the gateway counts)."""
        data, step, span = text.encode(), self.bytes_per_token, self.vocab_size - FIRST_ID
        return [FIRST_ID + zlib.crc32(data[i:i + step]) % span for i in range(0, len(data), step)]

    def synthetic(self, num_tokens: int, key: str) -> list[int]:
        """`num_tokens` ids for a prompt given only as a count (a trace replay), the same for the same `key`."""
        state, span, out = zlib.crc32(key.encode()) or 1, self.vocab_size - FIRST_ID, []
        for _ in range(num_tokens):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            out.append(FIRST_ID + (state >> 8) % span)
        return out

    def word(self, token_id: int) -> str:
        """The text of one token: a space and one to three syllables; special ids give nothing."""
        if token_id < FIRST_ID:
            return ""
        n, parts = token_id - FIRST_ID, []
        while True:
            n, r = divmod(n, len(_SYLLABLES))
            parts.append(_SYLLABLES[r])
            if n == 0:
                break
        return " " + "".join(parts)

    def decode(self, token_ids) -> str:
        return "".join(self.word(int(t)) for t in token_ids)
