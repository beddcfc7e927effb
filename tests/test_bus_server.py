"""The embedded nats-server, JetStream setup and the deploy/ permissions, against a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.api import StorageType

from oserve.streams.jetstream import ensure_streams, stream_configs
from oserve.streams.server import NatsServer, NatsServerError, find_nats_server
from oserve.streams.subjects import Subjects
from oserve.streams.testing import running_server, unique_subjects

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def test_launcher_finds_binary_and_parses_port(server: NatsServer) -> None:
    assert Path(find_nats_server()).name.startswith("nats-server")
    assert server.port and server.port > 0
    assert "Server is ready" in server.log_tail(400)


def test_launcher_reports_a_bad_binary() -> None:
    with pytest.raises((NatsServerError, OSError)):
        NatsServer(binary="/bin/false", ready_timeout_s=2).start()


def test_stop_is_idempotent() -> None:
    srv = NatsServer().start()
    srv.stop()
    srv.stop()


async def test_streams_and_bucket_setup_is_idempotent(server: NatsServer) -> None:
    subjects = unique_subjects()

    async def main() -> None:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        kv1 = await ensure_streams(js, subjects)
        await kv1.put(Subjects.STRATEGY_KEY, b'{"strategy_id": "s0"}')
        kv2 = await ensure_streams(js, subjects)  # second call: same streams, same bucket, data kept
        assert (await kv2.get(Subjects.STRATEGY_KEY)).value == b'{"strategy_id": "s0"}'
        for cfg in stream_configs(subjects):
            info = await js.stream_info(cfg.name)
            assert info.config.storage == StorageType.FILE
        ack = await js.publish(subjects.completions(), b"{}", headers={"Nats-Msg-Id": "x1"})
        dup = await js.publish(subjects.completions(), b"{}", headers={"Nats-Msg-Id": "x1"})
        assert dup.duplicate and dup.seq == ack.seq
        await nc.close()

    await asyncio.wait_for(main(), 20)


async def test_jetstream_state_survives_a_server_restart() -> None:
    subjects = unique_subjects()
    srv = NatsServer().start()
    try:
        async def write() -> None:
            nc = await nats.connect(srv.url)
            kv = await ensure_streams(nc.jetstream(), subjects)
            await kv.put(Subjects.STRATEGY_KEY, b"v1")
            await nc.jetstream().publish(subjects.arrivals(), b"{}")
            await nc.close()

        async def read() -> None:
            nc = await nats.connect(srv.url)
            js = nc.jetstream()
            assert (await (await js.key_value(subjects.strategy_bucket())).get(Subjects.STRATEGY_KEY)).value == b"v1"
            assert (await js.stream_info(subjects.stream_arrivals())).state.messages == 1
            await nc.close()

        await asyncio.wait_for(write(), 20)
        srv.restart()
        await asyncio.wait_for(read(), 20)
    finally:
        srv.stop()


async def test_deploy_permissions_let_clients_submit_and_read_only_their_replies() -> None:
    subjects = Subjects("oserve")  # the permissions name the production prefix

    async def main(url: str) -> None:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        worker = await nats.connect(url, user="worker", password="test-worker")
        async def answer(msg) -> None:
            await worker.publish(msg.reply, b"ok")

        echo = await worker.subscribe(subjects.users_submit(), cb=answer)
        alice = await nats.connect(url, user="alice", password="test-alice", error_cb=on_error,
                                   inbox_prefix=f"{subjects.reply_prefix()}.alice")
        assert (await alice.request(subjects.user_submit("alice"), b"hi", timeout=5)).data == b"ok"
        # anything else is refused by the server: publishing a plan, reading another inbox, submitting on the
        # shared subject (where the reply is not tied to her) or on bob's
        await alice.publish(subjects.plan_event("strategy"), b"forged")
        await alice.subscribe(f"{subjects.reply_prefix()}.bob.>")
        await alice.publish(subjects.submit(), b"hi", reply=f"{subjects.reply_prefix()}.bob.x.1")
        await alice.publish(subjects.user_submit("bob"), b"hi", reply=f"{subjects.reply_prefix()}.bob.x.1")
        await alice.flush()
        for _ in range(50):
            if len(errors) >= 4:
                break
            await asyncio.sleep(0.05)
        assert len(errors) >= 4 and all("ermissions" in str(e) for e in errors), errors
        await echo.unsubscribe()
        await alice.close()
        await worker.close()

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url), 20)


async def test_the_request_path_works_under_the_deploy_permissions() -> None:
    from oserve.streams.client import OServeClient
    from oserve.streams.jetstream import ensure_streams
    from oserve.workers.clock import Clock
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig
    from oserve.workers.gateway import Gateway, GatewayConfig

    subjects = Subjects("oserve")

    async def main(url: str) -> None:
        worker = await nats.connect(url, user="worker", password="test-worker")
        await ensure_streams(worker.jetstream(), subjects)
        clock = Clock(speedup=50)
        async with EngineWorker(worker, EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05),
                                clock), Gateway(worker, GatewayConfig(subjects=subjects), clock) as gw:
            await gw.wait_for_replicas(1, 5)
            errors: list[Exception] = []  # permission violations the server reports

            async def on_error(exc: Exception) -> None:
                errors.append(exc)

            alice = await nats.connect(url, user="alice", password="test-alice", error_cb=on_error,
                                       inbox_prefix=f"{subjects.reply_prefix()}.alice")
            client = OServeClient(alice, subjects, owns_connection=True, user="alice")
            reply = await client.submit(prompt="hello there", max_tokens=5, timeout_s=5)
            assert reply.output_tokens == 5 and reply.replica_id == "r0"
            # a client may cancel its own stream: the cancel gets through the permissions to the gateway
            stream = client.stream(prompt="hello", max_tokens=4000, timeout_s=10)
            async for part in stream:
                break  # the first chunk, then the client goes away
            await stream.aclose()
            for _ in range(100):
                if gw.num_cancelled:
                    break
                await asyncio.sleep(0.05)
            assert gw.num_cancelled == 1 and gw.num_cancels_ignored == 0 and not errors, errors
            await client.close()
        await worker.close()

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url), 20)


async def test_the_telemetry_stream_keeps_heartbeats_and_telemetry_for_a_bounded_time(server: NatsServer) -> None:
    subjects = unique_subjects()

    async def main() -> None:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        info = await js.stream_info(subjects.stream_telemetry())
        assert info.config.storage == StorageType.FILE
        assert info.config.max_age == 3600.0 and 0 < info.config.max_bytes <= 1 << 30
        await nc.publish(subjects.heartbeat("r0"), b"{}")  # core publishes: the stream captures them
        await nc.publish(subjects.telemetry("r0"), b"{}")
        await nc.flush()
        for _ in range(100):
            if (await js.stream_info(subjects.stream_telemetry())).state.messages == 2:
                break
            await asyncio.sleep(0.02)
        assert (await js.stream_info(subjects.stream_telemetry())).state.messages == 2
        await nc.close()

    await asyncio.wait_for(main(), 20)


async def test_the_telemetry_user_reads_the_streams_and_publishes_nothing() -> None:
    from oserve.observability.top import TopConfig, snapshot_once
    from oserve.streams.schemas import Heartbeat, StrategyChosen, encode

    subjects = Subjects("oserve")  # the permissions name the production prefix

    async def main(url: str) -> None:
        worker = await nats.connect(url, user="worker", password="test-worker")
        await ensure_streams(worker.jetstream(), subjects)
        await worker.publish(subjects.heartbeat("r0"), encode(Heartbeat(
            replica_id="r0", at_s=1.0, num_waiting=2, num_running=3)))
        await worker.publish(subjects.plan_event("strategy"), encode(StrategyChosen(
            strategy_id="s1", span_index=1, replicas=[], weights=[], switch_s=0.0, forecast_rps=[])))
        await worker.flush()
        await asyncio.sleep(0.1)

        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        tele = await nats.connect(url, user="telemetry", password="test-telemetry", error_cb=on_error,
                                  inbox_prefix=f"{subjects.reply_prefix()}.telemetry")
        live: list[str] = []

        async def on_plan(msg) -> None:
            live.append(msg.subject)

        # subscribed before its first request: a subscription made just after one sometimes missed the first
        # message in this test (nats-server 2.15.1, this user's permissions); TelemetryFeed subscribes first too
        sub = await tele.subscribe(subjects.plan_events(), cb=on_plan)
        await tele.flush()
        # it reads the stored heartbeat and strategy by direct get, creating nothing on the server
        view = await snapshot_once(tele, TopConfig(subjects=subjects))
        assert view.heartbeats["r0"].num_running == 3 and view.strategy and view.strategy.strategy_id == "s1"
        tjs = tele.jetstream()
        first = await tjs.get_msg(subjects.stream_plans(), seq=1, direct=True)
        assert first.subject == subjects.plan_event("strategy") and first.data
        last = await tjs.get_last_msg(subjects.stream_telemetry(), subjects.heartbeat("r0"), direct=True)
        assert last.data and last.subject == subjects.heartbeat("r0")
        await worker.publish(subjects.plan_event("forecast"), b"{}")
        await worker.flush()
        for _ in range(50):
            if live:
                break
            await asyncio.sleep(0.02)
        assert live == [subjects.plan_event("forecast")]
        await sub.unsubscribe()
        assert not errors, errors
        # and is refused the rest: submit, plans, control, the arrivals, others' inboxes, stream admin
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await tele.request(subjects.submit(), b"{}", timeout=0.5)
        await tele.publish(subjects.plan_event("strategy"), b"forged")
        await tele.publish(subjects.host_control("h0"), b"forged")
        await tele.publish(f"$JS.API.STREAM.DELETE.{subjects.stream_plans()}", b"")
        await tele.subscribe(subjects.arrivals())
        await tele.subscribe(f"{subjects.reply_prefix()}.alice.>")
        await tele.flush()
        for _ in range(50):
            if len(errors) >= 6:
                break
            await asyncio.sleep(0.05)
        assert len(errors) >= 6 and all("ermissions" in str(e) for e in errors), errors
        assert (await worker.jetstream().stream_info(subjects.stream_plans())).state.messages == 2  # nothing forged
        await tele.close()
        await worker.close()

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url), 30)


async def test_the_telemetry_user_may_not_create_consumers() -> None:
    """A push consumer's deliver subject is not checked against its creator's permissions: one made by the
    telemetry user could re-publish stored plan events onto a control subject, so it may create none."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from oserve.streams.schemas import StrategyChosen, encode

    subjects = Subjects("oserve")  # the permissions name the production prefix

    async def main(url: str) -> None:
        worker = await nats.connect(url, user="worker", password="test-worker")
        wjs = worker.jetstream()
        await ensure_streams(wjs, subjects)
        await wjs.publish(subjects.plan_event("strategy"), encode(StrategyChosen(
            strategy_id="s1", span_index=1, replicas=[], weights=[], switch_s=0.0, forecast_rps=[])))
        hijacked: list[bytes] = []

        async def on_control(msg) -> None:
            hijacked.append(msg.data)

        await worker.subscribe(subjects.host_control("h0"), cb=on_control)
        await worker.flush()

        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        tele = await nats.connect(url, user="telemetry", password="test-telemetry", error_cb=on_error,
                                  inbox_prefix=f"{subjects.reply_prefix()}.telemetry")
        tjs = tele.jetstream(timeout=0.5)
        push = ConsumerConfig(deliver_subject=subjects.host_control("h0"), deliver_policy=DeliverPolicy.ALL,
                              ack_policy=AckPolicy.NONE)
        pull = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
        for stream in (subjects.stream_plans(), subjects.stream_telemetry()):
            for cfg in (push, pull, ConsumerConfig(durable_name="d", ack_policy=AckPolicy.NONE)):
                with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                    await tjs.add_consumer(stream, cfg)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await tjs.pull_subscribe(subjects.plan_events(), stream=subjects.stream_plans())
        await tele.flush()
        for _ in range(50):
            if len(errors) >= 7:
                break
            await asyncio.sleep(0.05)
        assert len(errors) >= 7 and all("ermissions" in str(e) for e in errors), errors
        for stream in (subjects.stream_plans(), subjects.stream_telemetry()):
            assert await wjs.consumers_info(stream) == []
        # history stays readable without a consumer
        msg = await tjs.get_last_msg(subjects.stream_plans(), subjects.plan_event("strategy"), direct=True)
        assert msg.data and msg.subject == subjects.plan_event("strategy")
        await worker.flush()
        assert hijacked == []
        await tele.close()
        await worker.close()

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url), 30)


async def test_oserve_top_follows_new_messages_once_as_the_telemetry_user() -> None:
    from oserve.observability.live_view import LiveView
    from oserve.observability.top import TelemetryFeed, TopConfig
    from oserve.streams.schemas import Heartbeat, SwitchPlanned, encode

    subjects = Subjects("oserve")  # the permissions name the production prefix

    def switch(strategy_id: str) -> bytes:
        return encode(SwitchPlanned(strategy_id=strategy_id, start_ids=["r1"], retire_ids=[], switch_s=1.0))

    async def main(url: str) -> None:
        worker = await nats.connect(url, user="worker", password="test-worker")
        wjs = worker.jetstream()
        await ensure_streams(wjs, subjects)
        await wjs.publish(subjects.plan_event("switch"), switch("s1"))
        tele = await nats.connect(url, user="telemetry", password="test-telemetry",
                                  inbox_prefix=f"{subjects.reply_prefix()}.telemetry")
        view = LiveView(subjects)
        feed = TelemetryFeed(tele, view, TopConfig(subjects=subjects))
        await feed.catch_up()
        assert len(view.switch_log) == 1
        async with asyncio.TaskGroup() as tg:
            follower = tg.create_task(feed.follow())
            await wjs.publish(subjects.plan_event("switch"), switch("s2"))
            await worker.publish(subjects.heartbeat("r1"), encode(Heartbeat(
                replica_id="r1", at_s=1.0, num_waiting=0, num_running=4)))
            await worker.flush()

            async def seen() -> None:
                while "r1" not in view.heartbeats:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(seen(), 5)
            follower.cancel()
        assert [line.split(":")[0] for line in view.switch_log] == ["s1", "s2"]
        await feed.close()
        await tele.close()
        await worker.close()

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url), 30)
