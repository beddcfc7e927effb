"""The switch planner's transaction with simulated engines and a real nats-server: a replica started again is
waited for anew, and a replica that reports it cannot start rolls the switch back at once, with its reason."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import nats
import pytest

from oserve.streams.schemas import ReplicaFailed, ReplicaReady, ReplicaSpec, StrategyChosen, encode
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

        async def fail_it(msg) -> None:  # no engine host: this one only reports that the replica failed
            await nc.publish(subjects.plan_event("replica"), encode(ReplicaFailed(
                strategy_id="s1", replica_id="y", reason="weights not received: checksum mismatch")))
        await nc.subscribe(subjects.host_control("local"), cb=fail_it)
        t0 = time.monotonic()
        assert not await sp.switch(_strategy("s1", "y", switch_s=0.0))
        assert time.monotonic() - t0 < 10  # not the 120 s the planner would wait for a replica that says nothing
        assert events[-1] == "switch_rolled_back.v1" and sp.current == {}
