"""Specs: presets with real numbers, sharding rules as engines apply them, memory feasibility."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.errors import ConfigError, UnknownNameError
from oserve.specs import (CLUSTERS, GPUS, MODELS, Deployment, MemoryConfig, Replica, ReplicaShape,
                          cluster_for_gpus, kv_capacity_tokens, model_preset, shape_problems, sharding_problems,
                          stage_layers, stage_weight_bytes, valid_shapes)

H100 = GPUS["h100-80gb"]


@pytest.mark.parametrize("name, billions", [("llama2-70b", 68.98), ("llama-30b", 32.5), ("opt-30b", 29.97),
                                            ("opt-66b", 65.7), ("llama2-7b", 6.74), ("codellama-34b", 33.7)])
def test_parameter_counts_match_published_sizes(name, billions):
    assert model_preset(name).num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_paper_cluster_preset():
    c = CLUSTERS["paper-4x8-h100"]
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus) == (4, 8, 32)
    assert c.nvlink_bytes_per_s == 400e9 and c.network_bytes_per_s == 200e9
    assert c.node_of(8) == 1 and c.node_of(31) == 3


def test_opt66b_allows_tp3_and_llama70b_does_not():
    assert sharding_problems(model_preset("opt-66b"), ReplicaShape(3, 2), 8) == []
    problems = sharding_problems(model_preset("llama2-70b"), ReplicaShape(3, 1), 8)
    assert any("64 attention heads" in p for p in problems)


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    m = model_preset("llama2-70b")  # 8 KV heads
    assert sharding_problems(m, ReplicaShape(8, 1), 8) == []
    assert any("exceeds" in p for p in sharding_problems(m, ReplicaShape(16, 1), 16 // 2))


def test_llama70b_does_not_fit_one_h100():
    problems = shape_problems(model_preset("llama2-70b"), H100, ReplicaShape(1, 1), 8)
    assert problems and "KV tokens" in problems[0]
    assert shape_problems(model_preset("llama2-70b"), H100, ReplicaShape(2, 1), 8) == []


def test_unknown_model_names_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown model 'gpt-5'.*llama2-70b"):
        model_preset("gpt-5")


@pytest.mark.parametrize("tp, pp", [(0, 1), (1, 0), (-2, 1)])
def test_bad_shape_is_refused(tp, pp):
    with pytest.raises(ConfigError, match="tp and pp"):
        ReplicaShape(tp, pp)


def test_partial_node_is_refused():
    with pytest.raises(ConfigError, match="whole number"):
        cluster_for_gpus(12)
    assert cluster_for_gpus(16).num_nodes == 2 and cluster_for_gpus(4).num_gpus == 4


def test_deployment_refuses_a_gpu_twice():
    a = Replica("r0", ReplicaShape(2), (0, 1))
    b = Replica("r1", ReplicaShape(2), (1, 2))
    with pytest.raises(ConfigError, match="GPU 1"):
        Deployment((a, b))


def test_tp_group_across_nodes_is_a_placement_problem():
    c = cluster_for_gpus(16)
    assert Replica("r", ReplicaShape(2), (7, 8)).placement_problems(c)
    assert not Replica("r", ReplicaShape(2, 2), (6, 7, 8, 9)).placement_problems(c)  # PP may cross nodes


@given(layers=st.integers(1, 128), pp=st.integers(1, 64))
def test_stage_layers_partition_the_model(layers, pp):
    if pp > layers:
        with pytest.raises(ConfigError):
            stage_layers(layers, pp)
        return
    parts = stage_layers(layers, pp)
    assert sum(parts) == layers and len(parts) == pp
    assert max(parts) - min(parts) <= 1 and parts[-1] == min(parts)


models = st.sampled_from(sorted(MODELS))
gpus = st.sampled_from(sorted(GPUS))


@given(name=models, tp=st.sampled_from([1, 2, 4, 8]), pp=st.integers(1, 8))
def test_sharding_rules_match_divisibility(name, tp, pp):
    m = MODELS[name]
    ok = not sharding_problems(m, ReplicaShape(tp, pp), 8)
    expect = (m.num_heads % tp == 0 and (m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0)
              and m.intermediate_size % tp == 0 and pp <= m.num_layers)
    assert ok == expect


@given(name=models, tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 6))
def test_more_tp_never_more_weight_bytes_per_gpu(name, tp, pp):
    m = MODELS[name]
    assert max(stage_weight_bytes(m, ReplicaShape(2 * tp, pp))) <= max(stage_weight_bytes(m, ReplicaShape(tp, pp)))
    assert max(stage_weight_bytes(m, ReplicaShape(tp, pp + 1))) <= max(stage_weight_bytes(m, ReplicaShape(tp, pp)))


@given(name=models, gpu=gpus, tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 4))
def test_more_gpus_never_less_kv_room(name, gpu, tp, pp):
    m, g = MODELS[name], GPUS[gpu]
    base = kv_capacity_tokens(m, g, ReplicaShape(tp, pp))
    assert kv_capacity_tokens(m, g, ReplicaShape(tp, pp + 1)) >= base
    if not sharding_problems(m, ReplicaShape(2 * tp, pp), 8):
        assert kv_capacity_tokens(m, g, ReplicaShape(2 * tp, pp)) >= base


@given(name=models, gpu=gpus, util=st.floats(0.5, 0.95))
def test_valid_shapes_fit_in_memory(name, gpu, util):
    m, g = MODELS[name], GPUS[gpu]
    mem = MemoryConfig(gpu_memory_utilization=util)
    for shape in valid_shapes(m, g, 8, 16, mem):
        assert kv_capacity_tokens(m, g, shape, mem) >= m.max_context_tokens
        assert max(stage_weight_bytes(m, shape)) < g.memory_bytes * util
        assert shape.tp <= 8 and shape.num_gpus <= 16


def test_memory_config_names_the_bad_field():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        MemoryConfig(gpu_memory_utilization=1.5)


def test_an_unknown_name_error_crosses_a_process_boundary_whole() -> None:
    """A bench's worker process raises it for a bad name; the pool pickles it back to the command, which prints
    its message (KeyError's default pickling rebuilt it from the message alone and failed)."""
    import pickle

    from oserve.errors import UnknownNameError

    with pytest.raises(UnknownNameError) as caught:
        model_preset("llama-9000")
    back = pickle.loads(pickle.dumps(caught.value))
    assert type(back) is UnknownNameError and str(back) == str(caught.value)
    assert (back.kind, back.name, back.known) == (caught.value.kind, caught.value.name, caught.value.known)
