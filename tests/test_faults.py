"""Faults and hostile input against a real nats-server: each case is a finding of the adversarial test of
issue 14, kept as a regression test (nothing lost, nothing answered twice, no subject but an inbox replied to).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from contextlib import AsyncExitStack

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.streams.client import OServeClient, RequestRejected
from oserve.streams.schemas import (COPY_HEADER, UNACCEPTED_COPY, Accepted, Completed, Dispatch, ErrorCode, ErrorReply,
                                    Reply, ReplicaSpec, ReplyChunk, StrategyChosen, SubmitRequest, decode, decode_reply,
                                    decode_submit, encode, request_id_of)
from oserve.streams.subjects import dedupe_key, reply_error
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.workers.clock import Clock
from oserve.workers.engine_host import EngineHost, EngineHostConfig
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker

from conftest import start_system as _start_system  # noqa: E402
_ids = itertools.count()


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def start_system(stack: AsyncExitStack, url: str, replica_ids=("r0",), **kwargs):
    """`conftest.start_system` with one replica unless told."""
    return await _start_system(stack, url, replica_ids, **kwargs)


class Tap:
    """Every message on a set of subjects, by subject (a wildcard subscription on its own connection)."""

    def __init__(self) -> None:
        self.msgs: list = []

    async def on(self, msg) -> None:
        self.msgs.append(msg)

    def on_subject(self, prefix: str) -> list:
        return [m for m in self.msgs if m.subject.startswith(prefix)]


def submit(request_id: str, **kw) -> bytes:
    return encode(SubmitRequest(request_id=request_id, **{"input_tokens": 20, "max_tokens": 8, **kw}))


# --- pure parts -------------------------------------------------------------------------------------


def test_deep_json_is_refused_as_malformed_with_its_request_id() -> None:
    deep = b'{"type":"submit.v1","request_id":"deep","input_tokens":1,"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(Exception) as info:
        decode_submit(deep)
    assert getattr(info.value, "code", None) == ErrorCode.BAD_JSON
    assert request_id_of(b'{"type":"submit.v9","request_id":"abc","max_tokens":-3}') == "abc"
    assert request_id_of(b"not json") == "" and request_id_of(deep) == ""


def test_single_token_inboxes_are_each_their_own_client() -> None:
    assert dedupe_key("_INBOX.aaa", "1") != dedupe_key("_INBOX.bbb", "1")
    assert dedupe_key("_INBOX_oserve.alice.N1.3", "1") == dedupe_key("_INBOX_oserve.alice.N1.7", "1")
    assert dedupe_key("_INBOX_oserve.alice.N1.3", "1") != dedupe_key("_INBOX_oserve.alice.N2.3", "1")
    assert dedupe_key("_INBOX.N1.t1", "1") == dedupe_key("_INBOX.N1.t2", "1")


@given(st.text(max_size=80))
def test_a_reply_is_accepted_only_when_it_is_an_inbox(reply: str) -> None:
    roots = ("_INBOX_t", "_INBOX")
    if reply_error(reply, roots) is None:
        root, _, rest = reply.partition(".")
        assert root in roots and rest and all(t and all(c.isascii() and (c.isalnum() or c in "_-") for c in t)
                                              for t in rest.split("."))
    for bad in ("oserve.plan.switch", "$KV.oserve_strategy.current", "t1.hb.evil", "_INBOX_t", "_INBOX_t.>",
                "_INBOX_t.a.*", "_INBOX_t..x", "_INBOX_t.a b", ""):
        assert reply_error(bad, roots) is not None, bad


# --- hostile input against a real server -------------------------------------------------------------


async def test_no_reply_subject_but_an_inbox_is_ever_published_to(server) -> None:
    """Reply-subject injection: a client's reply subject is where an engine publishes with a worker's rights."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url)
        tap_nc = await nats.connect(server.url)
        stack.push_async_callback(tap_nc.close)
        tap = Tap()
        await tap_nc.subscribe(">", cb=tap.on)
        await tap_nc.flush()
        targets = [subjects.plan_event("switch"), "$KV.x_strategy.current", subjects.heartbeat("evil"),
                   f"{subjects.reply_prefix()}.>", f"{subjects.reply_prefix()}.a.*", "elsewhere"]
        for i, target in enumerate(targets):
            await nc.publish(subjects.submit(), submit(f"inj{i}"), reply=target)
        await nc.publish(subjects.submit(), submit("noreply"))  # nobody to answer: not served either
        reply = await client.submit(input_tokens=20, max_tokens=4, request_id="after", timeout_s=5)
        assert isinstance(reply, Reply)
        await tap_nc.flush()
        await asyncio.sleep(0.2)
        for target in targets:
            assert not [m for m in tap.msgs if m.subject == target], target
        assert gw.num_bad_reply == len(targets) + 1
        assert engines[0].num_received == 1  # only the good request reached the engine


async def test_on_a_users_own_subject_only_that_users_inbox_is_answered(server) -> None:
    """Replies tied to the authenticated user: what comes on `oserve.req.u.<user>.submit` (which permissions let
    only that user publish on) is answered only to `_INBOX_oserve.<user>.…`, so alice cannot have an answer, an
    error or a chunk sent into bob's inbox, and her cancels name only her own requests."""
    from oserve.streams.schemas import CancelRequest

    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, _ = await start_system(stack, server.url)
        tap_nc = await nats.connect(server.url)
        stack.push_async_callback(tap_nc.close)
        tap = Tap()
        await tap_nc.subscribe(f"{subjects.reply_prefix()}.>", cb=tap.on)
        await tap_nc.flush()
        bob = subjects.user_inbox_root("bob")
        alice = subjects.user_inbox_root("alice")
        for i, target in enumerate([f"{bob}.c.1", f"{bob}.1", f"{subjects.reply_prefix()}.c.1", "_INBOX.c.1",
                                    f"{alice}x.c.1", alice]):
            await nc.publish(subjects.user_submit("alice"), submit(f"as-alice{i}"), reply=target)
        await nc.publish(subjects.user_submit("alice"), b"{not json", reply=f"{bob}.c.2")  # not even an error
        await tap_nc.flush()
        await asyncio.sleep(0.3)
        assert tap.msgs == [] and gw.num_bad_reply == 7 and engines[0].num_received == 0
        # her own inbox: answered, through the client that publishes on her subject
        client = await OServeClient.connect(server.url, subjects=subjects, user="alice", default_timeout_s=5)
        stack.push_async_callback(client.close)
        assert client.submit_subject == subjects.user_submit("alice")
        with pytest.raises(ConfigError, match="inbox prefix"):  # its answers could never reach it: said at once
            OServeClient(nc, subjects, user="alice")
        reply = await client.submit(input_tokens=20, max_tokens=4, request_id="hers", timeout_s=5)
        assert isinstance(reply, Reply) and reply.output_tokens == 4
        # bob may not cancel her request, even naming her inbox; a cancel on her subject may
        slow = asyncio.create_task(client.submit(input_tokens=20, max_tokens=4000, request_id="long", timeout_s=10))
        await wait_until(lambda: "long" in gw.pending, 5, "her long request to be in flight")
        inbox = gw.pending["long"].reply
        await nc.publish(subjects.user_cancel("bob"), encode(CancelRequest(request_id="long", inbox=inbox)))
        await nc.flush()
        await asyncio.sleep(0.2)
        assert "long" in gw.pending and gw.num_cancelled == 0 and gw.num_cancels_ignored == 1
        await nc.publish(subjects.user_cancel("alice"), encode(CancelRequest(request_id="long", inbox=inbox)))
        await wait_until(lambda: gw.num_cancelled == 1, 5, "her own cancel")
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)


@given(user=st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), other=st.text(max_size=40),
       tail=st.from_regex(r"[A-Za-z0-9_-]{1,8}(\.[A-Za-z0-9_-]{1,8}){0,2}", fullmatch=True))
def test_a_users_subject_names_its_user_and_only_its_inbox_passes(user: str, other: str, tail: str) -> None:
    s = unique_subjects()
    assert s.user_of(s.user_submit(user)) == user and s.user_of(s.user_cancel(user)) == user
    assert s.user_of(s.submit()) is None and s.user_of(s.cancel()) is None
    assert s.user_of(f"{s.prefix}.req.u.{user}.other") is None
    assert s.user_of(f"x{s.prefix}.req.u.{user}.submit") is None
    gw = Gateway.__new__(Gateway)
    gw.config = GatewayConfig(subjects=s)
    assert gw._not_users_inbox(s.user_submit(user), f"{s.user_inbox_root(user)}.{tail}") is None
    assert gw._not_users_inbox(s.submit(), other) is None  # the shared subject: `reply_error` decides
    if not other.startswith(s.user_inbox_root(user) + "."):
        assert gw._not_users_inbox(s.user_submit(user), other) is not None


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                 lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"type": st.sampled_from(["submit.v1", "ping.v1", "submit.v2"]),
                           "request_id": st.text(max_size=140)},
                          optional={"input_tokens": st.integers(-5, 1 << 21), "max_tokens": st.integers(-5, 1 << 21),
                                    "prompt": st.text(max_size=50), "timeout_s": st.floats(allow_nan=True),
                                    "tags": st.dictionaries(st.text(max_size=3), st.text(max_size=3))},
                          ).map(lambda v: json.dumps(v).encode())))
def test_hostile_payloads_on_the_submit_subject_get_one_typed_answer(hostile_system, payload: bytes) -> None:
    """Anything a client may publish on the submit subject gets exactly one answer, typed, and the gateway
    keeps serving."""
    loop, nc, subjects, gw = hostile_system

    async def one() -> None:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.submit(), payload, reply=inbox)
        msg = await sub.next_msg(timeout=5)
        answer = decode_reply(msg.data)
        if isinstance(answer, ErrorReply):
            assert answer.code in {v for k, v in vars(ErrorCode).items() if k.isupper()}
            assert answer.code != ErrorCode.INTERNAL, answer
        else:
            assert isinstance(answer, Reply) or answer.__struct_config__.tag == "pong.v1"
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.05)  # no second answer
        await sub.unsubscribe()

    loop.run_until_complete(one())


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(
    st.binary(max_size=200),
    st.fixed_dictionaries({"type": st.sampled_from(["cancel.v1", "cancel.v2", "submit.v1"]),
                           "request_id": st.text(max_size=140), "inbox": st.text(max_size=300)},
                          optional={"reason": st.text(max_size=80)}).map(lambda v: json.dumps(v).encode())))
def test_hostile_payloads_on_the_cancel_subject_cancel_nothing_and_break_nothing(hostile_system, payload) -> None:
    """The other subject a client may publish on: nothing it sends there cancels another's request, raises
    in the gateway, or stops it serving."""
    loop, nc, subjects, gw = hostile_system

    async def one() -> None:
        cancelled = gw.num_cancelled
        await nc.publish(subjects.cancel(), payload)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.submit(), submit(f"after-noise-{next(_ids)}"), reply=inbox)
        assert isinstance(decode_reply((await sub.next_msg(timeout=5)).data), Reply)
        await sub.unsubscribe()
        assert gw.num_cancelled == cancelled

    loop.run_until_complete(one())


@pytest.fixture
def hostile_system(server):
    """A system on an event loop of its own, which the hypothesis tests drive example by example (one per
    test function: a loop left idle while other tests run would find its connection gone)."""
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()

    async def up():
        nc, subjects, gw, _, _ = await start_system(stack, server.url, speedup=1000.0)
        return nc, subjects, gw
    nc, subjects, gw = loop.run_until_complete(up())
    yield loop, nc, subjects, gw
    loop.run_until_complete(stack.aclose())

    async def settle() -> None:  # nats-py's per-subscription readers outlive the connection by a tick
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    loop.run_until_complete(settle())
    loop.close()


async def test_a_reused_id_with_other_content_is_never_given_the_old_answer(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url)
        first = await client.submit(input_tokens=20, max_tokens=8, sim_output_tokens=3, request_id="same")
        again = await client.submit(input_tokens=20, max_tokens=8, sim_output_tokens=3, request_id="same")
        await wait_until(lambda: not gw.pending, 5, "the gateway to forget it (the resend is released)")
        other = await client.submit(input_tokens=30, max_tokens=8, sim_output_tokens=5, request_id="same")
        assert first.output_tokens == again.output_tokens == 3 and again.e2e_s == first.e2e_s  # the stored one
        assert other.input_tokens == 30 and other.output_tokens == 5  # served anew
        await wait_until(lambda: not gw.pending, 5, "the gateway to forget all three")
        # while the first is in flight, the same id with other content is refused
        slow = asyncio.create_task(client.submit(input_tokens=20, max_tokens=400, sim_output_tokens=400,
                                                 request_id="busy"))
        await wait_until(lambda: "busy" in gw.pending, 5, "the slow request to be held")
        with pytest.raises(RequestRejected) as info:
            await client.submit(input_tokens=21, max_tokens=400, request_id="busy", timeout_s=5)
        assert info.value.code == ErrorCode.INVALID and "other content" in info.value.message
        assert (await slow).output_tokens == 400


async def test_two_clients_with_single_token_inboxes_each_get_their_own_answer(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, _ = await start_system(stack, server.url)
        answers = {}
        for n, out in (("a", 3), ("b", 6)):
            c = await nats.connect(server.url)
            stack.push_async_callback(c.close)
            inbox = c.new_inbox()  # `_INBOX.<random>`: two tokens
            sub = await c.subscribe(inbox)
            await c.publish(subjects.submit(), submit("shared-id", sim_output_tokens=out), reply=inbox)
            answers[n] = decode_reply((await sub.next_msg(timeout=5)).data)
        assert answers["a"].output_tokens == 3 and answers["b"].output_tokens == 6


# --- deadlines, overload -----------------------------------------------------------------------------


async def ask(nc, subjects, payload: bytes, timeout_s: float = 5.0):
    """Publish a raw submit and return its one answer (decoded) and the wall seconds it took."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await nc.publish(subjects.submit(), payload, reply=inbox)
    answer = decode_reply((await sub.next_msg(timeout=timeout_s)).data)
    await sub.unsubscribe()
    return answer, loop.time() - began


async def test_a_request_whose_replica_died_is_answered_at_its_deadline(server) -> None:
    """Dispatched to a replica that dies, with no other to take it: held, and answered when its deadline
    passes (it used to wait with no deadline at all)."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(
            stack, server.url, gateway_kwargs=dict(heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05))
        task = asyncio.create_task(ask(nc, subjects, submit("orphan", max_tokens=5000, sim_output_tokens=5000,
                                                            timeout_s=2.0)))
        await wait_until(lambda: engines[0].num_inflight == 1, 5, "the request to reach the engine")
        await engines[0].stop()  # a crash: nobody else can take it
        await wait_until(lambda: gw.pending.get("orphan") is not None and gw.pending["orphan"].replica_id is None,
                         5, "the request to be held for want of a replica")
        answer, took_s = await task
        assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.DEADLINE_EXCEEDED, answer
        assert answer.request_id == "orphan" and 1.7 < took_s < 3.5  # 2 s less the margin and "orphan" not in gw.pending
        assert gw.num_expired == 1


async def test_the_engine_refuses_and_aborts_what_is_past_its_deadline(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=1.0)
        # 5,000 tokens at 1x take far longer than half a second: the engine aborts it at its deadline
        answer, took_s = await ask(nc, subjects, submit("late", max_tokens=5000, sim_output_tokens=5000,
                                                        timeout_s=0.5))
        assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.DEADLINE_EXCEEDED, answer
        assert took_s < 1.5 and engines[0].num_expired == 1 and engines[0].num_inflight == 0
        await wait_until(lambda: "late" not in gw.pending, 2, "the gateway to forget it (released)")
        # a dispatch that arrives past its deadline is refused without being served
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        stale = Dispatch(request_id="stale", input_tokens=5, max_tokens=5, type_index=0, gateway_id="g",
                         deadline_unix_s=1.0)
        await nc.publish(subjects.replica("r0"), encode(stale), reply=inbox)
        refused = decode_reply((await sub.next_msg(timeout=5)).data)
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.DEADLINE_EXCEEDED
        assert engines[0].num_expired == 2


# --- restarts, fencing, completions ------------------------------------------------------------------


async def test_a_restarted_engine_host_gets_its_replicas_back(server) -> None:
    """Kill the engine host (no orderly stop) and start a new one: the switch planner starts the replicas
    of the deployment in force again, and what waited is served once."""
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=100.0)
        host_cfg = EngineHostConfig(subjects=subjects, heartbeat_interval_wall_s=0.05)
        host = EngineHost(nc, host_cfg, clock)
        await host.start()
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0.6, restart_ready_after_s=1.0), clock))
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(
            subjects=subjects, heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05, no_replica_wait_wall_s=10),
            clock))
        s = StrategyChosen(strategy_id="s0", span_index=0, replicas=[ReplicaSpec(replica_id="r0", tp=1, pp=1,
                                                                                gpu_ids=[0])],
                           weights=[{"r0": 1.0}], switch_s=0.1, forecast_rps=[1.0])
        assert await sp.switch(s)
        await gw.wait_for_replicas(1, 5)
        client = OServeClient(nc, subjects, default_timeout_s=15)
        assert isinstance(await client.submit(input_tokens=10, max_tokens=4, request_id="before"), Reply)
        inflight = asyncio.create_task(client.submit(input_tokens=10, max_tokens=300, sim_output_tokens=300,
                                                     request_id="during"))
        await wait_until(lambda: host.engines["r0"].num_inflight == 1, 5, "the request to reach the engine")
        killed = list(host.engines.values())
        host.engines.clear()  # a kill: the engines stop without answering, the host forgets them
        for e in killed:
            await e.stop()
        await host.stop()
        await wait_until(lambda: gw.live_replicas == [], 5, "the replica to be declared dead")
        host2 = await stack.enter_async_context(EngineHost(nc, host_cfg, clock))
        reply = await inflight
        assert isinstance(reply, Reply) and reply.output_tokens == 300
        assert sp.num_restarts >= 1 and "replica_restarted.v1" in sp.events and "r0" in host2.engines
        assert isinstance(await client.submit(input_tokens=10, max_tokens=4, request_id="after"), Reply)


async def test_an_engine_whose_loop_failed_is_started_anew_by_the_restart(server, caplog) -> None:
    """An engine worker stops itself when a loop fails; its host still holds it. The switch planner's
    restart of the silent replica makes the host start it anew rather than only report it ready."""
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=100.0)
        host = await stack.enter_async_context(EngineHost(nc, EngineHostConfig(
            subjects=subjects, heartbeat_interval_wall_s=0.05), clock))
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0.6, restart_ready_after_s=1.0), clock))
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(
            subjects=subjects, heartbeat_timeout_wall_s=0.3, liveness_check_wall_s=0.05), clock))
        s = StrategyChosen(strategy_id="s0", span_index=0, replicas=[ReplicaSpec(replica_id="r0", tp=1, pp=1,
                                                                                gpu_ids=[0])],
                           weights=[{"r0": 1.0}], switch_s=0.1, forecast_rps=[1.0])
        assert await sp.switch(s)
        await gw.wait_for_replicas(1, 5)
        broken = host.engines["r0"]

        async def fails() -> None:
            raise RuntimeError("injected: the heartbeat loop breaks")
        broken._send_heartbeat = fails
        await wait_until(lambda: not broken.running, 5, "the engine to stop itself")
        await wait_until(lambda: host.engines.get("r0") not in (None, broken) and host.engines["r0"].running, 10,
                         "the host to start the replica anew")
        client = OServeClient(nc, subjects, default_timeout_s=10)
        assert isinstance(await client.submit(input_tokens=10, max_tokens=4, request_id="after"), Reply)
        assert sp.num_restarts >= 1


async def test_a_stalled_replica_fences_itself_and_nothing_is_answered_twice(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, replica_ids=("r0", "r1"),
                                                               speedup=5.0)
        tap = Tap()
        await nc.subscribe("_INBOX.>", cb=tap.on)
        tasks = [asyncio.create_task(client.submit(input_tokens=10, max_tokens=500, sim_output_tokens=500,
                                                   request_id=f"q{i}")) for i in range(20)]
        await wait_until(lambda: sum(e.num_inflight for e in engines) == 20, 5, "all to be in flight")
        stalled = engines[0]
        held = stalled.num_inflight
        stalled._last_beat_wall_s -= 10.0  # as if its loop had been paused for 10 s
        beat = stalled._send_heartbeat

        async def silent_until_fenced() -> None:  # no heartbeat got out during the stall: none may end it
            if not stalled.num_fenced:
                raise nats.errors.Error("stalled")
            await beat()
        stalled._send_heartbeat = silent_until_fenced
        replies = await asyncio.gather(*tasks)
        assert sorted(r.request_id for r in replies) == sorted(f"q{i}" for i in range(20))
        assert stalled.num_fenced == 1 and (held == 0 or gw.num_requeued == held)
        await asyncio.sleep(0.2)
        finals = Counter(a.request_id for a in map(decode_reply, (m.data for m in tap.msgs))
                         if isinstance(a, (Reply, ErrorReply)))
        assert sorted(finals) == sorted(f"q{i}" for i in range(20)) and all(n == 1 for n in finals.values()), finals


async def test_completed_goes_out_before_the_reply(server) -> None:
    """A crash between an answer and its `Completed` would make the gateway serve it again: the engine
    publishes the `Completed` first, in the same write."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url)
        order: list[tuple[str, str]] = []

        async def on_any(msg) -> None:
            if msg.subject == subjects.completions():
                c = decode(msg.data, Completed)
                order.extend(("completed", i.request_id) for i in c.items)
            elif msg.subject.startswith("_INBOX") and isinstance(a := decode_reply(msg.data), Reply):
                order.append(("reply", a.request_id))
        tap_nc = await nats.connect(server.url)
        stack.push_async_callback(tap_nc.close)
        await tap_nc.subscribe(">", cb=on_any)  # one subscription: its messages are read in their order
        await tap_nc.flush()
        await asyncio.gather(*(client.submit(input_tokens=10, max_tokens=5, request_id=f"c{i}") for i in range(30)))
        await asyncio.sleep(0.2)
        for i in range(30):
            rid = f"c{i}"
            assert order.index(("completed", rid)) < order.index(("reply", rid)), rid


async def test_an_overload_is_refused_early_not_queued_for_minutes(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(
            stack, server.url, speedup=5.0, gateway_kwargs=dict(max_waiting_per_replica=50))
        codes: Counter[str] = Counter()

        async def one(i: int) -> None:
            try:
                await client.submit(input_tokens=2000, max_tokens=200, sim_output_tokens=200, request_id=f"o{i}",
                                    timeout_s=30)
                codes["ok"] += 1
            except RequestRejected as exc:
                codes[exc.code] += 1
        tasks = [asyncio.create_task(one(i)) for i in range(400)]
        await wait_until(lambda: codes[ErrorCode.OVERLOADED] > 0, 10, "an overloaded refusal")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert codes[ErrorCode.OVERLOADED] >= 300, codes


async def test_admission_by_measured_rate_refuses_what_could_not_be_served_in_time(server) -> None:
    """No fixed queue limit reached: the replica's measured service rate says a request would wait past
    its deadline, so it is refused at once and what is admitted is answered in time."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0)
        for k in range(10):  # busy time and completions enough for the rate to be measured
            await asyncio.gather(*(client.submit(input_tokens=1000, max_tokens=100, sim_output_tokens=100,
                                                 request_id=f"w{k}-{i}") for i in range(40)))
            await asyncio.sleep(0.1)  # a heartbeat after them
            if gw._replicas["r0"].service_rate() is not None:
                break
        assert gw._replicas["r0"].service_rate() is not None
        codes: Counter[str] = Counter()
        took: list[float] = []
        loop = asyncio.get_running_loop()

        async def one(i: int) -> None:
            began = loop.time()
            try:
                await client.submit(input_tokens=1000, max_tokens=100, sim_output_tokens=100, request_id=f"b{i}",
                                    timeout_s=4.0)
                codes["ok"] += 1
                took.append(loop.time() - began)
            except RequestRejected as exc:
                codes[exc.code] += 1
        await asyncio.gather(*(one(i) for i in range(1500)))
        assert codes[ErrorCode.OVERLOADED] > 0 and codes["ok"] > 0, codes
        assert set(codes) <= {"ok", ErrorCode.OVERLOADED}, codes  # nothing timed out or expired
        assert max(took) < 4.0


async def test_a_request_lost_in_a_gateway_before_it_was_owned_is_sent_again(server) -> None:
    """A gateway that read a request and crashed before owning it: the client hears no `Accepted` and
    publishes the request again, which a live gateway serves (once)."""
    from oserve.streams.client import ReconnectPolicy

    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, _ = await start_system(stack, server.url)
        crashed = await nats.connect(server.url)
        stack.push_async_callback(crashed.close)
        swallowed: list[str] = []

        async def dies_with_it(msg) -> None:  # in the gateways' queue group: takes requests, owns none
            swallowed.append(msg.reply)
            if len(swallowed) == 1:
                await sub.unsubscribe()  # a few more may be on their way to it meanwhile
        sub = await crashed.subscribe(subjects.submit(), queue="gateway", cb=dies_with_it)
        await crashed.flush()
        client = OServeClient(nc, subjects, default_timeout_s=10, reconnect=ReconnectPolicy(accept_timeout_s=0.3))
        sent = 0
        while not swallowed and sent < 60:  # the queue group picks a member at random for each request
            sent += 1
            reply = await client.submit(input_tokens=10, max_tokens=4, request_id=f"a{sent}")
            assert reply.request_id == f"a{sent}"
        assert swallowed and client.num_unaccepted_resent == 1
        assert engines[0].num_answered == sent and client.num_duplicates == 0


async def test_a_replica_with_room_in_its_batch_is_never_refused_for_its_rate(server) -> None:
    """A rate measured while requests came one at a time says nothing of what a batch serves: a jump in
    load that fits the replica's KV cache is admitted whole."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0)
        for i in range(30):  # one at a time: a low busy-time rate
            await client.submit(input_tokens=200, max_tokens=100, sim_output_tokens=100, request_id=f"one{i}")
        await asyncio.sleep(0.2)
        assert gw._replicas["r0"].rate is not None
        replies = await asyncio.gather(*(client.submit(input_tokens=200, max_tokens=100, sim_output_tokens=100,
                                                       request_id=f"jump{i}", timeout_s=10) for i in range(60)))
        assert len(replies) == 60 and all(isinstance(r, Reply) for r in replies)


# --- a gateway crash: what it owned survives in its journal ---------------------------------------------

class _RawClient:
    """A client with nothing but nats-py: it never sends a request again, so only the system can save it."""

    def __init__(self, nc, subjects) -> None:
        self.nc, self.subjects, self.got = nc, subjects, []
        self.sent: dict[str, bytes] = {}

    async def start(self) -> None:
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on)

    async def _on(self, msg) -> None:
        if not msg.data:  # 503 "no responders": nobody took it (a gateway's subscription not yet seen by the
            # server; seen about once in 50 gateway starts here even after a flush of its connection): sent again,
            # as any client may, since nobody owns it
            self.got.append(("status", msg.subject, dict(msg.headers or {})))
            await asyncio.sleep(0.05)
            await self.nc.publish(self.subjects.submit(), self.sent[msg.subject], reply=msg.subject)
            return
        self.got.append(decode_reply(msg.data))

    async def send(self, request_id: str, **kw) -> None:
        inbox = f"{self.inbox}.{request_id}"
        self.sent[inbox] = encode(SubmitRequest(
            request_id=request_id, ack=True, timeout_s=60, **{"input_tokens": 20, "max_tokens": 8, **kw}))
        await self.nc.publish(self.subjects.submit(), self.sent[inbox], reply=inbox)

    def finals(self, request_id: str) -> list:
        return [a for a in self.got if isinstance(a, (Reply, ErrorReply)) and a.request_id == request_id]

    def accepted(self, request_id: str) -> bool:
        from oserve.streams.schemas import Accepted
        return any(isinstance(a, Accepted) and a.request_id == request_id for a in self.got)


async def _journal_setup(stack, url: str) -> tuple:
    """A connection, fresh subjects with their streams, and a plain client on them."""
    from oserve.streams.jetstream import ensure_streams

    subjects = unique_subjects()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    await ensure_streams(nc.jetstream(), subjects)
    client = _RawClient(nc, subjects)
    await client.start()
    return nc, subjects, client


async def _journaled_gateway(stack, url: str, subjects, gateway_id: str, **kw) -> tuple:
    """A gateway with its journal on its own connection (closed abruptly to crash it)."""
    nc = await nats.connect(url)
    gw = Gateway(nc, GatewayConfig(subjects=subjects, gateway_id=gateway_id, **kw), Clock(speedup=20.0),
                 js=nc.jetstream())
    await gw.start()
    await nc.flush()  # its subscriptions are the server's before anything is sent to it
    return nc, gw


async def _crash(nc, gw) -> None:
    """As a SIGKILL would: the connection drops, nothing is drained, answered or settled."""
    await nc.close()
    await gw.stop()


async def test_a_request_held_by_a_gateway_that_crashed_is_served_by_its_restart(server) -> None:
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig

    async with AsyncExitStack() as stack:
        nc, subjects, client = await _journal_setup(stack, server.url)
        gw_nc, gw = await _journaled_gateway(stack, server.url, subjects, "gw-a", no_replica_wait_wall_s=30.0)
        await client.send("held")  # no replica yet: held, and the client is told it is owned
        await wait_until(lambda: client.accepted("held"), 5, "the gateway to own the request")
        await _crash(gw_nc, gw)
        assert client.finals("held") == []
        engine = await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r0", subjects=subjects, heartbeat_interval_wall_s=0.05), Clock(speedup=20.0)))
        gw2_nc, gw2 = await _journaled_gateway(stack, server.url, subjects, "gw-a", no_replica_wait_wall_s=30.0)
        stack.push_async_callback(gw2_nc.close)
        stack.push_async_callback(gw2.stop)
        assert gw2.num_recovered == 1 and "held" in gw2.pending
        await wait_until(lambda: client.finals("held"), 10, "the restarted gateway to have it served")
        await asyncio.sleep(0.3)
        assert [type(a).__name__ for a in client.finals("held")] == ["Reply"] and engine.num_answered == 1
        await wait_until(lambda: not gw2.pending, 5, "its completion")


async def test_a_dispatched_request_whose_replica_died_while_its_gateway_was_down_is_served_once(server) -> None:
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig

    async with AsyncExitStack() as stack:
        nc, subjects, client = await _journal_setup(stack, server.url)
        clock = Clock(speedup=2.0)
        doomed_nc = await nats.connect(server.url)
        doomed = EngineWorker(doomed_nc, EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05),
                              clock)
        await doomed.start()
        gw_nc, gw = await _journaled_gateway(stack, server.url, subjects, "gw-b", heartbeat_timeout_wall_s=0.5)
        await gw.wait_for_replicas(1, 5)
        await client.send("long", max_tokens=4000, sim_output_tokens=4000)  # minutes at this clock
        # and one that finishes while the gateway is down: its completion is in the stream, not re-served
        await client.send("short", max_tokens=2)
        await wait_until(lambda: client.accepted("long") and client.accepted("short"), 5, "both owned")
        await _crash(gw_nc, gw)
        await wait_until(lambda: client.finals("short"), 5, "the short one to be answered by its engine")
        await doomed_nc.close()  # r0 dies with "long" on it, while no gateway watches
        await doomed.stop()
        survivor = await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r1", subjects=subjects, heartbeat_interval_wall_s=0.05), Clock(speedup=200.0)))
        gw2_nc, gw2 = await _journaled_gateway(stack, server.url, subjects, "gw-b", heartbeat_timeout_wall_s=0.5)
        stack.push_async_callback(gw2_nc.close)
        stack.push_async_callback(gw2.stop)
        assert gw2.num_recovered == 1 and gw2.pending["long"].replica_id == "r0"  # "short" was completed
        await wait_until(lambda: client.finals("long"), 15, "r0 to be declared dead and the request re-dispatched")
        await asyncio.sleep(0.3)
        assert [type(a).__name__ for a in client.finals("long")] == ["Reply"]
        assert [type(a).__name__ for a in client.finals("short")] == ["Reply"]
        assert survivor.num_answered == 1 and gw2.num_redispatched == 1


async def test_a_request_answered_while_its_gateway_was_down_is_not_taken_back_by_a_later_restart(
        server, monkeypatch) -> None:
    """The first restart finds the answer in the completions stream and journals the request settled, so a
    second restart, reading completions only from after that, does not take it back (a phantom that would be
    sent again if its replica went silent)."""
    import oserve.workers.gateway as gateway_module
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig

    monkeypatch.setattr(gateway_module, "RECOVERY_LOOKBACK_WALL_S", 0.0)  # no slack: only the journal's record
    async with AsyncExitStack() as stack:
        nc, subjects, client = await _journal_setup(stack, server.url)
        await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r0", subjects=subjects, heartbeat_interval_wall_s=0.05), Clock(speedup=2.0)))
        gw_nc, gw = await _journaled_gateway(stack, server.url, subjects, "gw-c")
        await gw.wait_for_replicas(1, 5)
        await client.send("answered-later", max_tokens=60, sim_output_tokens=60)
        await wait_until(lambda: client.accepted("answered-later"), 5, "the request to be owned")
        await _crash(gw_nc, gw)
        await wait_until(lambda: client.finals("answered-later"), 10, "its engine to answer it")
        gw2_nc, gw2 = await _journaled_gateway(stack, server.url, subjects, "gw-c")
        assert gw2.num_recovered == 0
        await gw2.wait_for_replicas(1, 5)
        # the journal goes on past that answer: a later request, answered and settled
        await client.send("later", max_tokens=2)
        await wait_until(lambda: client.finals("later") and not gw2.pending and not gw2._settled, 5,
                         "the later request to be answered and journaled settled")
        await _crash(gw2_nc, gw2)
        gw3_nc, gw3 = await _journaled_gateway(stack, server.url, subjects, "gw-c")
        stack.push_async_callback(gw3_nc.close)
        stack.push_async_callback(gw3.stop)
        assert gw3.num_recovered == 0 and not gw3.pending
        assert len(client.finals("answered-later")) == 1


async def test_a_request_on_a_replica_started_again_under_its_id_is_served_by_the_new_one(server) -> None:
    """The replica a recovered request was on died and came back under the same id, with nothing of it: its
    heartbeats say it is alive, so only sending the request to it again (marked recovered) has it served."""
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig

    async with AsyncExitStack() as stack:
        nc, subjects, client = await _journal_setup(stack, server.url)
        old_nc = await nats.connect(server.url)
        old = EngineWorker(old_nc, EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05),
                           Clock(speedup=1.0))
        await old.start()
        gw_nc, gw = await _journaled_gateway(stack, server.url, subjects, "gw-d", heartbeat_timeout_wall_s=5.0)
        await gw.wait_for_replicas(1, 5)
        await client.send("moved-on", max_tokens=400, sim_output_tokens=400)  # seconds at this clock
        await wait_until(lambda: client.accepted("moved-on") and old.num_inflight == 1, 5, "it to be running")
        await _crash(gw_nc, gw)
        await old_nc.close()
        await old.stop()
        new = await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r0", subjects=subjects, heartbeat_interval_wall_s=0.05), Clock(speedup=50.0)))
        gw2_nc, gw2 = await _journaled_gateway(stack, server.url, subjects, "gw-d", heartbeat_timeout_wall_s=5.0)
        stack.push_async_callback(gw2_nc.close)
        stack.push_async_callback(gw2.stop)
        assert gw2.num_recovered == 1
        await wait_until(lambda: client.finals("moved-on"), 4, "the new r0 to serve it (before any timeout)")
        await asyncio.sleep(0.3)
        assert [type(a).__name__ for a in client.finals("moved-on")] == ["Reply"]
        assert new.num_answered == 1 and gw2.num_redispatched == 0 and gw2.num_declared_dead == 0


async def test_a_cancelled_request_is_not_taken_back_and_an_answered_one_is_released_not_answered_again(
        server) -> None:
    from oserve.streams.schemas import CancelRequest
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig

    async with AsyncExitStack() as stack:
        nc, subjects, client = await _journal_setup(stack, server.url)
        gw_nc, gw = await _journaled_gateway(stack, server.url, subjects, "gw-e", no_replica_wait_wall_s=30.0)
        await client.send("abandoned")  # held: no replica
        await wait_until(lambda: client.accepted("abandoned"), 5, "the request to be owned")
        await nc.publish(subjects.cancel(), encode(CancelRequest(request_id="abandoned",
                                                                 inbox=f"{client.inbox}.abandoned")))
        await wait_until(lambda: gw.num_cancelled == 1 and not gw._settled, 5, "the cancel to be journaled")
        await _crash(gw_nc, gw)
        gw2_nc, gw2 = await _journaled_gateway(stack, server.url, subjects, "gw-e")
        stack.push_async_callback(gw2_nc.close)
        stack.push_async_callback(gw2.stop)
        assert gw2.num_recovered == 0 and not gw2.pending
        # an engine that answered a request before releases it, silently, when it comes back marked recovered
        engine = await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r9", subjects=subjects, heartbeat_interval_wall_s=0.05), Clock(speedup=50.0)))
        released: list = []

        async def on_completed(msg) -> None:
            released.extend(decode(msg.data, Completed).released)
        await nc.subscribe(subjects.completions(), cb=on_completed)
        d = Dispatch(request_id="once", input_tokens=10, max_tokens=3, type_index=0, gateway_id="gw-e")
        await nc.publish(subjects.replica("r9"), encode(d), reply=f"{client.inbox}.once")
        await wait_until(lambda: client.finals("once"), 5, "its answer")
        await nc.publish(subjects.replica("r9"), encode(msgspec.structs.replace(d, recovered=True)),
                         reply=f"{client.inbox}.once")
        await wait_until(lambda: "once" in released, 5, "its release")
        await asyncio.sleep(0.2)
        assert len(client.finals("once")) == 1 and engine.num_answered == 1


async def test_a_slow_heartbeat_confirmation_is_waited_for_never_given_up(server) -> None:
    """nats-py 2.16 stops a connection's read loop for good when the PONG of a flush that timed out comes in
    (its future was cancelled: `InvalidStateError`), so an engine that gave up on a slow confirmation killed the
    connection it shares with its host's other workers (found with vLLM: a request lost after a fence). The
    engine now waits for each confirmation as long as it takes, one at a time, and fences meanwhile."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=2.0, engine_kwargs=dict(
            fence_after_wall_s=0.3))
        real_flush, cancelled, started = nc.flush, [], []

        async def slow_flush(timeout=None):  # the first PONG takes 1 s (a busy server, a slow link)
            started.append(timeout)
            try:
                if len(started) == 1:
                    await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                cancelled.append(timeout)
                raise
            await real_flush()
        nc.flush = slow_flush
        t = asyncio.create_task(client.submit(input_tokens=10, max_tokens=100, sim_output_tokens=100, timeout_s=20))
        await asyncio.sleep(1.5)
        # the one in flight meanwhile is answered, or refused explicitly after its replicas fenced it thrice;
        # never left without an answer, and the shared connection still serves what comes next
        first = await asyncio.gather(asyncio.wait_for(t, 20), return_exceptions=True)
        assert isinstance(first[0], (Reply, RequestRejected)), first
        reply = await client.submit(input_tokens=10, max_tokens=20, timeout_s=10)
        assert isinstance(reply, Reply) and reply.output_tokens == 20
        assert cancelled == [] and len(started) >= 2 and all(timeout >= 60 for timeout in started), (cancelled, started)
        await wait_until(lambda: not any(e._stalled() for e in engines), 5, "heartbeats to be confirmed again")
        nc.flush = real_flush


async def _captured_submit(stack, url: str, subjects) -> list:
    """The submits a client publishes, as (payload, inbox) in order: a plain subscription beside the gateways'
    queue group, on its own connection."""
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    got: list = []

    async def on(msg) -> None:
        got.append((msg.data, msg.reply))
    await nc.subscribe(subjects.submit(), cb=on)
    await nc.flush()
    return got


def _finals(tap: Tap, inbox: str) -> int:
    """Final answers (not chunks, not confirmations) that reached `inbox`."""
    return sum(not isinstance(decode_reply(m.data), (ReplyChunk, Accepted)) for m in tap.on_subject(inbox))


async def test_a_clients_copy_that_crossed_its_answer_is_not_answered_twice(server) -> None:
    """A client publishes a request again when no gateway confirmed it within `accept_timeout_s`. After its
    host's loop stalls, the timer fires before the confirmation already received is read, and the copy can
    reach the gateway after the request was answered (the live switch test's one request answered twice,
    CI of 2026-12-07): marked `unaccepted`, the copy is dropped, and the inbox gets no second answer. A copy
    without the mark (a reconnect's: its answer may have been lost with the connection) is still answered
    from the engine's store."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url)
        submits = await _captured_submit(stack, server.url, subjects)
        tap = Tap()
        await nc.subscribe("_INBOX.>", cb=tap.on)
        reply = await client.submit(input_tokens=20, max_tokens=8, sim_output_tokens=8, request_id="x1")
        await wait_until(lambda: not gw.pending and submits, 5, "the gateway to let the answered request go")
        (data, inbox), = submits
        assert _finals(tap, inbox) == 1
        received = engines[0].num_received
        await nc.publish(subjects.submit(), data, reply=inbox, headers={COPY_HEADER: UNACCEPTED_COPY})
        await nc.flush()
        await wait_until(lambda: gw.num_late_copies == 1, 5, "the late copy to be recognised")
        await asyncio.sleep(0.3)  # a second answer, were there one, would have come by now
        assert _finals(tap, inbox) == 1 and engines[0].num_received == received and not gw.pending
        await nc.publish(subjects.submit(), data, reply=inbox)  # unmarked: served from the engine's store
        await wait_until(lambda: _finals(tap, inbox) == 2, 5, "the stored answer to be sent again")
        assert decode_reply(tap.on_subject(inbox)[-1].data) == reply and engines[0].num_duplicates == 1


async def test_a_copy_that_crossed_its_answer_before_the_gateway_heard_of_it_is_not_answered_twice(server) -> None:
    """The other order: the copy reaches the gateway after the engine answered but before the gateway read the
    engine's `Completed`, so the gateway still holds the request and forwards the copy. Marked, it goes as
    `recovered` and the engine releases it without answering again; unmarked (a reconnect's copy), the engine
    sends its stored answer again. A marked copy whose dispatch was lost still gets served (`recovered` only
    stops an engine that answered)."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url)
        submits = await _captured_submit(stack, server.url, subjects)
        tap = Tap()
        await nc.subscribe("_INBOX.>", cb=tap.on)
        gw._recovery_buffer = []  # the gateway's completions wait (as while its loop is behind)
        await client.submit(input_tokens=20, max_tokens=8, sim_output_tokens=8, request_id="x2")
        await wait_until(lambda: gw._recovery_buffer and submits, 5, "the engine's completion")
        (data, inbox), = submits
        assert "x2" in gw.pending and _finals(tap, inbox) == 1
        await nc.publish(subjects.submit(), data, reply=inbox, headers={COPY_HEADER: UNACCEPTED_COPY})
        await wait_until(lambda: engines[0].num_duplicates == 1, 5, "the copy to reach the engine")
        await asyncio.sleep(0.3)  # a second answer, were there one, would have come by now
        assert _finals(tap, inbox) == 1 and engines[0].num_errors == 0
        await nc.publish(subjects.submit(), data, reply=inbox)  # unmarked: the stored answer goes again
        await wait_until(lambda: _finals(tap, inbox) == 2, 5, "the stored answer to be sent again")
        held, gw._recovery_buffer = gw._recovery_buffer, None
        for msg in held:
            await gw._on_completed(msg)
        assert not gw.pending
        # a dispatch lost on its way (the engine never had it): a marked copy has it served
        gw._recovery_buffer = []
        real = engines[0]._handle

        async def lost(msg) -> None:  # the engine loses what reaches it
            pass
        engines[0]._handle = lost
        n = len(submits)
        task = asyncio.create_task(client.submit(input_tokens=20, max_tokens=8, sim_output_tokens=8,
                                                 request_id="x3"))
        await wait_until(lambda: "x3" in gw.pending and len(submits) > n, 5, "the request to be dispatched")
        engines[0]._handle = real
        data, inbox = submits[n]
        await nc.publish(subjects.submit(), data, reply=inbox, headers={COPY_HEADER: UNACCEPTED_COPY})
        assert (await task).request_id == "x3" and _finals(tap, inbox) == 1


async def test_the_client_marks_the_copies_it_publishes_for_want_of_a_confirmation(server) -> None:
    """The first publish goes unmarked; each copy after `accept_timeout_s` without a confirmation carries
    `COPY_HEADER: unaccepted`."""
    from oserve.streams.client import ReconnectPolicy, RequestTimeout

    async with AsyncExitStack() as stack:
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        subjects = unique_subjects()
        seen: list = []

        async def silent_gateway(msg) -> None:  # takes every request, confirms none, answers none
            seen.append(dict(msg.headers or {}))
        await nc.subscribe(subjects.submit(), queue="gateway", cb=silent_gateway)
        client = OServeClient(nc, subjects, reconnect=ReconnectPolicy(accept_timeout_s=0.1))
        with pytest.raises(RequestTimeout):
            await client.submit(input_tokens=10, max_tokens=4, request_id="m1", timeout_s=0.8)
        assert len(seen) >= 3 and client.num_unaccepted_resent == len(seen) - 1
        assert COPY_HEADER not in seen[0] and all(h.get(COPY_HEADER) == UNACCEPTED_COPY for h in seen[1:])
