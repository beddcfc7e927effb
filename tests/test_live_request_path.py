"""The request path against a real nats-server: client -> gateway -> engine (sim backend) -> client."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from contextlib import AsyncExitStack

import nats
import pytest

from oserve.streams.client import NoGateway, OServeClient, RequestRejected, RequestTimeout
from oserve.streams.schemas import (AssignmentSet, Completed, Dispatch, ErrorCode, ErrorReply, Reply, SubmitRequest,
                                    decode, decode_reply, encode)
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig

from conftest import FAST_HB, start_system  # noqa: E402


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def test_every_request_is_answered_exactly_once(server) -> None:
    num = 200

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, _ = await start_system(stack, server.url)
            replies: Counter[str] = Counter()
            got_all = asyncio.Event()

            async def on_reply(msg) -> None:
                r = decode_reply(msg.data)
                assert isinstance(r, Reply), r
                replies[r.request_id] += 1
                if len(replies) == num:
                    got_all.set()

            inbox = nc.new_inbox()
            await nc.subscribe(f"{inbox}.*", cb=on_reply)
            for i in range(num):
                req = SubmitRequest(request_id=f"q{i}", input_tokens=50 + 7 * i, max_tokens=1 + i % 40)
                await nc.publish(subjects.submit(), encode(req), reply=f"{inbox}.{i}")
            await asyncio.wait_for(got_all.wait(), 20)
            await wait_until(lambda: not gw.pending, 5, "the gateway to see every completion")
            for e in engines:
                await e.drain()
            await nc.flush()
            assert len(replies) == num and set(replies.values()) == {1}
            assert sum(e.num_answered for e in engines) == num
            assert all(e.num_answered > 0 for e in engines)  # both replicas served
            assert gw.num_accepted == num and gw.num_redispatched == 0

    await asyncio.wait_for(main(), 40)


async def test_bad_inputs_get_error_replies_and_the_system_keeps_serving(server) -> None:
    bad = {
        b"{this is not json": ErrorCode.BAD_JSON,
        json.dumps({"type": "submit.v7", "request_id": "a", "input_tokens": 3}).encode(): ErrorCode.BAD_VERSION,
        json.dumps({"request_id": "a", "input_tokens": 3}).encode(): ErrorCode.BAD_VERSION,
        json.dumps({"type": "submit.v1", "request_id": "a", "input_tokens": -5}).encode(): ErrorCode.INVALID,
        json.dumps({"type": "submit.v1", "request_id": "a", "input_tokens": 10,
                    "max_tokens": -1}).encode(): ErrorCode.INVALID,
        json.dumps({"type": "submit.v1", "request_id": "a", "input_tokens": 10**15}).encode(): ErrorCode.INVALID,
        json.dumps({"type": "submit.v1", "request_id": "a", "input_tokens": 30000,
                    "max_tokens": 30000}).encode(): ErrorCode.INVALID,  # over the context limit
        json.dumps({"type": "submit.v1", "request_id": "a"}).encode(): ErrorCode.INVALID,
        b"\xff\xfe\x00": ErrorCode.BAD_JSON,
    }

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))
            for payload, code in bad.items():
                with pytest.raises(RequestRejected) as info:
                    await client.submit_raw(payload, timeout_s=5)
                assert info.value.code == code, (payload, info.value)
                ok = await client.submit(prompt="still serving?", max_tokens=4, timeout_s=5)
                assert ok.output_tokens == 4
            # garbage straight to an engine: an error reply, and it keeps serving
            answer = await nc.request(subjects.replica("r0"), b"garbage", timeout=5)
            assert isinstance(decode_reply(answer.data), ErrorReply)
            assert (await client.submit(input_tokens=10, max_tokens=2, timeout_s=5)).replica_id == "r0"
            assert gw.num_rejected == len(bad)
            with pytest.raises(ValueError):
                await client.submit(prompt="x", input_tokens=3)

    await asyncio.wait_for(main(), 40)


async def test_client_errors_are_clear(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            subjects = unique_subjects()
            client = await OServeClient.connect(server.url, subjects=subjects)
            stack.push_async_callback(client.close)
            with pytest.raises(NoGateway):
                await client.submit(input_tokens=5, timeout_s=2)
            # a gateway with no replica answers no_replica once its wait for one runs out;
            # a request nobody answers times out
            nc = client.nc
            gw = Gateway(nc, GatewayConfig(subjects=subjects, no_replica_wait_wall_s=0.3), Clock())
            await stack.enter_async_context(gw)
            with pytest.raises(RequestRejected) as info:
                await client.submit(input_tokens=5, timeout_s=2)
            assert info.value.code == ErrorCode.NO_REPLICA and "0.3 s" in info.value.message
            assert not gw.pending
            await nc.subscribe(subjects.replica("mute"), cb=_ignore)
            await nc.publish(subjects.heartbeat("mute"), encode(_heartbeat("mute")))
            await gw.wait_for_replicas(1, 5)
            with pytest.raises(RequestTimeout):
                await client.submit(input_tokens=5, timeout_s=0.3)
            assert (await client.ping()).num_replicas == 1

    await asyncio.wait_for(main(), 30)


async def _ignore(msg) -> None:
    return None


def _heartbeat(replica_id: str):
    from oserve.streams.schemas import Heartbeat
    return Heartbeat(replica_id=replica_id, at_s=0.0, num_waiting=0, num_running=0)


async def test_engine_deduplicates_by_request_id(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, _ = await start_system(stack, server.url, replica_ids=("r0",), speedup=5.0)
            got: Counter[str] = Counter()

            async def on_reply(msg) -> None:
                got[msg.subject.rsplit(".", 1)[1]] += 1

            inbox = nc.new_inbox()
            await nc.subscribe(f"{inbox}.*", cb=on_reply)
            d = encode(Dispatch(request_id="dup", input_tokens=100, max_tokens=100, type_index=0, gateway_id="t"))
            await nc.publish(subjects.replica("r0"), d, reply=f"{inbox}.a")
            await nc.publish(subjects.replica("r0"), d, reply=f"{inbox}.b")  # while the first is in flight
            await nc.publish(subjects.replica("r0"), d, reply=f"{inbox}.a")  # a re-dispatch to the same inbox
            await wait_until(lambda: got["a"] == 1 and got["b"] == 1, 10, "the replies")
            await nc.publish(subjects.replica("r0"), d, reply=f"{inbox}.c")  # after it was answered
            await wait_until(lambda: got["c"] == 1, 5, "the cached reply")
            await nc.flush()
            # one answer per inbox: the retry from inbox b is answered too, inbox a only once
            assert got == Counter({"a": 1, "b": 1, "c": 1})
            assert engines[0].num_duplicates == 3 and engines[0].num_answered == 1

    await asyncio.wait_for(main(), 30)


async def test_a_dead_replicas_requests_are_redispatched(server) -> None:
    num = 30

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, speedup=4.0, gateway_kwargs=dict(heartbeat_timeout_wall_s=0.4,
                                                                   liveness_check_wall_s=0.05))
            doomed = engines[0]
            tasks = [asyncio.create_task(client.submit(input_tokens=200, max_tokens=300, request_id=f"d{i}",
                                                       timeout_s=20)) for i in range(num)]
            await wait_until(lambda: doomed.num_inflight > 0 and engines[1].num_inflight > 0, 5,
                             "both replicas to hold requests")
            lost_there = doomed.num_inflight
            await doomed.stop()  # dies: no drain, no replies, no heartbeats
            replies = await asyncio.gather(*tasks)
            assert sorted(r.request_id for r in replies) == sorted(f"d{i}" for i in range(num))
            assert sum(r.replica_id == engines[1].config.replica_id for r in replies) >= lost_there
            assert gw.num_redispatched >= lost_there
            assert gw.live_replicas == [engines[1].config.replica_id]
            await wait_until(lambda: not gw.pending, 5, "the gateway to see every completion")

    await asyncio.wait_for(main(), 40)


async def _system_whose_only_replica_died(stack: AsyncExitStack, url: str):
    nc, subjects, gw, engines, client = await start_system(
        stack, url, replica_ids=("r0",), speedup=50.0,
        gateway_kwargs=dict(heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05))
    await engines[0].stop()
    await wait_until(lambda: not gw.live_replicas, 5, "the gateway to see the replica die")
    return nc, subjects, gw, client


async def test_new_requests_wait_for_a_replica_instead_of_being_refused(server) -> None:
    """A moment with no live replica (all silent or restarting) delays new requests; it does not refuse them."""
    num = 5

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, client = await _system_whose_only_replica_died(stack, server.url)
            tasks = [asyncio.create_task(client.submit(input_tokens=50, max_tokens=20, request_id=f"w{i}",
                                                       timeout_s=20)) for i in range(num)]
            await wait_until(lambda: len(gw.pending) == num, 5, "the requests to be held")
            assert all(p.replica_id is None for p in gw.pending.values())
            cfg = EngineWorkerConfig("r1", subjects=subjects, **FAST_HB)
            fresh = await stack.enter_async_context(EngineWorker(nc, cfg, Clock(speedup=50.0)))
            replies = await asyncio.gather(*tasks)
            assert sorted(r.request_id for r in replies) == sorted(f"w{i}" for i in range(num))
            assert {r.replica_id for r in replies} == {"r1"} and fresh.num_answered == num
            assert gw.num_redispatched == 0 and gw.num_failed == 0  # a first dispatch, not a retry

    await asyncio.wait_for(main(), 40)


async def test_a_retry_of_a_held_request_is_answered_on_the_retrys_inbox(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, client = await _system_whose_only_replica_died(stack, server.url)
            # the client gives up first, and retries (the request's own deadline is later: with the two equal the
            # gateway's `deadline_exceeded` can come first on a loaded machine, as it once did in CI)
            first = SubmitRequest(request_id="held", input_tokens=50, max_tokens=20, timeout_s=30.0)
            with pytest.raises(RequestTimeout):
                await client.submit_raw(encode(first), "held", timeout_s=0.3)
            retry = asyncio.create_task(client.submit(input_tokens=50, max_tokens=20, request_id="held",
                                                      timeout_s=20))
            await asyncio.sleep(0.2)
            assert not retry.done() and len(gw.pending) == 1  # still held, not refused
            cfg = EngineWorkerConfig("r1", subjects=subjects, **FAST_HB)
            await stack.enter_async_context(EngineWorker(nc, cfg, Clock(speedup=50.0)))
            reply = await retry
            assert reply.request_id == "held" and reply.replica_id == "r1"

    await asyncio.wait_for(main(), 40)


async def test_a_stalled_gateway_does_not_declare_its_replicas_dead(server) -> None:
    """The gateway's own stall (its loop blocked) is not the replicas' silence: nobody is declared dead."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, speedup=50.0,
                gateway_kwargs=dict(heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05))
            await asyncio.sleep(0.1)
            time.sleep(1.0)  # the whole process stalls, heartbeat senders and the failure detector alike
            await asyncio.sleep(0.2)
            assert sorted(gw.live_replicas) == ["r0", "r1"] and gw.num_declared_dead == 0
            reply = await client.submit(input_tokens=50, max_tokens=20, timeout_s=10)
            assert reply.replica_id in ("r0", "r1") and gw.num_redispatched == 0
            await engines[0].stop()  # a real death is still seen
            await wait_until(lambda: gw.live_replicas == ["r1"], 5, "the gateway to see r0 die")
            assert gw.num_declared_dead == 1

    await asyncio.wait_for(main(), 40)


async def test_router_follows_the_published_assignment(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            # a plan far above the 20 requests, in one surplus window: the class is never beyond it
            nc, subjects, gw, engines, client = await start_system(stack, server.url,
                                                                   gateway_kwargs={"surplus_window_s": 1e9})
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=[{"r0": 0.0, "r1": 1e6}])))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            replies = await asyncio.gather(*[client.submit(input_tokens=30, max_tokens=3, timeout_s=10)
                                             for _ in range(20)])
            assert {r.replica_id for r in replies} == {"r1"} and gw.num_beyond_plan == 0

    await asyncio.wait_for(main(), 30)


async def test_a_class_that_comes_beyond_its_plan_is_routed_to_any_replica(server) -> None:
    """The plan gives the class r1 at 0.01 requests/s; 30 come at once. The first ones go to r1 as planned,
    and once the class is 1.5x its plan plus 10 requests beyond (`oserve.routing.beyond_plan`, as the
    simulator routes), the rest go to the least loaded replica of any class: r0 takes some."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=1.0)
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=[{"r0": 0.0, "r1": 0.01}])))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            replies = await asyncio.gather(*[client.submit(input_tokens=30, max_tokens=3, timeout_s=10)
                                             for _ in range(30)])
            where = [r.replica_id for r in replies]
            assert where.count("r1") >= 10 and "r0" in where
            assert gw.num_beyond_plan == 30 - 10

    await asyncio.wait_for(main(), 30)


async def test_engines_publish_heartbeats_and_telemetry(server) -> None:
    from oserve.streams.schemas import Heartbeat, Telemetry

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, replica_ids=("r0",), speedup=20.0, engine_kwargs=dict(telemetry_interval_s=2.0))
            seen: dict[str, list] = {"hb": [], "tm": []}
            got = asyncio.Event()

            async def on_hb(msg) -> None:
                seen["hb"].append(decode(msg.data, Heartbeat))

            async def on_tm(msg) -> None:
                t = decode(msg.data, Telemetry)
                seen["tm"].append(t)
                if t.num_requests > 0:
                    got.set()

            await nc.subscribe(subjects.heartbeats(), cb=on_hb)
            await nc.subscribe(subjects.all_telemetry(), cb=on_tm)
            await asyncio.gather(*[client.submit(input_tokens=64, max_tokens=8, timeout_s=5) for _ in range(10)])
            await asyncio.wait_for(got.wait(), 5)
            t = next(t for t in seen["tm"] if t.num_requests > 0)
            assert t.source_id == "r0" and t.window_s == 2.0 and t.p99_e2e_s >= t.p50_e2e_s > 0
            assert seen["hb"] and all(h.replica_id == "r0" and h.accepting for h in seen["hb"])

    await asyncio.wait_for(main(), 20)


async def test_worker_lifecycle_is_idempotent_and_the_gateway_sheds_load(server) -> None:
    async def main() -> None:
        nc = await nats.connect(server.url)
        subjects = unique_subjects()
        gw = Gateway(nc, GatewayConfig(subjects=subjects, max_pending=2), Clock())
        engine = EngineWorker(nc, EngineWorkerConfig("r0", subjects=subjects, **FAST_HB), Clock(speedup=0.01))
        for w in (engine, gw):
            await w.start()
            await w.start()
        await gw.wait_for_replicas(1, 5)
        client = OServeClient(nc, subjects)
        # the engine runs at 1/100 of wall speed: two requests stay in flight, the third is shed
        slow = [asyncio.ensure_future(client.submit(input_tokens=10, max_tokens=50, timeout_s=0.5)) for _ in range(2)]
        await wait_until(lambda: len(gw.pending) == 2, 5, "two requests in flight")
        with pytest.raises(RequestRejected) as info:
            await client.submit(input_tokens=10, max_tokens=5, timeout_s=5)
        assert info.value.code == ErrorCode.OVERLOADED
        for f in slow:  # past their deadline (the client's timeout, sent with them) the engine stops them
            with pytest.raises(RequestRejected) as info:
                await f
            assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
        for w in (gw, engine):
            await w.stop()
            await w.stop()
            await w.drain()  # after stop: nothing to do
        assert not gw.running and not engine.running
        await nc.close()

    await asyncio.wait_for(main(), 20)


async def _retiring_host(stack: AsyncExitStack, url: str, num: int):
    """An engine host with one replica holding `num` requests in flight, then told to drain it."""
    from oserve.streams.schemas import DrainReplica, ReplicaSpec, StartReplica
    from oserve.workers.engine_host import EngineHost, EngineHostConfig

    subjects = unique_subjects()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    clock = Clock(speedup=5.0)
    host = await stack.enter_async_context(EngineHost(nc, EngineHostConfig(subjects=subjects,
                                                                           heartbeat_interval_wall_s=0.05), clock))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
    await nc.publish(subjects.host_control("local"), encode(StartReplica(
        strategy_id="s", replica=ReplicaSpec(replica_id="h0", tp=1, pp=1, gpu_ids=[0]), ready_after_s=0.0)))
    await gw.wait_for_replicas(1, 5.0)
    client = OServeClient(nc, subjects, default_timeout_s=20.0)
    tasks = [asyncio.create_task(client.submit(input_tokens=200, max_tokens=400, request_id=f"h{i}"))
             for i in range(num)]
    engine = host.engines["h0"]
    await wait_until(lambda: engine.num_inflight == num, 5, "the replica to hold every request")
    await nc.publish(subjects.host_control("local"), encode(DrainReplica(strategy_id="s", replica_id="h0")))
    await wait_until(lambda: "h0" in host._retiring, 5, "the replica to be retiring")
    return host, gw, engine, tasks


async def test_a_host_drain_waits_for_a_retiring_replica(server) -> None:
    num = 8

    async def main() -> None:
        async with AsyncExitStack() as stack:
            host, gw, engine, tasks = await _retiring_host(stack, server.url, num)
            await host.drain()  # Ctrl-C during the retirement: the retiring replica's requests finish
            assert engine.num_inflight == 0
            await host.stop()
            replies = await asyncio.gather(*tasks)
            assert sorted(r.request_id for r in replies) == sorted(f"h{i}" for i in range(num))

    await asyncio.wait_for(main(), 40)


async def test_a_stopped_replica_answers_its_inflight_requests_with_errors(server) -> None:
    num = 8

    async def main() -> None:
        async with AsyncExitStack() as stack:
            host, gw, engine, tasks = await _retiring_host(stack, server.url, num)
            await host.stop()  # no drain: every client still gets an answer, and the gateway forgets them
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert len(results) == num
            for r in results:
                assert isinstance(r, Reply) or (isinstance(r, RequestRejected) and r.code == ErrorCode.SHUTTING_DOWN), r
            assert any(isinstance(r, RequestRejected) for r in results)
            await wait_until(lambda: not gw.pending, 5, "the gateway to release the unanswered requests")

    await asyncio.wait_for(main(), 40)


async def test_requests_waiting_for_a_replica_go_to_one_that_comes_back_with_the_same_id(server) -> None:
    num = 6

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, replica_ids=("r0",), speedup=4.0,
                gateway_kwargs=dict(heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05))
            tasks = [asyncio.create_task(client.submit(input_tokens=200, max_tokens=300, request_id=f"b{i}",
                                                       timeout_s=20)) for i in range(num)]
            await wait_until(lambda: engines[0].num_inflight == num, 5, "the replica to hold every request")
            await engines[0].stop()  # dies; its requests wait for a live replica
            await wait_until(lambda: gw.pending and all(p.replica_id is None for p in gw.pending.values()), 5,
                             "the requests to wait unrouted")
            cfg = EngineWorkerConfig("r0", subjects=subjects, **FAST_HB)
            back = await stack.enter_async_context(EngineWorker(nc, cfg, Clock(speedup=50.0)))
            replies = await asyncio.gather(*tasks)
            assert sorted(r.request_id for r in replies) == sorted(f"b{i}" for i in range(num))
            assert back.num_answered == num
            await wait_until(lambda: not gw.pending, 5, "the gateway to see every completion")

            # unrouted at drain: answered with an error, not left to time out
            tasks = [asyncio.create_task(client.submit(input_tokens=200, max_tokens=3000, request_id=f"c{i}",
                                                       timeout_s=20)) for i in range(num)]
            await wait_until(lambda: back.num_inflight == num, 5, "the replica to hold every request")
            await back.stop()
            await wait_until(lambda: len(gw.pending) == num and all(p.replica_id is None for p in gw.pending.values()),
                             5, "the requests to wait unrouted")
            with pytest.raises(RequestRejected) as retry:  # a client's retry while it waits: told, not ignored
                await client.submit(input_tokens=200, max_tokens=3000, request_id="c0", timeout_s=5)
            assert retry.value.code == ErrorCode.NO_REPLICA
            await gw.drain()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, RequestRejected) and r.code == ErrorCode.NO_REPLICA for r in results), results
            assert not gw.pending

    await asyncio.wait_for(main(), 40)


async def test_an_engine_error_reply_releases_the_gateways_pending_entry(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, replica_ids=("r0",), gateway_kwargs=dict(max_context_tokens=1 << 20))
            got_completed = []

            async def on_completed(msg) -> None:
                got_completed.append(decode(msg.data, Completed))

            await nc.subscribe(subjects.completions(), cb=on_completed)
            with pytest.raises(RequestRejected) as info:  # far more KV than the replica has
                await client.submit(input_tokens=900_000, max_tokens=10, request_id="huge", timeout_s=5)
            assert info.value.code == ErrorCode.INVALID
            await wait_until(lambda: not gw.pending, 5, "the gateway to release the failed request")
            assert any("huge" in c.released and not c.items for c in got_completed)  # no numbers to learn from
            # named with its owner (`owner_of` the gateway and the client's inbox), as the gateway checks
            owners = [o for c in got_completed for r, o in zip(c.released, c.released_owners) if r == "huge"]
            assert owners and all(o.startswith(f"{gw.config.gateway_id} _INBOX") for o in owners)
            assert (await client.submit(input_tokens=10, max_tokens=2, timeout_s=5)).replica_id == "r0"

    await asyncio.wait_for(main(), 30)


class _FailingForwards:
    """The gateway's connection, except that forwarding to a replica fails (a fault injected in the test)."""

    def __init__(self, nc, replica_subject_prefix: str) -> None:
        self._nc, self._prefix = nc, replica_subject_prefix

    def __getattr__(self, name):
        return getattr(self._nc, name)

    async def publish(self, subject, *args, **kwargs):
        if subject.startswith(self._prefix):
            raise ConnectionError("injected: forward failed")
        return await self._nc.publish(subject, *args, **kwargs)


async def test_a_failed_forward_is_answered_and_never_owned(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))
            gw.nc = _FailingForwards(nc, subjects.replica("r0"))
            with pytest.raises(RequestRejected) as info:
                await client.submit(input_tokens=10, max_tokens=2, request_id="f1", timeout_s=5)
            assert info.value.code == ErrorCode.INTERNAL
            assert "f1" not in gw.pending and gw.num_accepted == 0  # nothing left to re-dispatch later
            gw.nc = nc
            assert (await client.submit(input_tokens=10, max_tokens=2, request_id="f1", timeout_s=5)).request_id == "f1"

    await asyncio.wait_for(main(), 30)


async def test_heartbeats_with_bad_replica_ids_are_refused_and_liveness_keeps_running(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, replica_ids=("r0",),
                gateway_kwargs=dict(heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05))
            for bad in ("", "a.b", "a b", "a*"):
                raw = json.dumps({"type": "heartbeat.v1", "replica_id": bad, "at_s": 0.0, "num_waiting": 0,
                                  "num_running": 0}).encode()
                await nc.publish(subjects.heartbeat("x"), raw)
            await wait_until(lambda: gw.num_errors >= 4, 5, "the bad heartbeats to be refused")
            await asyncio.sleep(0.5)  # several liveness ticks with the bad heartbeats seen
            assert gw.running and gw.failure is None and gw.live_replicas == ["r0"]
            assert (await client.submit(input_tokens=10, max_tokens=2, timeout_s=5)).replica_id == "r0"

    await asyncio.wait_for(main(), 30)


async def test_a_worker_whose_background_loop_fails_stops_loudly(server, caplog) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))

            async def broken() -> None:
                raise RuntimeError("injected: the arrivals loop breaks")

            gw._flush_arrivals = broken
            await wait_until(lambda: not gw.running, 5, "the gateway to stop itself")
            assert isinstance(gw.failure, RuntimeError)
            with pytest.raises(NoGateway):  # it no longer accepts requests it could not own
                await client.submit(input_tokens=10, max_tokens=2, timeout_s=2)

    await asyncio.wait_for(main(), 30)
    assert "background loop failed" in caplog.text


async def test_a_replica_drained_while_it_starts_never_serves(server) -> None:
    from oserve.streams.schemas import DrainReplica, ReplicaDrained, ReplicaReady, ReplicaSpec, StartReplica
    from oserve.workers.engine_host import EngineHost, EngineHostConfig

    async def main() -> None:
        async with AsyncExitStack() as stack:
            subjects = unique_subjects()
            nc = await nats.connect(server.url)
            stack.push_async_callback(nc.close)
            host = await stack.enter_async_context(EngineHost(nc, EngineHostConfig(subjects=subjects),
                                                              Clock(speedup=10.0)))
            events = []

            async def on_replica(msg) -> None:
                events.append(decode(msg.data, ReplicaReady | ReplicaDrained))

            await nc.subscribe(subjects.plan_event("replica"), cb=on_replica)
            await nc.publish(subjects.host_control("local"), encode(StartReplica(
                strategy_id="s", replica=ReplicaSpec(replica_id="h1", tp=1, pp=1, gpu_ids=[0]), ready_after_s=5.0)))
            await wait_until(lambda: "h1" in host._starting, 5, "the replica to be starting")
            await nc.publish(subjects.host_control("local"), encode(DrainReplica(strategy_id="s", replica_id="h1")))
            await wait_until(lambda: any(isinstance(e, ReplicaDrained) for e in events), 5, "the drain to be reported")
            await wait_until(lambda: "h1" not in host._starting, 5, "the modelled weight transfer to end")
            await nc.flush()
            assert "h1" not in host.engines and not any(isinstance(e, ReplicaReady) for e in events)

    await asyncio.wait_for(main(), 30)


async def test_a_request_id_reused_by_another_client_never_gets_the_first_ones_answer(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client_a = await start_system(stack, server.url, replica_ids=("r0",),
                                                                     speedup=5.0)
            client_b = await OServeClient.connect(server.url, subjects=subjects)  # another connection, another inbox
            stack.push_async_callback(client_b.close)
            a = asyncio.create_task(client_a.submit(input_tokens=100, max_tokens=200, request_id="same", timeout_s=10))
            await wait_until(lambda: "same" in gw.pending, 5, "A's request to be in flight")
            with pytest.raises(RequestRejected) as info:  # in flight for A: B is told, not given A's answer
                await client_b.submit(input_tokens=7, max_tokens=3, request_id="same", timeout_s=5)
            assert info.value.code == ErrorCode.INVALID
            ra = await a
            assert (ra.input_tokens, ra.output_tokens) == (100, 200)
            await wait_until(lambda: not gw.pending, 5, "the gateway to see A's completion")
            rb = await client_b.submit(input_tokens=7, max_tokens=3, request_id="same", timeout_s=5)
            assert (rb.input_tokens, rb.output_tokens) == (7, 3)  # served for B, not A's stored reply
            await wait_until(lambda: not gw.pending, 5, "the gateway to see B's completion")
            again = await client_a.submit(input_tokens=100, max_tokens=200, request_id="same", timeout_s=5)
            assert again == ra  # A's own retry still gets its stored answer
            assert engines[0].num_answered == 2

    await asyncio.wait_for(main(), 30)


async def test_replay_runs_use_unique_request_ids(server) -> None:
    from oserve.workers.system import replay
    from oserve.traces import Request, Trace

    trace = Trace.from_requests([Request(f"x{i}", 0.01 * i, 20 + i, 2) for i in range(3)], name="tiny")

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))
            seen: list[str] = []

            async def on_dispatch(msg) -> None:
                seen.append(decode(msg.data, Dispatch).request_id)

            await nc.subscribe(subjects.replica("r0"), cb=on_dispatch)
            for _ in range(2):  # the same client and trace twice: the second run is served, not replayed from cache
                result = await replay(client, trace, 50.0, timeout_s=10)
                assert result["answered"] == len(trace)
            await nc.flush()
            assert len(set(seen)) == 2 * len(trace)
            assert engines[0].num_answered == 2 * len(trace) and engines[0].num_duplicates == 0

    await asyncio.wait_for(main(), 30)


async def test_the_gateway_learns_from_completions_with_what_it_classed_by(server) -> None:
    """The live estimator learns each completion with its client tag and max tokens, as the simulator's
    gateway does: two clients with one prompt length and very different answers are told apart."""
    from oserve.online_types import OnlineTypes
    from oserve.traces import load_trace
    from oserve.workload_types import fit_types

    history = load_trace("azure-conv").slice_time(0.0, 300.0)
    estimator = OnlineTypes(fit_types(history.input_tokens, history.output_tokens), grace_period=50)
    before = {t: estimator.estimate_output_one(500, tag=t) for t in ("clientA", "clientB")}

    async def main() -> dict:
        async with AsyncExitStack() as stack:
            subjects = unique_subjects()
            nc = await nats.connect(server.url)
            stack.push_async_callback(nc.close)
            clock = Clock(speedup=50.0)
            await stack.enter_async_context(EngineWorker(
                nc, EngineWorkerConfig("r0", subjects=subjects, backend="echo", **FAST_HB), clock))
            gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock,
                                                         estimator=estimator))
            await gw.wait_for_replicas(1, 5.0)
            client = OServeClient(nc, subjects, default_timeout_s=10.0)
            await asyncio.gather(*(client.submit(input_tokens=500, max_tokens=1000, request_id=f"t{i}",
                                                 tags={"client": "clientA" if i % 2 else "clientB"},
                                                 sim_output_tokens=8 if i % 2 else 800) for i in range(600)))
            await wait_until(lambda: not gw.pending, 10, "every completion")
            return {t: gw.estimator.estimate_output_one(500, tag=t, max_tokens=1000) for t in ("clientA", "clientB")}

    after = await asyncio.wait_for(main(), 60)
    assert before["clientA"] == before["clientB"]  # nothing learned of either client yet
    assert after["clientB"] > 10 * after["clientA"], after


async def test_the_gateway_learns_by_at_most_max_client_tags_tags(server) -> None:
    """A client minting a new tag per request cannot grow the estimator: tags past the cap are untagged."""
    async def main() -> list:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, _, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                             gateway_kwargs={"max_client_tags": 3})
            for i in range(6):
                await client.submit(input_tokens=50, max_tokens=5, request_id=f"m{i}", tags={"client": f"c{i}"})
            return [gw._known_tag(f"c{i}") for i in range(7)]

    tags = await asyncio.wait_for(main(), 30)
    assert tags[:3] == ["c0", "c1", "c2"] and tags[3:] == [None] * 4


def test_the_dedupe_cache_is_bounded_by_bytes_as_well_as_answers() -> None:
    """Replies carry their text now: the cache drops its oldest answers once they pass dedupe_max_bytes."""
    from oserve.errors import ConfigError

    engine = EngineWorker(None, EngineWorkerConfig("r0", dedupe_capacity=100, dedupe_max_bytes=1000), Clock())
    for i in range(10):
        engine._remember(f"inbox q{i}", b"x" * 300)
    assert list(engine._answered) == ["inbox q7", "inbox q8", "inbox q9"] and engine._answered_bytes == 900
    engine._remember("inbox q8", b"y" * 50)  # the same key again replaces, never double-counts
    assert engine._answered_bytes == 650 and len(engine._answered) == 3
    with pytest.raises(ConfigError):
        EngineWorkerConfig("r0", dedupe_max_bytes=0)


async def test_a_stream_keeps_streaming_after_its_replica_dies(server) -> None:
    """The gateway re-dispatches a stream whose replica died; the survivor's chunks start elsewhere than the
    dead one's stopped, and the client splices them on (`offset_chars`) instead of waiting for the Reply."""
    from contextlib import aclosing

    from oserve.streams.schemas import ReplyChunk

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, speedup=4.0, gateway_kwargs=dict(heartbeat_timeout_wall_s=0.4,
                                                                   liveness_check_wall_s=0.05),
                engine_kwargs=dict(stream_interval_s=0.03))
            by_id = {e.config.replica_id: e for e in engines}
            parts: list = []
            async with aclosing(client.stream(input_tokens=200, max_tokens=600, request_id="s1", timeout_s=30)) as it:
                async for part in it:
                    parts.append(part)
                    if len(parts) == 4 and isinstance(part, ReplyChunk):
                        dead = part.replica_id
                        await by_id[dead].stop()  # dies mid-stream: no reply, no heartbeats
            *chunks, reply = parts
            assert isinstance(reply, Reply) and reply.replica_id != dead and reply.output_tokens == 600
            assert "".join(c.text for c in chunks) == reply.text
            offsets = [(c.offset_tokens, c.num_tokens) for c in chunks]
            assert all(a + n == b for (a, n), (b, _) in zip(offsets, offsets[1:]))  # contiguous, no repeats
            survivors = [c for c in chunks if c.replica_id == reply.replica_id and c.index >= 0]
            assert len(survivors) >= 2, "nothing streamed after the re-dispatch until the final reply"
            assert gw.num_redispatched == 1

    await asyncio.wait_for(main(), 40)


async def test_a_cancel_only_works_for_the_client_that_sent_the_request(server) -> None:
    from oserve.streams.schemas import CancelRequest

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0)
            other = await nats.connect(server.url)
            stack.push_async_callback(other.close)
            task = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="mine",
                                                     timeout_s=20))
            await wait_until(lambda: "mine" in gw.pending, 5, "the request to be in flight")
            # another connection names the request but not its inbox (it cannot know its random token)
            forged = CancelRequest(request_id="mine", inbox=other.new_inbox() + ".0")
            await other.publish(subjects.cancel(), encode(forged))
            await other.flush()
            await wait_until(lambda: gw.num_cancels_ignored == 1, 5, "the gateway to refuse the cancel")
            # an inbox without a dot has an empty prefix: it must match nothing, not every dotless reply
            await other.publish(subjects.cancel(), encode(CancelRequest(request_id="mine", inbox="x")))
            await other.flush()
            await wait_until(lambda: gw.num_cancels_ignored == 2, 5, "the gateway to refuse the dotless cancel")
            reply = await task
            assert reply.output_tokens == 200 and engines[0].num_cancelled == 0

    await asyncio.wait_for(main(), 30)


async def test_a_submit_and_a_stream_of_one_client_share_a_request(server) -> None:
    """Both come to inboxes under the client's one prefix: a submit of a request id being streamed is the same
    client's retry (answered with the one answer), not another client's id."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0)
            parts: list = []

            async def stream() -> None:
                async for part in client.stream(input_tokens=100, max_tokens=150, request_id="both", timeout_s=20):
                    parts.append(part)

            task = asyncio.create_task(stream())
            await wait_until(lambda: "both" in gw.pending, 5, "the stream to be in flight")
            reply = await client.submit(input_tokens=100, max_tokens=150, request_id="both", timeout_s=20)
            await task
            assert parts[-1] == reply and engines[0].num_answered == 1

    await asyncio.wait_for(main(), 30)


async def test_a_timed_out_submit_is_cancelled(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=1.0)
            # the client's timeout travels with the request (`SubmitRequest.timeout_s`): the engine stops it
            # at its deadline and answers `deadline_exceeded`
            with pytest.raises(RequestRejected) as info:
                await client.submit(input_tokens=100, max_tokens=3000, request_id="late", timeout_s=0.5)
            assert info.value.code == ErrorCode.DEADLINE_EXCEEDED and engines[0].num_expired == 1
            await wait_until(lambda: not gw.pending and engines[0].num_inflight == 0, 5, "the release")
            # a request that gives no timeout of its own: the client's timeout cancels it
            with pytest.raises(RequestTimeout):
                await client.submit_raw(encode(SubmitRequest(request_id="slow", input_tokens=100, max_tokens=3000)),
                                        "slow", timeout_s=0.5)
            await wait_until(lambda: not gw.pending and engines[0].num_inflight == 0, 5,
                             "the cancel to reach the gateway and the engine")
            assert gw.num_cancelled == 1 and engines[0].num_cancelled == 1
            assert engines[0].backend.replica.num_requests == 0  # type: ignore[attr-defined]
            # the id is not spent: sent again, it is served anew
            again = await client.submit(input_tokens=100, max_tokens=5, request_id="slow", timeout_s=10)
            assert again.output_tokens == 5

    await asyncio.wait_for(main(), 30)


async def test_an_id_sent_again_stays_owned_after_a_cancel_and_is_released_after_a_cached_answer(server) -> None:
    """Two races of the gateway's ownership: a cancelled request's release must not make the gateway forget
    the same id sent again right after; an id answered from the engine's cache must not stay owned forever."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=1.0)
            with pytest.raises(RequestTimeout):  # no timeout of its own: the client's timeout cancels it
                await client.submit_raw(encode(SubmitRequest(request_id="slow", input_tokens=100, max_tokens=3000)),
                                        "slow", timeout_s=0.3)
            again = asyncio.create_task(client.submit(input_tokens=100, max_tokens=3000, request_id="slow",
                                                      timeout_s=20))
            await wait_until(lambda: engines[0].num_cancelled == 1 and engines[0].num_inflight == 1, 5,
                             "the cancel to land and the id sent again to be served")
            await asyncio.sleep(0.2)  # ten completion flushes: a release of the cancelled one would be here
            assert "slow" in gw.pending  # still owned: re-dispatched if its replica died
            again.cancel()
            with pytest.raises(asyncio.CancelledError):
                await again
            # answered once, then sent again: the engine answers from its cache and releases the new entry
            first = await client.submit(input_tokens=10, max_tokens=3, request_id="done1", timeout_s=10)
            second = await client.submit(input_tokens=10, max_tokens=3, request_id="done1", timeout_s=10)
            assert second == first and engines[0].num_duplicates >= 1
            await wait_until(lambda: "done1" not in gw.pending, 5, "the cached answer's release")

    await asyncio.wait_for(main(), 40)


async def test_a_cancel_read_before_its_submit_still_cancels_it(server) -> None:
    """Each subscription's callbacks run in their own task: under a backlog a cancel can be read first."""
    from oserve.streams.schemas import CancelRequest

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(subjects.cancel(), encode(CancelRequest(request_id="early", inbox=inbox)))
            await wait_until(lambda: len(gw._early_cancels) == 1, 5, "the gateway to keep the early cancel")
            await nc.publish(subjects.submit(), encode(SubmitRequest(request_id="early", input_tokens=10,
                                                                     max_tokens=5)), reply=inbox)
            answer = decode_reply((await sub.next_msg(timeout=5)).data)
            assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.CANCELLED
            assert engines[0].num_received == 0 and "early" not in gw.pending
            # the same id from another inbox (a resend) is served
            assert (await client.submit(input_tokens=10, max_tokens=5, request_id="early", timeout_s=10)).output_tokens == 5

    await asyncio.wait_for(main(), 30)


async def test_another_gateways_completion_of_the_same_request_id_leaves_ours_alone(server) -> None:
    """Several gateways share the completions subject, and two clients may choose one request id: an entry of
    `Completed` names its owner (gateway and client), so a gateway clears, re-dispatches or migrates only its own."""
    from oserve.streams.schemas import Completion, Migration, Resume
    from oserve.streams.subjects import owner_of

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0)
            seen: list[Completed] = []

            async def on_completed(msg) -> None:
                seen.append(decode(msg.data, Completed))
            await nc.subscribe(subjects.completions(), cb=on_completed)
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="same", timeout_s=10))
            await wait_until(lambda: "same" in gw.pending, 5, "the request to be in flight")
            mine = gw.pending["same"]
            theirs = owner_of("gateway-other", mine.reply)  # same client, another gateway
            stranger = owner_of(gw.config.gateway_id, "_INBOX_x.someone.1")  # this gateway, another client
            for owner in (theirs, stranger):
                await nc.publish(subjects.completions(), encode(Completed(
                    replica_id="r0", items=[Completion(request_id="same", replica_id="r0", input_tokens=7,
                                                       output_tokens=3, type_index=0, ttft_s=0.1, e2e_s=0.2,
                                                       finished_at_s=1.0, owner=owner)],
                    released=["same"], released_owners=[owner], requeue=["same"], requeue_owners=[owner],
                    migrated=[Migration(request_id="same", owner=owner, resume=Resume(
                        num_tokens=1, token_ids=[5], text="", sent_tokens=0, sent_chars=0, from_replica="r0"))])))
            await nc.flush()
            await asyncio.sleep(0.2)
            assert gw.pending.get("same") is mine and mine.replica_id == "r0"  # not cleared, moved or sent again
            assert gw.num_requeued == 0 and gw.num_migrated == 0 and gw.num_redispatched == 0
            ra = await a  # its own completion clears it
            assert (ra.input_tokens, ra.output_tokens) == (100, 200)
            await wait_until(lambda: not gw.pending, 5, "the gateway to see its own completion")
            own = [i for c in seen for i in c.items if i.request_id == "same" and i.replica_id == "r0"
                   and i.output_tokens == 200]
            assert [i.owner for i in own] == [owner_of(gw.config.gateway_id, mine.reply)]

    await asyncio.wait_for(main(), 30)


async def test_a_replica_that_fences_often_delays_a_request_but_does_not_fail_it(server) -> None:
    """A fenced replica hands back what it holds (`Completed.requeue`): its host stalled, the request did no
    harm. Hand-backs are not failed attempts, so a request handed back more often than `max_attempts` is
    still dispatched again and answered (once a vLLM replica on a loaded two-core host fenced three times
    and its request was answered `no_replica`)."""
    from oserve.streams.subjects import owner_of

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0)
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="fenced",
                                                  timeout_s=20))
            await wait_until(lambda: "fenced" in gw.pending, 5, "the request to be in flight")
            mine = gw.pending["fenced"]
            owner = owner_of(gw.config.gateway_id, mine.reply)
            handed_back = gw.config.max_attempts + 2
            for n in range(handed_back):
                await nc.publish(subjects.completions(), encode(Completed(
                    replica_id="r0", items=[], requeue=["fenced"], requeue_owners=[owner])))
                await nc.flush()
                await wait_until(lambda: gw.num_requeued == n + 1, 5, "the hand-back to be seen")
            assert gw.num_failed == 0 and gw.pending["fenced"].dispatch.attempt == 0
            assert gw.num_redispatched == handed_back
            ra = await a
            assert (ra.input_tokens, ra.output_tokens) == (100, 200)

    await asyncio.wait_for(main(), 30)


async def test_a_handed_back_request_goes_to_another_replica_when_one_accepts(server) -> None:
    """A hand-back comes from a replica that stalled: the request is dispatched to another replica, even one
    the plan does not give its class, and back to the stalled one only when it is the only one accepting."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0,
                                                                   gateway_kwargs={"surplus_window_s": 1e9})
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=[{"r0": 1e6, "r1": 0.0}])))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="stalled",
                                                  timeout_s=20))
            await wait_until(lambda: "stalled" in gw.pending, 5, "the request to be in flight")
            assert gw.pending["stalled"].replica_id == "r0"
            await wait_until(lambda: engines[0]._inflight, 5, "r0 to hold the request")
            await engines[0]._fence()  # what it does after a stall: drop it unanswered and hand it back
            await wait_until(lambda: gw.num_requeued == 1, 5, "the hand-back to be seen")
            assert gw.pending["stalled"].replica_id == "r1" and gw.pending["stalled"].dispatch.attempt == 0
            ra = await a
            assert ra.replica_id == "r1" and ra.output_tokens == 200

    await asyncio.wait_for(main(), 30)


async def test_a_copy_of_a_handed_back_request_that_reaches_the_fenced_replica_late_is_not_served_again(
        server) -> None:
    """A replica fences itself and hands a request back; a copy of its old dispatch (a client's retry its gateway
    forwarded before it heard of the hand-back) reaches the replica afterwards. The gateway's own dispatch after
    the hand-back answers it; the fenced replica drops the copy, so the client gets one answer, not two."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0,
                                                                   gateway_kwargs={"surplus_window_s": 1e9})
            finals: Counter = Counter()

            async def on_answer(msg) -> None:
                if isinstance(decode_reply(msg.data), Reply):
                    finals[decode_reply(msg.data).request_id] += 1
            await nc.subscribe("_INBOX.>", cb=on_answer)
            sent: list = []  # the dispatches r0 received, as they went on the wire

            async def on_dispatch(msg) -> None:
                sent.append((msg.data, msg.reply))
            await nc.subscribe(subjects.replica("r0"), cb=on_dispatch)
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=[{"r0": 1e6, "r1": 0.0}])))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="late",
                                                  timeout_s=20))
            await wait_until(lambda: engines[0]._inflight and sent, 5, "r0 to hold the request")
            await engines[0]._fence()
            await wait_until(lambda: gw.num_requeued == 1, 5, "the hand-back to be seen")
            data, reply = sent[0]
            await nc.publish(subjects.replica("r0"), data, reply=reply)  # the late copy
            ra = await a
            await asyncio.sleep(0.5)  # a second answer, were there one, would have come by now
            assert ra.replica_id == "r1" and finals == {"late": 1}
            assert engines[0].num_stale_handed == 1 and not engines[0]._inflight

    await asyncio.wait_for(main(), 30)


async def test_a_handed_back_request_dispatched_again_to_its_only_replica_is_served_there_once(server) -> None:
    """The fenced replica is the only one: the gateway's dispatch after the hand-back is served there (it
    carries a later `dispatch_no`), while a late copy of the dispatch it handed back is dropped."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0)
            finals: Counter = Counter()

            async def on_answer(msg) -> None:
                if isinstance(decode_reply(msg.data), Reply):
                    finals[decode_reply(msg.data).request_id] += 1
            await nc.subscribe("_INBOX.>", cb=on_answer)
            sent: list = []

            async def on_dispatch(msg) -> None:
                sent.append((msg.data, msg.reply))
            await nc.subscribe(subjects.replica("r0"), cb=on_dispatch)
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="only",
                                                  timeout_s=20))
            await wait_until(lambda: engines[0]._inflight and sent, 5, "r0 to hold the request")
            await engines[0]._fence()
            await wait_until(lambda: len(sent) == 2, 5, "the gateway to dispatch it to r0 again")
            first, again = (decode(d, Dispatch) for d, _ in sent)
            assert (first.dispatch_no, again.dispatch_no) == (0, 1) and first.attempt == again.attempt == 0
            await nc.publish(subjects.replica("r0"), sent[0][0], reply=sent[0][1])  # a late copy of the first
            ra = await a
            await asyncio.sleep(0.5)
            assert ra.replica_id == "r0" and ra.output_tokens == 200 and finals == {"only": 1}
            # the copy came while the dispatch after the hand-back ran (a duplicate of it) or after (stale)
            assert engines[0].num_stale_handed + engines[0].num_duplicates == 1

    await asyncio.wait_for(main(), 30)


def test_a_gateway_counts_its_arrivals_against_its_share_of_the_plan() -> None:
    """With two gateways behind a balancer, each sees half the arrivals: at `plan_share` 0.5 a class is
    beyond its plan once this gateway's count passes 1.5x half the plan's rate (plus the slack)."""
    from oserve.errors import ConfigError

    clock = Clock()
    whole, half = (Gateway(None, GatewayConfig(plan_share=share), clock) for share in (1.0, 0.5))
    for gw in (whole, half):
        gw._weights = [{"r0": 6.0, "r1": 4.0}]  # the class planned at 10 requests/s over the cluster
        gw._window_start_s = clock.now_s() - 10.0  # 10 s into the window
        gw._window_counts = {0: 100}  # at 10/s: the whole cluster's count, or twice this half's
    assert not whole._beyond_plan(0) and half._beyond_plan(0)  # 100 > 1.5 * 5 * 10 + 10 = 85; not > 160
    with pytest.raises(ConfigError):
        GatewayConfig(plan_share=0.0)


async def test_a_hand_back_held_for_want_of_a_replica_is_still_no_failed_attempt(server) -> None:
    """A replica hands a request back while the gateway sees no replica accepting: the request is held, and
    when a replica accepts again it is dispatched as a hand-back still (`_Pending.free_retry`), not as a
    failed attempt."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            # heartbeats 1 s apart: none comes between marking r0 draining and its fence's own heartbeat
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",),
                                                                   speedup=5.0,
                                                                   engine_kwargs={"heartbeat_interval_wall_s": 1.0})
            a = asyncio.create_task(client.submit(input_tokens=100, max_tokens=200, request_id="held",
                                                  timeout_s=20))
            await wait_until(lambda: engines[0]._inflight, 5, "r0 to hold the request")
            held = []
            route = gw._route

            def watched(type_index, avoid=None):
                target = route(type_index, avoid)
                held.append(target)
                return target
            gw._route = watched
            gw._replicas["r0"].accepting = False  # as a draining heartbeat leaves it: no replica accepts
            gw._refresh_eligible()
            await engines[0]._fence()  # hands the request back, then announces itself accepting again
            await wait_until(lambda: held and held[-1] == "r0", 5, "the request to be dispatched again")
            assert held[0] is None  # held first, then dispatched when r0 accepted again
            assert gw.pending["held"].dispatch.attempt == 0 and not gw.pending["held"].free_retry
            ra = await a
            assert gw.num_requeued == 1 and gw.num_failed == 0 and ra.output_tokens == 200

    await asyncio.wait_for(main(), 30)


async def test_a_dispatch_that_names_no_gateway_to_ask_finishes_where_it_is(server) -> None:
    """A request past its `move_after_tokens` whose dispatch names a gateway id that is no subject token (or none)
    cannot be asked about: it finishes on its replica with every token, and the engine goes on serving."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0",))
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            for gateway_id in ("a.b", ""):
                await nc.publish(subjects.replica("r0"), encode(Dispatch(
                    request_id=f"odd{len(gateway_id)}", input_tokens=100, max_tokens=50, sim_output_tokens=50,
                    type_index=0, gateway_id=gateway_id, move_after_tokens=1)), reply=inbox)
                reply = decode((await sub.next_msg(timeout=10)).data, Reply)
                assert isinstance(reply, Reply) and reply.output_tokens == 50
            assert engines[0].num_move_asks == 0 and engines[0].num_moved_outgrown == 0
            assert isinstance(await client.submit(input_tokens=20, max_tokens=5), Reply)  # still serving

    await asyncio.wait_for(main(), 30)


@pytest.mark.parametrize("move, room", [(True, True), (False, True), (True, False)])
async def test_a_request_that_outgrows_its_class_is_continued_on_a_replica_of_the_class_it_grew_into(server, move,
                                                                                                     room):
    """Two classes of one prompt length, short answers on r0 and long ones on r1. Requests the gateway classes
    short (their hint says 40 tokens) that answer 1,200 pass the class boundary on r0, which asks the gateway
    (`MoveAsk`); told to move, r0 hands them back and they finish on r1 with every token, once
    (`Dispatch.move_after_tokens`); short answers stay on r0. With `move_outgrown` off they all finish on r0.
    When r1 has no room for them (`move_room_frac` leaves none) the gateway says stay, each time r0 asks again,
    and they finish on r0 too: a request is never moved onto a full replica."""
    import numpy as np

    from oserve.online_types import OnlineTypes
    from oserve.workload_types import fit_types

    types = fit_types(np.array([500] * 40 + [520] * 40), np.array([40] * 40 + [1200] * 40), k=2)
    short = int(np.argmin(np.array(types.centroids_log)[:, 1]))
    weights = [{"r0": 1e6, "r1": 0.0}, {"r0": 0.0, "r1": 1e6}]
    if short == 1:
        weights.reverse()

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(
                stack, server.url, estimator=OnlineTypes(types),
                gateway_kwargs={"surplus_window_s": 1e9, "move_outgrown": move,
                                "move_room_frac": 1.0 if room else 1e-9})
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=weights)))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            long_ = [client.submit(input_tokens=500, max_tokens=1500, output_hint_tokens=40, sim_output_tokens=1200,
                                   request_id=f"long{i}", timeout_s=20) for i in range(6)]
            short_ = [client.submit(input_tokens=500, max_tokens=1500, output_hint_tokens=40, sim_output_tokens=40,
                                    request_id=f"short{i}", timeout_s=20) for i in range(6)]
            replies = await asyncio.gather(*long_, *short_)
            assert all(isinstance(r, Reply) for r in replies)
            assert [r.output_tokens for r in replies] == [1200] * 6 + [40] * 6
            assert {r.replica_id for r in replies[6:]} == {"r0"}
            if move and room:
                assert {r.replica_id for r in replies[:6]} == {"r1"}
                assert engines[0].num_moved_outgrown == 6 and gw.num_moved_outgrown == 6
                # one ask each, unless one was asked again before its answer came: answered go again, not stay
                assert engines[0].num_move_asks >= 6 and gw.num_move_asks >= 6 and gw.num_move_stays == 0
            else:
                assert {r.replica_id for r in replies[:6]} == {"r0"}
                assert engines[0].num_moved_outgrown == 0 and gw.num_moved_outgrown == 0
            if move and not room:  # asked, told to stay, asked again a clock second later while they ran
                assert engines[0].num_move_asks > 6 and gw.num_move_stays == gw.num_move_asks > 6
            if not move:
                assert engines[0].num_move_asks == 0 and gw.num_move_asks == 0
            await wait_until(lambda: not gw.pending, 5, "every completion")

    await asyncio.wait_for(main(), 60)
