"""The switch planner's transaction with simulated engines and a real nats-server: a replica started again is
waited for anew, and a replica that reports it cannot start rolls the switch back at once, with its reason."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import nats
import pytest

from oserve.streams.schemas import (CommandAck, DrainReplica, HostCommand, ReplicaFailed, ReplicaReady, ReplicaSpec,
                                    StartReplica, StrategyChosen, decode, encode)
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.workers.clock import Clock
from oserve.workers.engine_host import EngineHost, EngineHostConfig
from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def _strategy(sid: str, rid: str, switch_s: float = 1.0) -> StrategyChosen:
    return StrategyChosen(strategy_id=sid, span_index=0, replicas=[ReplicaSpec(replica_id=rid, tp=1, pp=1, gpu_ids=[0])],
                          weights=[{rid: 1.0}], switch_s=switch_s, forecast_rps=[1.0])


async def test_a_replica_started_again_is_waited_for_not_taken_as_ready_from_an_old_report(server) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=1.0)
        host = await stack.enter_async_context(EngineHost(nc, EngineHostConfig(subjects=subjects), clock))
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0), clock))
        # an old report: "x" was ready once (it served an earlier deployment, and is gone since)
        await nc.publish(subjects.plan_event("replica"), encode(ReplicaReady(strategy_id="s0", replica_id="x")))
        await wait_until(lambda: "x" in sp._ready, 5, "the old report to be read")
        t0 = time.monotonic()
        assert await sp.switch(_strategy("s1", "x", switch_s=1.0))  # the host brings it up after 1 s
        assert time.monotonic() - t0 >= 0.9 and "x" in host.engines and host.engines["x"].running


async def test_a_replica_that_cannot_start_rolls_the_switch_back_at_once_with_its_reason(server) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=1.0)
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0, ready_slack_wall_s=120), clock))
        events: list = []
        sp.events = events

        async def fail_it(msg) -> None:  # no engine host: this one acknowledges and reports that the replica failed
            await nc.publish(msg.reply, encode(CommandAck(host_id="local", command_id=decode(msg.data, HostCommand)
                                                          .command_id)))
            await nc.publish(subjects.plan_event("replica"), encode(ReplicaFailed(
                strategy_id="s1", replica_id="y", reason="weights not received: checksum mismatch")))
        await nc.subscribe(subjects.host_control("local"), cb=fail_it)
        t0 = time.monotonic()
        assert not await sp.switch(_strategy("s1", "y", switch_s=0.0))
        assert time.monotonic() - t0 < 10  # not the 120 s the planner would wait for a replica that says nothing
        assert events[-1] == "switch_rolled_back.v1" and sp.current == {}


async def test_a_command_whose_acknowledgement_is_lost_is_sent_again_and_run_once(server) -> None:
    """Acknowledged control: the host's first `StartReplica` is lost on its way (dropped here before the host
    reads it); the planner hears no `CommandAck`, sends it again with the same id, and the replica starts once."""
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=1.0)
        host = EngineHost(nc, EngineHostConfig(subjects=subjects), clock)
        heard = host._on_command
        dropped: list[str] = []

        async def lossy(cmd, msg) -> None:
            if not dropped:
                dropped.append(cmd.command_id)  # lost: never read, never acknowledged
                return
            await heard(cmd, msg)
        host._on_command = lossy
        await stack.enter_async_context(host)
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0, command_ack_wall_s=0.3), clock))
        ready: list[str] = []

        async def on_replica(msg) -> None:
            ev = decode(msg.data, ReplicaReady | ReplicaFailed)
            ready.append(type(ev).__name__)
        await nc.subscribe(subjects.plan_event("replica"), cb=on_replica)
        assert await sp.switch(_strategy("s1", "x", switch_s=0.2))
        assert dropped and sp.num_command_resends == 1 and sp.num_unacked_commands == 0
        assert list(host.engines) == ["x"] and ready == ["ReplicaReady"]


async def test_a_host_runs_a_command_id_once_and_acknowledges_every_send(server) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        host = await stack.enter_async_context(EngineHost(nc, EngineHostConfig(subjects=subjects), Clock(speedup=1.0)))
        acks: list[CommandAck] = []

        async def on_ack(msg) -> None:
            acks.append(decode(msg.data, CommandAck))
        await nc.subscribe(subjects.control_acks("me"), cb=on_ack)
        start = encode(StartReplica(strategy_id="s1", replica=ReplicaSpec(replica_id="x", tp=1, pp=1, gpu_ids=[0]),
                                    ready_after_s=0.0, command_id="me-1"))
        for _ in range(3):
            await nc.publish(subjects.host_control("local"), start, reply=subjects.control_ack("me", 1))
        # a reply subject that is not an acknowledgement subject is never published to
        tap: list = []

        async def on_tap(msg) -> None:
            tap.append(msg)
        await nc.subscribe(subjects.plan_event("switch"), cb=on_tap)
        await nc.publish(subjects.host_control("local"), encode(DrainReplica(
            strategy_id="s1", replica_id="nobody", command_id="me-2")), reply=subjects.plan_event("switch"))
        await wait_until(lambda: len(acks) == 3 and "x" in host.engines, 5, "three acknowledgements and the start")
        await nc.flush()
        assert [a.duplicate for a in acks] == [False, True, True] and {a.command_id for a in acks} == {"me-1"}
        assert host.num_duplicate_commands == 2 and tap == []


async def test_control_events_are_acknowledged_by_the_plans_stream_and_stored_once(server) -> None:
    from oserve.streams.jetstream import EventPublisher, ensure_streams

    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        heard: list[bytes] = []

        async def on_event(msg) -> None:
            heard.append(msg.data)
        await nc.subscribe(subjects.plan_event("switch"), cb=on_event)
        events = EventPublisher(nc, js, timeout_s=2.0)
        assert await events.publish(subjects.plan_event("switch"), b'{"a": 1}', {"Nats-Msg-Id": "one"})
        assert await events.publish(subjects.plan_event("switch"), b'{"a": 1}', {"Nats-Msg-Id": "one"})  # a retry
        assert await events.publish(subjects.plan_event("switch"), b'{"b": 2}')  # given an id of its own
        info = await js.stream_info(subjects.stream_plans())
        assert info.state.messages == 2 and events.num_acked == 3 and events.num_unacked == 0
        await wait_until(lambda: len(heard) == 3, 5, "the core subscriber to hear every publish")
        # nothing stores it: no acknowledgement comes, and the publisher says so instead of pretending
        lost = EventPublisher(nc, js, timeout_s=0.2, attempts=2, retry_wall_s=0.01)
        assert not await lost.publish(f"{subjects.prefix}.nowhere", b"x")
        assert lost.num_unacked == 1 and lost.num_retries == 1
        plain = EventPublisher(nc, None)  # without JetStream: a plain publish
        assert await plain.publish(subjects.plan_event("switch"), b"{}")


async def test_a_lost_acknowledgement_has_the_command_sent_again_and_still_run_once(server) -> None:
    """The host runs the command and its acknowledgement is lost: the planner sends it again with the same id,
    the host acknowledges it as a duplicate and does not run it twice."""
    async with AsyncExitStack() as stack:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=1.0)

        class LosesFirstAck:  # the host's connection, whose first acknowledgement never arrives
            def __init__(self, inner) -> None:
                self.inner, self.lost = inner, 0

            def __getattr__(self, name):
                return getattr(self.inner, name)

            async def publish(self, subject, payload=b"", reply="", headers=None) -> None:
                if subjects.is_control_ack(subject) and not self.lost:
                    self.lost += 1
                    return
                await self.inner.publish(subject, payload, reply=reply, headers=headers)

        lossy = LosesFirstAck(nc)
        host = await stack.enter_async_context(EngineHost(lossy, EngineHostConfig(subjects=subjects), clock))
        sp = await stack.enter_async_context(SwitchPlannerWorker(nc, SwitchPlannerConfig(
            subjects=subjects, restart_after_wall_s=0, command_ack_wall_s=0.3), clock))
        assert await sp.switch(_strategy("s1", "x", switch_s=0.2))
        assert lossy.lost == 1 and sp.num_command_resends == 1 and host.num_duplicate_commands == 1
        assert list(host.engines) == ["x"]
