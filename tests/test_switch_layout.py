"""Where every byte lives: interval arithmetic, weight and KV shards as vLLM lays them out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.specs import MODELS, ModelSpec, ReplicaShape, sharding_problems, stage_layers, stage_weight_bytes
from oserve.switch import intervals as iv
from oserve.switch.layout import (Shard, gpu_weight_shards, holdings_bytes, kv_head_range, kv_lines, kv_tensor,
                                  model_tensors, vocab_range)

GQA = ModelSpec("tiny-gqa", num_layers=5, hidden_size=64, num_heads=8, num_kv_heads=2, intermediate_size=96,
                vocab_size=203, gated_mlp=True, max_context_tokens=256)
OPTLIKE = ModelSpec("tiny-opt", num_layers=4, hidden_size=48, num_heads=6, num_kv_heads=6, intermediate_size=72,
                    vocab_size=150, gated_mlp=False, max_context_tokens=128, tied_embeddings=True, has_bias=True,
                    learned_positions=130)

spans = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=6)


def as_set(s: iv.IntervalSet) -> set[int]:
    return {x for lo, hi in s for x in range(lo, hi)}


@settings(max_examples=60)
@given(spans, spans)
def test_interval_ops_match_python_sets(a_raw, b_raw):
    a, b = iv.normalize(a_raw), iv.normalize(b_raw)
    sa = {x for lo, hi in a_raw for x in range(lo, hi)}
    sb = {x for lo, hi in b_raw for x in range(lo, hi)}
    assert as_set(a) == sa and iv.length(a) == len(sa)
    assert all(lo < hi for lo, hi in a) and all(x[1] < y[0] for x, y in zip(a, a[1:]))  # normal form
    assert as_set(iv.union(a, b)) == sa | sb
    assert as_set(iv.intersection(a, b)) == sa & sb
    assert as_set(iv.difference(a, b)) == sa - sb
    assert iv.contains(a, b) == (sb <= sa)
    for x in sorted(sa)[:5]:
        assert iv.offset_of(a, x) == sorted(sa).index(x)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tensors_add_up_to_the_model(name):
    model = MODELS[name]
    tensors = model_tensors(model)
    assert sum(t.num_bytes for t in tensors.values()) == model.weight_bytes
    assert holdings_bytes(gpu_weight_shards(model, ReplicaShape(1), 0, 0), tensors) == model.weight_bytes


def shapes_of(model: ModelSpec, max_tp: int = 8, max_pp: int = 4) -> list[ReplicaShape]:
    return [ReplicaShape(t, p) for t in range(1, max_tp + 1) for p in range(1, max_pp + 1)
            if not sharding_problems(model, ReplicaShape(t, p), max_tp)]


@pytest.mark.parametrize("model", [GQA, OPTLIKE, MODELS["llama2-70b"], MODELS["opt-66b"]], ids=lambda m: m.name)
def test_a_replica_holds_every_line_and_splits_disjointly(model):
    tensors = model_tensors(model)
    for shape in shapes_of(model):
        per_gpu = [gpu_weight_shards(model, shape, s, r) for s in range(shape.pp) for r in range(shape.tp)]
        for name, t in tensors.items():
            holders = [h[name] for h in per_gpu if name in h]
            assert holders, (shape, name)
            covered = iv.EMPTY
            for h in holders:
                covered = iv.union(covered, h)
            assert covered == t.all_lines, (shape, name)
            total = sum(iv.length(h) for h in holders)
            replicated = (t.cols == 1 and t.split_axis == 0 and not name.endswith(("qkv_proj.bias", "up_proj.bias"))) \
                or "embed_positions" in name
            if name.endswith("qkv_proj.weight") and shape.tp > model.num_kv_heads:
                # KV heads replicated on tp / num_kv_heads ranks each; query rows split.
                q = model.num_heads * model.head_dim
                extra = (shape.tp // model.num_kv_heads - 1) * (t.num_lines - q)
                assert total == t.num_lines + extra
            elif name == "model.embed_tokens.weight" and model.tied_embeddings and shape.pp > 1:
                assert total == 2 * t.num_lines  # first stage embeds, last stage's LM head has its own copy
            elif not replicated:
                assert total == t.num_lines, (shape, name)
        # Per-GPU bytes agree with the specs' accounting on the presets. (`stage_weight_bytes` counts
        # replicated vectors, position embeddings and KV heads replicated past TP = num_kv_heads as split,
        # which only the tiny test models make visible.)
        if model.name not in MODELS:
            continue
        for s, expect in enumerate(stage_weight_bytes(model, shape)):
            got = holdings_bytes(per_gpu[s * shape.tp], tensors)
            assert abs(got - expect) <= 0.01 * expect + 64 * model.hidden_size * model.bytes_per_param


def test_fused_qkv_slice_is_q_heads_plus_k_and_v_slices():
    m = GQA  # 8 heads, 2 KV heads, head_dim 8
    hd = m.head_dim
    lines = gpu_weight_shards(m, ReplicaShape(4), 0, 3)["model.layers.0.self_attn.qkv_proj.weight"]
    # rank 3 of 4: query heads 6, 7; KV head 1 (replicated on ranks 2 and 3)
    assert lines == ((6 * hd, 8 * hd), (8 * hd + 1 * hd, 8 * hd + 2 * hd), (10 * hd + 1 * hd, 10 * hd + 2 * hd))
    assert kv_head_range(m, 4, 2) == kv_head_range(m, 4, 3) == (1, 2)
    assert kv_head_range(m, 2, 1) == (1, 2)
    gate_up = gpu_weight_shards(m, ReplicaShape(2), 0, 1)["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up == ((48, 96), (96 + 48, 192))
    down = gpu_weight_shards(m, ReplicaShape(2), 0, 1)["model.layers.0.mlp.down_proj.weight"]
    assert down == ((48, 96),) and model_tensors(m)["model.layers.0.mlp.down_proj.weight"].split_axis == 1


def test_vocab_padding_as_vllm():
    # 203 rows padded to 256, 64 per rank of 4; the last rank keeps only the real rows.
    assert [vocab_range(203, 4, r) for r in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 203)]
    assert vocab_range(50272, 3, 2) == (2 * 16768, 50272)


def test_layers_follow_stage_layers():
    shape = ReplicaShape(2, 3)
    parts = stage_layers(GQA.num_layers, 3)
    first = 0
    for s, n in enumerate(parts):
        held = {int(k.split(".")[2]) for k in gpu_weight_shards(GQA, shape, s, 0) if k.startswith("model.layers.")}
        assert held == set(range(first, first + n))
        first += n
    assert "model.embed_tokens.weight" in gpu_weight_shards(GQA, shape, 0, 1)
    assert "lm_head.weight" in gpu_weight_shards(GQA, shape, 2, 1)
    assert "lm_head.weight" not in gpu_weight_shards(GQA, shape, 1, 1)


@settings(max_examples=30)
@given(st.sampled_from(["w", "kv"]), st.integers(1, 4), st.integers(0, 3), st.data())
def test_byte_ranges_cover_exactly_the_shard(kind, tp_pow, rank_seed, data):
    if kind == "w":
        tensors = model_tensors(GQA)
        name = data.draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        lo = data.draw(st.integers(0, t.num_lines - 1))
        hi = data.draw(st.integers(lo + 1, t.num_lines))
        shard = Shard(t, ((lo, hi),))
    else:
        tokens = data.draw(st.integers(1, 40))
        t = kv_tensor(GQA, "q", 0, tokens)
        tp = [1, 2, 4, 8][tp_pow - 1]
        shard = Shard(t, kv_lines(GQA, tp, rank_seed % tp, tokens))
    ranges = shard.byte_ranges()
    assert iv.length(ranges) == shard.num_bytes
    assert ranges[0][0] >= 0 and ranges[-1][1] <= t.num_bytes


def test_kv_lines_are_heads_of_k_and_v():
    tokens = 10
    t = kv_tensor(GQA, "q", 3, tokens)
    assert t.rows == 2 * GQA.num_kv_heads * tokens and t.cols == GQA.head_dim
    assert kv_lines(GQA, 2, 1, tokens) == ((10, 20), (30, 40))
    assert kv_lines(GQA, 1, 0, tokens, (4, 7)) == ((4, 7), (14, 17), (24, 27), (34, 37))
    all_ranks = iv.EMPTY
    for r in range(4):
        all_ranks = iv.union(all_ranks, kv_lines(GQA, 4, r, tokens))
    assert all_ranks == t.all_lines


def test_bad_shape_is_refused():
    with pytest.raises(ConfigError):
        gpu_weight_shards(GQA, ReplicaShape(3), 0, 0)
