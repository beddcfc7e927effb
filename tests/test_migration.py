"""Requests migrate mid-answer from a retiring replica (simulated engines, a real nats-server): each is handed
over with what it generated (`Completed.migrated`), continued on the new replica (`Dispatch.resume`), answered
once, with as many tokens as without a switch, and its stream goes on from where the client stood."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from conftest import start_system
from oserve.streams.schemas import (AssignmentSet, Completed, Dispatch, Reply, Resume, decode, decode_reply,
                                    encode)
from oserve.streams.testing import running_server, wait_until
from oserve.workers.backends import Job, SimBackend, SimBackendConfig, placeholder_text


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def test_a_resumed_job_generates_only_the_rest_and_answers_the_whole_length():
    backend = SimBackend("r", SimBackendConfig())
    backend.add(Job(1, "a", 100, 50, 0, 0.0, output_tokens=50, resumed_tokens=20), 0.0)
    assert backend.generated_tokens(1, 0.0) == 20  # what it brought counts from the start
    done = []
    t = 0.0
    while not done:
        t = backend.next_event_s()
        done = backend.advance(t)
    assert done[0].output_tokens == 50
    fresh = SimBackend("s", SimBackendConfig())
    fresh.add(Job(1, "a", 100, 50, 0, 0.0, output_tokens=50), 0.0)
    finished = []
    while not finished:
        finished = fresh.advance(fresh.next_event_s())
    assert done[0].finish_s < finished[0].finish_s  # 30 tokens to decode, not 50


async def test_running_requests_migrate_and_are_answered_once_with_their_whole_answer(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0)
        old, new = engines
        handed: list = []

        async def on_completed(msg) -> None:
            handed.extend(decode(msg.data, Completed).migrated)
        await nc.subscribe(subjects.completions(), cb=on_completed)
        finals: dict[str, int] = {}

        async def on_answer(msg) -> None:  # a tap on every inbox: a second final answer would show here
            ans = decode_reply(msg.data)
            if isinstance(ans, Reply):
                finals[ans.request_id] = finals.get(ans.request_id, 0) + 1
        await nc.subscribe("_INBOX.>", cb=on_answer)

        async def flip(to: str) -> None:
            await nc.publish(subjects.plan_event("assignment"), encode(AssignmentSet(strategy_id=to, weights=[{to: 1.0}])))
            await wait_until(lambda: gw.strategy_id == to, 5, f"the router to follow {to}")
        await flip(old.config.replica_id)

        async def ask(i: int):
            parts, final = [], None
            async for item in client.stream(prompt=f"request {i} " * 20, max_tokens=400, sim_output_tokens=400,
                                            request_id=f"m{i}"):
                if isinstance(item, Reply):
                    final = item
                else:
                    parts.append(item)
            return parts, final
        tasks = [asyncio.create_task(ask(i)) for i in range(6)]
        await wait_until(lambda: old.num_inflight == 6, 5, "every request to run on the old replica")
        await wait_until(lambda: all(old.backend.generated_tokens(s, old.clock.now_s()) > 0 for s in old._inflight),
                         10, "every request to have generated tokens")
        await flip(new.config.replica_id)
        await old.drain_migrating(0.0)
        results = await asyncio.gather(*tasks)
        assert old.num_migrated == 6 and gw.num_migrated == 6 and {m.request_id for m in handed} == {f"m{i}" for i in range(6)}
        assert all(0 < m.resume.num_tokens < 400 and m.resume.from_replica == old.config.replica_id for m in handed)
        for parts, final in results:
            assert final.replica_id == new.config.replica_id and final.output_tokens == 400
            assert final.text == placeholder_text(0, 400)
            # the chunks go on where the client stood: contiguous offsets, no token twice, from both replicas
            offsets = [(p.offset_tokens, p.num_tokens) for p in parts]
            assert all(a + n == b for (a, n), (b, _) in zip(offsets, offsets[1:]))
            assert "".join(p.text for p in parts) == final.text
            assert {p.replica_id for p in parts} == {old.config.replica_id, new.config.replica_id}
        await asyncio.sleep(0.3)  # a second answer, were there one, would have come by now
        assert finals == {f"m{i}": 1 for i in range(6)}
        await wait_until(lambda: not gw.pending, 5, "the gateway to forget every answered request")


async def test_a_copy_of_a_handed_over_request_that_reaches_the_old_replica_late_is_not_served_again(server) -> None:
    """A client's retry that its gateway forwarded to the old replica before it heard of the hand-over reaches
    the old replica after the request left it: the new replica answers it, the old one drops the copy."""
    async with AsyncExitStack() as stack:
        nc, subjects, gw, engines, client = await start_system(stack, server.url, speedup=5.0)
        old, new = engines
        finals: dict[str, int] = {}

        async def on_answer(msg) -> None:
            ans = decode_reply(msg.data)
            if isinstance(ans, Reply):
                finals[ans.request_id] = finals.get(ans.request_id, 0) + 1
        await nc.subscribe("_INBOX.>", cb=on_answer)
        sent: list = []  # the dispatches the old replica received, as they went on the wire

        async def on_dispatch(msg) -> None:
            sent.append((msg.data, msg.reply))
        await nc.subscribe(subjects.replica(old.config.replica_id), cb=on_dispatch)

        async def flip(to: str) -> None:
            await nc.publish(subjects.plan_event("assignment"), encode(AssignmentSet(strategy_id=to, weights=[{to: 1.0}])))
            await wait_until(lambda: gw.strategy_id == to, 5, f"the router to follow {to}")
        await flip(old.config.replica_id)
        tasks = [asyncio.create_task(client.submit(prompt=f"request {i} " * 20, max_tokens=400, sim_output_tokens=400,
                                                   request_id=f"c{i}")) for i in range(2)]
        await wait_until(lambda: old.num_inflight == 2 and all(
            old.backend.generated_tokens(s, old.clock.now_s()) > 0 for s in old._inflight), 10,
            "both requests to run on the old replica, mid-answer")
        await flip(new.config.replica_id)
        await old.drain_migrating(0.0)
        assert old.num_migrated == 2
        data, reply = next((d, r) for d, r in sent if decode(d, Dispatch).request_id == "c0")
        await nc.publish(subjects.replica(old.config.replica_id), data, reply=reply)  # the late copy
        answers = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # a second answer, were there one, would have come by now
        assert old.num_stale_handed == 1 and old.num_inflight == 0
        assert [a.replica_id for a in answers] == [new.config.replica_id] * 2 and finals == {"c0": 1, "c1": 1}


def test_a_dispatch_carries_its_resume_through_the_wire_format():
    d = Dispatch(request_id="x", input_tokens=5, max_tokens=9, type_index=0, gateway_id="g",
                 resume=Resume(num_tokens=3, token_ids=[7, 8, 9], text=" a b c", sent_tokens=2, sent_chars=4,
                               from_replica="r0"))
    assert decode(encode(d), Dispatch) == d
