"""The client under faults, against a real nats-server: killed (SIGKILL) mid-replay and restarted on its
port, gone for good, answering twice; and `oserve replay` as a client user under auth."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner

from oserve.cli import app
from oserve.streams.client import (CannotConnect, ClientError, ConnectionLost, OServeClient, ReconnectPolicy,
                                   RequestTimeout)
from oserve.streams.schemas import COPY_HEADER, UNACCEPTED_COPY, Reply, decode, encode
from oserve.streams.server import find_nats_server
from oserve.streams.testing import unique_subjects, wait_until
from oserve.traces import Request, Trace
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.system import connect, replay


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KillableServer:
    """A nats-server on a fixed port that the test can SIGKILL and start again on that port."""

    def __init__(self, config_text: str = "") -> None:
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="oserve-faults-")
        self._config = None
        if config_text:
            self._config = Path(self._tmp.name) / "nats.conf"
            self._config.write_text(config_text)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> KillableServer:
        cmd = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self._tmp.name]
        if self._config is not None:
            cmd += ["-c", str(self._config)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:  # ready once it takes a connection
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"nats-server did not start on port {self.port}")
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.kill()
        self._tmp.cleanup()


@pytest.fixture
def server():
    s = KillableServer().start()
    try:
        yield s
    finally:
        s.close()


async def close_quietly(nc) -> None:
    """Close a worker connection; nats-py raises when it closes one still holding buffered publishes on a lost
    socket (a worker's trouble, not what these tests are about)."""
    try:
        await nc.close()
    except OSError:
        pass


async def start_system(stack: AsyncExitStack, url: str, subjects, speedup: float = 50.0) -> Gateway:
    """A gateway and an engine (sim) on a worker connection that reconnects forever (`system.connect`)."""
    nc = await connect(url, "faults-workers")
    stack.push_async_callback(close_quietly, nc)
    clock = Clock(speedup=speedup)
    await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig("r0", subjects=subjects,
                                                                        heartbeat_interval_wall_s=0.05), clock))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
    await gw.wait_for_replicas(1, 5.0)
    return gw


def small_trace(num: int, duration_s: float) -> Trace:
    return Trace.from_requests([Request(f"f{i}", duration_s * i / num, 30 + i % 50, 1 + i % 8)
                                for i in range(num)], name="faults")


async def test_replay_rides_out_a_nats_kill_and_accounts_for_every_request(server) -> None:
    """SIGKILL the server 1.5 s into a 5 s replay, start it again 3 s later on the same port: the client
    reconnects, no exception escapes, and every request is answered or counted under an error code."""
    subjects = unique_subjects()
    trace = small_trace(400, 5.0)

    async def main() -> dict:
        async with AsyncExitStack() as stack:
            await start_system(stack, server.url, subjects)
            client = await OServeClient.connect(server.url, subjects=subjects,
                                                reconnect=ReconnectPolicy(backoff_max_s=0.5))
            stack.push_async_callback(client.close)

            async def outage() -> None:
                await asyncio.sleep(1.5)
                server.kill()
                await asyncio.sleep(3.0)
                await asyncio.to_thread(server.start)

            fault = asyncio.create_task(outage())
            result = await replay(client, trace, 1.0, timeout_s=8.0, settle_s=0.5)
            await fault
            return result

    r = await asyncio.wait_for(main(), 25)
    print({k: v for k, v in r.items() if k not in ("switch_events",)})
    assert r["sent"] == r["requests"] == len(trace)
    assert r["answered"] + r["errors"] + r["lost"] == r["sent"] and r["unaccounted"] == 0
    assert sum(r["error_codes"].values()) == r["errors"] + r["lost"]
    assert r["reconnects"] >= 1
    assert not any(code.startswith("unexpected") for code in r["error_codes"]), r["error_codes"]
    # requests sent during the outage wait in the reconnect buffer; those lost with the connection are sent
    # again: most of the trace is answered despite 3 s of 5 without a server
    assert r["answered"] >= 0.5 * len(trace), r


async def test_a_server_that_never_returns_gives_connection_lost_not_nats_errors(server) -> None:
    subjects = unique_subjects()

    async def main() -> None:
        async with AsyncExitStack() as stack:
            await start_system(stack, server.url, subjects)
            forever = await OServeClient.connect(server.url, subjects=subjects)  # reconnects forever
            stack.push_async_callback(forever.close)
            bounded = await OServeClient.connect(server.url, subjects=subjects,
                                                 reconnect=ReconnectPolicy(give_up_after_s=1.0))
            stack.push_async_callback(bounded.close)
            assert (await bounded.submit(input_tokens=20, max_tokens=2, timeout_s=5)).output_tokens >= 1
            server.kill()
            t = time.monotonic()
            # waiting when the server dies; then given up after a second down
            with pytest.raises(ConnectionLost) as info:
                await bounded.submit(input_tokens=20, max_tokens=2, timeout_s=10)
            assert info.value.code == "connection_lost" and time.monotonic() - t < 5
            with pytest.raises(ConnectionLost):  # the connection is closed now: refused at once
                await bounded.submit(input_tokens=20, max_tokens=2, timeout_s=10)
            # reconnecting forever: the request waits in the buffer, and its wait ends typed
            with pytest.raises(ConnectionLost):
                await forever.submit(input_tokens=20, max_tokens=2, timeout_s=1.0)
            with pytest.raises(ConnectionLost):
                async for _ in forever.stream(input_tokens=20, max_tokens=2, timeout_s=0.5):
                    pass
            assert forever.nc.is_reconnecting and not forever.nc.is_closed

    await asyncio.wait_for(main(), 20)


async def test_a_connect_to_nobody_is_bounded_and_typed() -> None:
    port = free_port()
    t = time.monotonic()
    with pytest.raises(CannotConnect) as info:
        await OServeClient.connect(f"nats://alice:s3cret@127.0.0.1:{port}", connect_timeout_s=0.5)
    assert time.monotonic() - t < 3
    assert isinstance(info.value, ClientError) and info.value.code == "cannot_connect"
    assert "s3cret" not in str(info.value) and "alice:***@" in str(info.value)


async def test_an_answer_that_comes_twice_is_counted(server) -> None:
    """A responder that answers every request twice on its inbox: the client returns the first answer and
    counts the second (`num_duplicates`); an answer after the client gave up counts as late."""
    subjects = unique_subjects()

    async def main() -> None:
        nc = await nats.connect(server.url)
        held: list = []

        async def answer_twice(msg) -> None:
            req = decode(msg.data, object)
            rid = req["request_id"] if isinstance(req, dict) else ""
            if rid.startswith("slow"):
                held.append(msg)
                return
            body = encode(Reply(request_id=rid, replica_id="x", input_tokens=1, output_tokens=1, type_index=0,
                                ttft_s=0.0, e2e_s=0.0))
            await nc.publish(msg.reply, body)
            await nc.publish(msg.reply, body)

        await nc.subscribe(subjects.submit(), cb=answer_twice)
        await nc.flush()
        async with await OServeClient.connect(server.url, subjects=subjects) as client:
            for i in range(3):
                await client.submit(input_tokens=5, request_id=f"dup{i}", timeout_s=5)
            await wait_until(lambda: client.num_duplicates == 3, 5, "the second answers to be counted")
            with pytest.raises(RequestTimeout):
                await client.submit(input_tokens=5, request_id="slow1", timeout_s=0.3)
            body = encode(Reply(request_id="slow1", replica_id="x", input_tokens=1, output_tokens=1, type_index=0,
                                ttft_s=0.0, e2e_s=0.0))
            await nc.publish(held[0].reply, body)
            await nc.publish(held[0].reply, body)
            await wait_until(lambda: client.num_late == 1 and client.num_duplicates == 4, 5,
                             "the late answer and its duplicate to be counted")
            # NATS's "no responders" status after an answer (a resend that reached no gateway) is no answer
            await nc.publish(held[0].reply, b"", headers={"Status": "503"})
            await wait_until(lambda: client.num_late_statuses == 1, 5, "the status to be seen")
            assert client.num_duplicates == 4
        await nc.close()

    await asyncio.wait_for(main(), 20)


AUTH_CONF = """
authorization {{
  users: [
    {{ user: worker, password: wpw, permissions: {{ publish: [">"], subscribe: [">"] }} }}
    {{ user: alice, password: apw,
      permissions: {{ publish: ["{p}.req.u.alice.submit", "{p}.req.u.alice.cancel"], subscribe: ["_INBOX_{p}.alice.>"] }} }}
  ]
}}
"""


def test_replay_as_a_client_user_under_auth_uses_its_inbox_and_prints_no_password() -> None:
    """`oserve replay --user alice` (password from OSERVE_NATS_PASSWORD) against a server whose client user
    may publish requests and read its own inbox only: every request is answered, nothing hangs."""
    subjects = unique_subjects()
    auth = KillableServer(AUTH_CONF.format(p=subjects.prefix)).start()
    stop = threading.Event()
    up = threading.Event()
    failure: list[BaseException] = []

    def system() -> None:  # the workers, in a thread of their own (the CLI runs its own event loop)
        async def run() -> None:
            async with AsyncExitStack() as stack:
                host = auth.url.replace("nats://", "nats://worker:wpw@")
                await start_system(stack, host, subjects, speedup=200.0)
                up.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            failure.append(exc)
            up.set()

    thread = threading.Thread(target=system, daemon=True)
    thread.start()
    try:
        assert up.wait(15) and not failure, failure
        result = CliRunner().invoke(app, ["replay", "azure-conv", "--minutes", "0.2", "--speedup", "60",
                                          "--nats", auth.url, "--user", "alice", "--prefix", subjects.prefix,
                                          "--timeout-s", "10"],
                                    env={"OSERVE_NATS_PASSWORD": "apw"})
        assert result.exit_code == 0, (result.output, result.exception)
        assert "apw" not in result.output
        rows = dict(line.split(":", 1) for line in result.output.splitlines() if ":" in line)
        rows = {k.strip(): v.strip() for k, v in rows.items()}
        assert int(rows["requests"]) > 0 and rows["answered"] == rows["requests"] == rows["sent"], result.output
        assert rows["lost"] == "0" and rows["errors"] == "0" and rows["switches"] == "None"
        # the user named in the URL alone picks the inbox too
        creds = auth.url.replace("nats://", "nats://alice:apw@")
        result = CliRunner().invoke(app, ["replay", "azure-conv", "--minutes", "0.1", "--speedup", "60", "--nats",
                                          creds, "--prefix", subjects.prefix, "--timeout-s", "10", "--json"])
        assert result.exit_code == 0, (result.output, result.exception)
        summary = json.loads(result.output)
        assert summary["answered"] == summary["sent"] > 0 and summary["switches"] is None
    finally:
        stop.set()
        thread.join(10)
        auth.close()


async def test_the_outage_bench_reports_every_request() -> None:
    from oserve.workers.bench import OutageBenchConfig, run_outage_bench

    config = OutageBenchConfig(num_requests=200, duration_s=4.0, outage_at_s=1.0, outage_s=2.0, timeout_s=10.0,
                               settle_s=0.2)
    r = await asyncio.wait_for(run_outage_bench(config, unique_subjects()), 25)
    assert r["sent"] == 200 and r["unaccounted"] == 0 and r["reconnects"] >= 1
    assert r["answered"] + r["errors"] + r["lost"] == 200 and r["outage_s"] == 2.0


async def test_a_copy_after_a_reconnect_goes_unmarked(server) -> None:
    """A copy sent for want of a confirmation is marked `unaccepted` (`COPY_HEADER`: what was sent to its inbox
    reached it) only while the connection it last went out on is up. The first copy after a reconnect goes
    unmarked, so a gateway forwards it and an engine that answered sends its stored answer again; the next
    ones, on the connection that copy went out on, are marked again."""
    subjects = unique_subjects()

    async def main() -> None:
        client = await OServeClient.connect(server.url, subjects=subjects, reconnect=ReconnectPolicy(
            accept_timeout_s=0.2, resend_on_reconnect=False))  # only the confirmation's timer publishes again
        seen: list[tuple[int, str | None]] = []  # (the client's connection, the mark) of each publish

        async def silent_gateway(msg) -> None:  # on the client's own connection: it sees every publish there
            seen.append((client._generation(), (msg.headers or {}).get(COPY_HEADER)))
        await client.nc.subscribe(subjects.submit(), cb=silent_gateway)
        task = asyncio.create_task(client.submit(input_tokens=10, max_tokens=4, request_id="g1", timeout_s=8.0))
        await wait_until(lambda: len(seen) >= 2, 5, "a first copy")
        server.kill()
        server.start()
        await wait_until(lambda: sum(g >= 1 for g, _ in seen) >= 2, 8, "two copies after the reconnect")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        before = [mark for g, mark in seen if g == 0]
        after = [mark for g, mark in seen if g >= 1]
        assert before[0] is None and all(m == UNACCEPTED_COPY for m in before[1:]), seen
        assert after[0] is None and all(m == UNACCEPTED_COPY for m in after[1:]), seen

    await asyncio.wait_for(main(), 20)
