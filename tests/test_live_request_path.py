"""The request path against a real nats-server: client -> gateway -> engine (sim backend) -> client."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from contextlib import AsyncExitStack

import nats
import pytest

from oserve.client import NoGateway, OServeClient, RequestRejected, RequestTimeout
from oserve.streams.schemas import (AssignmentSet, Dispatch, ErrorCode, ErrorReply, Reply, SubmitRequest, decode,
                                    decode_reply, encode)
from oserve.streams.testing import running_server, unique_subjects
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig

FAST_HB = dict(heartbeat_interval_wall_s=0.05)


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Wait for a condition the system reaches on its own (bounded; fails with `what`)."""
    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(loop(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def start_system(stack: AsyncExitStack, url: str, replica_ids=("r0", "r1"), speedup: float = 50.0,
                       gateway_kwargs=None, engine_kwargs=None):
    subjects = unique_subjects()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    clock = Clock(speedup=speedup)
    engines = []
    for rid in replica_ids:
        cfg = EngineWorkerConfig(rid, subjects=subjects, **{**FAST_HB, **(engine_kwargs or {})})
        engines.append(await stack.enter_async_context(EngineWorker(nc, cfg, clock)))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects, **(gateway_kwargs or {})),
                                                 clock))
    await gw.wait_for_replicas(len(replica_ids), 5.0)
    return nc, subjects, gw, engines, OServeClient(nc, subjects, default_timeout_s=10.0)


def test_every_request_is_answered_exactly_once(server) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 40))


def test_bad_inputs_get_error_replies_and_the_system_keeps_serving(server) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 40))


def test_client_errors_are_clear(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            subjects = unique_subjects()
            client = await OServeClient.connect(server.url, subjects=subjects)
            stack.push_async_callback(client.close)
            with pytest.raises(NoGateway):
                await client.submit(input_tokens=5, timeout_s=2)
            # a gateway with no replica answers no_replica; a request nobody answers times out
            nc = client.nc
            gw = Gateway(nc, GatewayConfig(subjects=subjects), Clock())
            await stack.enter_async_context(gw)
            with pytest.raises(RequestRejected) as info:
                await client.submit(input_tokens=5, timeout_s=2)
            assert info.value.code == ErrorCode.NO_REPLICA
            await nc.subscribe(subjects.replica("mute"), cb=_ignore)
            await nc.publish(subjects.heartbeat("mute"), encode(_heartbeat("mute")))
            await gw.wait_for_replicas(1, 5)
            with pytest.raises(RequestTimeout):
                await client.submit(input_tokens=5, timeout_s=0.3)
            assert (await client.ping()).num_replicas == 1

    asyncio.run(asyncio.wait_for(main(), 30))


async def _ignore(msg) -> None:
    return None


def _heartbeat(replica_id: str):
    from oserve.streams.schemas import Heartbeat
    return Heartbeat(replica_id=replica_id, at_s=0.0, num_waiting=0, num_running=0)


def test_engine_deduplicates_by_request_id(server) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_dead_replicas_requests_are_redispatched(server) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 40))


def test_router_follows_the_published_assignment(server) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, engines, client = await start_system(stack, server.url)
            await nc.publish(subjects.plan_event("assignment"),
                             encode(AssignmentSet(strategy_id="s1", weights=[{"r0": 0.0, "r1": 1.0}])))
            await wait_until(lambda: gw.strategy_id == "s1", 5, "the assignment")
            replies = await asyncio.gather(*[client.submit(input_tokens=30, max_tokens=3, timeout_s=10)
                                             for _ in range(20)])
            assert {r.replica_id for r in replies} == {"r1"}

    asyncio.run(asyncio.wait_for(main(), 30))


def test_engines_publish_heartbeats_and_telemetry(server) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 20))


def test_worker_lifecycle_is_idempotent_and_the_gateway_sheds_load(server) -> None:
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
        for f in slow:
            with pytest.raises(RequestTimeout):
                await f
        for w in (gw, engine):
            await w.stop()
            await w.stop()
            await w.drain()  # after stop: nothing to do
        assert not gw.running and not engine.running
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 20))
