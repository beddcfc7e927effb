"""Migration executor: real tensors over torch.distributed (gloo) between worker processes, bit-exact or rolled back."""

from __future__ import annotations

import pytest

from oserve.specs import GPUS, ClusterSpec, Deployment, ModelSpec, Replica, ReplicaShape

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from oserve.switch.executor import ExecutorConfig, execute_switch, full_tensor, same_bits, take_lines  # noqa: E402
from oserve.switch.kv import KVPolicy, plan_kv_migration  # noqa: E402
from oserve.switch.layout import RunningRequest, model_tensors  # noqa: E402
from oserve.switch.planner import plan_switch  # noqa: E402

# Llama architecture scaled down: GQA with 2 KV heads, so TP=4 replicates each KV head on two ranks.
TINY = ModelSpec("llama-tiny", num_layers=4, hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256,
                 vocab_size=1000, gated_mlp=True, max_context_tokens=512)
H100 = GPUS["h100-80gb"]
ONE_NODE = ClusterSpec("1x4", 1, 4, H100, 400e9, 200e9)
TWO_NODES = ClusterSpec("2x2", 2, 2, H100, 400e9, 200e9)
DP2_TP2 = Deployment((Replica("r0", ReplicaShape(2), (0, 1)), Replica("r1", ReplicaShape(2), (2, 3))))
REQUESTS = [RunningRequest("a", "r0", 100), RunningRequest("b", "r1", 300), RunningRequest("c", "r1", 20)]
POLICY = KVPolicy(migrate_min_context_tokens=64, headroom_frac=0.5)
CONFIG = ExecutorConfig(timeout_s=60, max_inflight=8)


def test_reference_tensors_are_seeded_and_sliced_like_the_layout():
    spec = model_tensors(TINY)["model.layers.1.self_attn.o_proj.weight"]
    a, b = full_tensor(spec, 3), full_tensor(spec, 3)
    assert same_bits(a, b) and not same_bits(a, full_tensor(spec, 4))
    shard = take_lines(a, spec, ((0, 16), (32, 48)))
    assert shard.shape == (spec.rows, 32) and same_bits(shard[:, 16:], a[:, 32:48])


@pytest.mark.parametrize("cluster, target, planner", [
    (ONE_NODE, Deployment((Replica("t0", ReplicaShape(4), (0, 1, 2, 3)),)), "greedy"),
    # Stages swapped across nodes: with the placement as given, everything crosses the network.
    (TWO_NODES, Deployment((Replica("t0", ReplicaShape(1, 4), (2, 3, 0, 1)),)), "improved"),
], ids=["tp4-nvlink-greedy", "pp4-network-improved"])
def test_weights_and_kv_arrive_bit_exact_and_commit(cluster, target, planner):
    plan = plan_switch(TINY, cluster, DP2_TP2, target, planner=planner)
    kv = plan_kv_migration(TINY, cluster, plan, REQUESTS, policy=POLICY, planner=planner)
    assert kv.migrations and dict(kv.drained) == {"c": "short"}
    links = {t.link for t in plan.transfers + kv.transfers}
    assert links - {"local"}, "the case should move bytes between processes"
    res = execute_switch(TINY, plan, seed=11, kv_plan=kv, config=CONFIG)
    assert res.committed and res.bit_exact and not res.rolled_back, res.errors
    assert res.bytes == plan.moved_bytes + kv.nvlink_bytes + kv.network_bytes
    assert res.num_workers == 4 and res.gbytes_per_s > 0
    assert [e.kind for e in res.events] == ["SwitchStarted", "SwitchCommitted"]


def test_failure_mid_way_rolls_back_and_keeps_the_source_serving():
    target = Deployment((Replica("t0", ReplicaShape(4), (0, 1, 2, 3)),))
    plan = plan_switch(TINY, ONE_NODE, DP2_TP2, target, planner="greedy")
    kv = plan_kv_migration(TINY, ONE_NODE, plan, REQUESTS, policy=POLICY, planner="greedy")
    sender = next(t.src_gpu for t in plan.transfers if t.link != "local")
    res = execute_switch(TINY, plan, seed=11, kv_plan=kv,
                         config=ExecutorConfig(timeout_s=60, max_inflight=8, fail_gpu=sender, fail_after_ops=2))
    assert res.rolled_back and not res.committed and not res.bit_exact
    assert res.source_intact  # every worker re-checked its source shards: the old deployment still serves
    assert res.events[-1].kind == "SwitchRolledBack"
    assert "injected failure" in res.events[-1].detail and "source deployment kept serving" in res.events[-1].detail
