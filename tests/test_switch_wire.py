"""Live switch data path without vLLM: the wire plan (pure, property-tested) and its transport over real
gloo process groups between real processes, checked bit-exact against seeded tensors."""

from __future__ import annotations

import multiprocessing as mp
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.specs import Deployment, Replica, ReplicaShape
from oserve.switch import intervals as iv
from oserve.switch.layout import deployment_weight_layout, holdings_bytes, model_tensors
from oserve.switch.planner import plan_switch
from oserve.switch.wire import EndpointJob, wire_plan, wire_problems
from test_switch_planner import CLUSTER, CONFIG, GQA, OPTLIKE, deployments

torch = pytest.importorskip("torch")


def _starting(source: Deployment, target: Deployment) -> frozenset[str]:
    return frozenset(r.replica_id for r in target.replicas) - {r.replica_id for r in source.replicas}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([GQA, OPTLIKE]), st.sampled_from(["greedy", "improved"]), st.integers(64, 1 << 16), st.data())
def test_every_new_rank_gets_exactly_its_shard_once_from_a_holder(model, planner, chunk_bytes, data):
    source = data.draw(deployments(model, prefix="s"))
    target = data.draw(deployments(model, prefix="t"))
    plan = plan_switch(model, CLUSTER, source, target, planner=planner, config=CONFIG)
    wire = wire_plan(model, plan, chunk_bytes=chunk_bytes, starting=_starting(source, plan.target))
    assert wire_problems(wire) == []
    tensors = model_tensors(model)
    want = deployment_weight_layout(model, plan.target)
    # every GPU of the target is a new rank here: it receives all of its shard, over some link
    assert wire.num_bytes == sum(holdings_bytes(want[g], tensors) for g in want)
    assert sum(wire.bytes_by_link().values()) == wire.num_bytes
    for op in wire.ops:
        assert op.num_bytes <= chunk_bytes or len(op.pieces) == 1  # one line may exceed a chunk, alone
        assert op.num_bytes == sum((p.hi - p.lo) * tensors[p.tensor].line_bytes for p in op.pieces)
        assert wire.endpoints[op.src].side == "source" or any(p.relay for p in op.pieces)
        assert wire.endpoints[op.dst].side == "target"
    # the plan's network and NVLink bytes cross the same links here; everything else stays on its GPU
    by_link = wire.bytes_by_link()
    assert by_link.get("network", 0) == plan.network_bytes and by_link.get("nvlink", 0) == plan.nvlink_bytes
    # each endpoint's job is the plan seen from it, and survives JSON
    for key in wire.endpoints:
        job = wire.job(key)
        assert EndpointJob.from_json(job.to_json()) == job
        assert [op.index for op in job.ops] == sorted(op.index for op in job.ops)


def test_kept_replicas_start_nothing_and_reused_shards_come_from_the_same_gpu():
    source = Deployment((Replica("a", ReplicaShape(2), (0, 1)), Replica("b", ReplicaShape(2), (2, 3))))
    target = Deployment((Replica("a", ReplicaShape(2), (0, 1)), Replica("c", ReplicaShape(2), (2, 3))))
    plan = plan_switch(GQA, CLUSTER, source, target, config=CONFIG)
    wire = wire_plan(GQA, plan, starting=frozenset({"c"}))  # c is b again under a new id
    assert wire_problems(wire) == []
    assert {wire.endpoints[op.dst].replica_id for op in wire.ops} == {"c"}
    assert {(op.src, op.dst, op.link) for op in wire.ops} == {("b/0", "c/0", "local"), ("b/1", "c/1", "local")}


def test_a_new_replica_needs_an_id_of_its_own():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("a", ReplicaShape(2), (0, 1)),))
    plan = plan_switch(GQA, CLUSTER, source, target, config=CONFIG)
    with pytest.raises(ConfigError, match="id of its own"):
        wire_plan(GQA, plan, starting=frozenset({"a"}))


def test_a_job_of_another_format_or_outside_its_tensors_is_refused():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t", ReplicaShape(2), (0, 1)),))
    job = wire_plan(GQA, plan_switch(GQA, CLUSTER, source, target, config=CONFIG)).job("t/1")
    with pytest.raises(ConfigError, match="version"):
        EndpointJob.from_json(job.to_json().replace(b'"version":1', b'"version":2'))
    with pytest.raises(ConfigError, match="malformed"):
        EndpointJob.from_json(b'{"version":1}')
    bad = job.to_json().replace(b'"ops":[[', b'"ops":[[0,"a/0",false,"local",[["model.norm.weight",0,99999,false]]],[')
    with pytest.raises(ConfigError, match="outside the tensor"):
        EndpointJob.from_json(bad)


# --- real processes over gloo --------------------------------------------------------------------------------

SEED = 5


def _full(spec) -> torch.Tensor:
    from oserve.switch.executor import full_tensor

    return full_tensor(spec, SEED)


def _endpoint(rendezvous, key: str, corrupt_op: int | None, out, cuda: bool = False) -> None:  # pragma: no cover
    """One engine process (a child): sources hold their seeded shards, targets NaN; run the job; report
    bit-exactness. `cuda`: the shards live on CUDA device `gpu % devices`, as an engine's do."""
    from oserve.switch.executor import take_lines
    from oserve.switch.transport import as_2d, fetch_job, run_job

    torch.set_num_threads(1)
    store = rendezvous.connect()
    job = fetch_job(store, key)
    device = torch.device("cuda", job.gpu % torch.cuda.device_count()) if cuda else torch.device("cpu")
    shards = {}
    for name, lines in job.holds.items():
        spec = job.tensors[name]
        if job.side == "source":
            shards[name] = take_lines(_full(spec), spec, lines).clone()
        else:
            from oserve.switch.transport import local_shape

            shards[name] = torch.full(local_shape(spec, lines), float("nan"), dtype=torch.float16)
    shards = {n: t.to(device) for n, t in shards.items()}
    before = {n: t.clone() for n, t in shards.items()}
    res = run_job(job, shards.__getitem__, store, device=device, timeout_s=rendezvous.timeout_s, corrupt_op=corrupt_op)
    shards = {n: t.cpu() for n, t in shards.items()}
    before = {n: t.cpu() for n, t in before.items()}
    exact = all(torch.equal(as_2d(t, job.tensors[n], job.holds[n]).view(torch.int16),
                            take_lines(_full(job.tensors[n]), job.tensors[n], job.holds[n]).view(torch.int16))
                for n, t in shards.items()) if job.side == "target" else \
        all(torch.equal(t.view(torch.int16), before[n].view(torch.int16)) for n, t in shards.items())
    out.put((key, res.to_dict(), exact))


def _run(model, plan, starting, corrupt_op=None, kill=None, timeout_s=30.0, cuda=False):
    from oserve.switch.transport import SessionStore

    wire = wire_plan(model, plan, chunk_bytes=1 << 14, starting=starting)
    session = SessionStore("t", timeout_s=timeout_s)
    session.put_jobs({k: wire.job(k) for k in wire.endpoints})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "oserve.switch.transport"])
    out = ctx.Queue()
    procs = {k: ctx.Process(target=_endpoint, args=(session.rendezvous, k, corrupt_op, out, cuda), daemon=True)
             for k in wire.endpoints if k != kill}
    for p in procs.values():
        p.start()
    results = {}
    for _ in procs:
        key, res, exact = out.get(timeout=120)
        results[key] = (res, exact)
    for p in procs.values():
        p.join(30)
    session.close()
    return wire, results


TINY = GQA


def test_a_tp1_pair_becomes_a_tp2_replica_bit_exact_over_gloo():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)), Replica("b", ReplicaShape(1), (1,))))
    target = Deployment((Replica("t", ReplicaShape(2), (0, 1)),))
    plan = plan_switch(TINY, CLUSTER, source, target, config=CONFIG)
    wire, results = _run(TINY, plan, frozenset({"t"}))
    assert set(results) == set(wire.endpoints)
    for key, (res, exact) in results.items():
        assert res["verified"] and exact, (key, res)
    received = sum(r["bytes_received"] for r, _ in results.values())
    sent = sum(r["bytes_sent"] for r, _ in results.values())
    assert received == sent == wire.num_bytes  # fp16 here: the layout's bytes are the wire's


def test_a_pipeline_across_nodes_with_every_link_type_arrives_bit_exact():
    source = Deployment((Replica("a", ReplicaShape(2), (0, 1)),))
    target = Deployment((Replica("t", ReplicaShape(1, 2), (0, 4)), Replica("u", ReplicaShape(2), (2, 3))))
    plan = plan_switch(TINY, CLUSTER, source, target, planner="greedy", config=CONFIG)
    wire, results = _run(TINY, plan, frozenset({"t", "u"}))
    assert {"local", "nvlink", "network"} <= set(wire.bytes_by_link())
    assert all(res["verified"] and exact for res, exact in results.values()), results


def test_bytes_changed_on_the_wire_fail_the_checksum_and_the_source_stays_intact():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t", ReplicaShape(2), (0, 1)),))
    plan = plan_switch(TINY, CLUSTER, source, target, config=CONFIG)
    victim = wire_plan(TINY, plan, chunk_bytes=1 << 14).ops[1]
    wire, results = _run(TINY, plan, frozenset({"t"}), corrupt_op=victim.index)
    res, _ = results[victim.dst]
    assert not res["verified"] and f"op {victim.index}" in res["error"] and "checksum" in res["error"]
    assert not any(r["verified"] for r, _ in results.values())  # the failure ended every endpoint
    assert all(r["seconds"] < 10 for r, _ in results.values())  # at once, not at the 30 s timeout
    assert results["a/0"][1]  # the source's own shard was never written


def test_a_missing_peer_fails_the_job_within_its_timeout():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t", ReplicaShape(1), (1,)),))
    plan = plan_switch(TINY, CLUSTER, source, target, config=CONFIG)
    wire, results = _run(TINY, plan, frozenset({"t"}), kill="a/0", timeout_s=4.0)
    res, _ = results["t/0"]
    assert not res["verified"] and res["error"]
    got = defaultdict(tuple)
    for op in wire.ops:
        for p in op.pieces:
            got[p.tensor] = iv.union(got[p.tensor], ((p.lo, p.hi),))
    assert got  # the job had something to receive


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs: NCCL between two devices (none here)")
def test_the_same_transport_over_nccl_between_two_gpus():
    """A TP1 replica on GPU 0 becomes a TP2 replica on GPUs 0 and 1: rank 1's shard goes from GPU 0 to GPU 1 over
    NCCL, rank 0's stays on GPU 0 and goes over gloo through host memory (NCCL refuses two ranks on one device)."""
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t", ReplicaShape(2), (0, 1)),))
    plan = plan_switch(TINY, CLUSTER, source, target, planner="greedy", config=CONFIG)
    wire, results = _run(TINY, plan, frozenset({"t"}), cuda=True)
    assert {"local", "nvlink"} <= set(wire.bytes_by_link())
    assert all(res["verified"] and exact for res, exact in results.values()), results


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU: two processes on one device over gloo (none here)")
def test_two_processes_on_one_gpu_move_through_host_memory():
    source = Deployment((Replica("a", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t", ReplicaShape(1), (0,)),))
    plan = plan_switch(TINY, CLUSTER, source, target, config=CONFIG)
    wire, results = _run(TINY, plan, frozenset({"t"}), cuda=True)
    assert set(wire.bytes_by_link()) == {"local"}
    assert all(res["verified"] and exact for res, exact in results.values()), results
