"""`oserve up`, `oserve worker` and `oserve replay` as processes and commands, against a real server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import oserve.cli.live_cmds  # noqa: F401  (registers the live commands)
from oserve.cli import app
from oserve.streams.client import ClientError, OServeClient
from oserve.errors import ConfigError
from oserve.streams.testing import ping_until_up, running_server, unique_subjects

LAUNCH = "import sys, oserve.cli.live_cmds; from oserve.cli import main; main()"


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def test_up_serves_requests_and_drains_on_sigint(server) -> None:
    subjects = unique_subjects()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "up", "--nats", server.url, "--prefix", subjects.prefix, "--http-port", "0", "--metrics-port", "0",
                             "--speedup", "60", "--duration-s", "60"], stderr=subprocess.PIPE, text=True)
    try:
        async def main() -> None:
            client = await OServeClient.connect(server.url, subjects=subjects)
            await ping_until_up(client, 30)
            replies = await asyncio.gather(*[client.submit(input_tokens=100 + i, max_tokens=20, timeout_s=10)
                                             for i in range(10)])
            assert all(r.output_tokens == 20 for r in replies)
            await client.close()

        await asyncio.wait_for(main(), 40)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "draining" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_refuses_an_unknown_name() -> None:
    result = CliRunner().invoke(app, ["worker", "janitor", "--nats", "nats://127.0.0.1:1"])
    assert isinstance(result.exception, ConfigError)


def test_replay_against_a_running_system_reports_json(server) -> None:
    subjects = unique_subjects()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "up", "--nats", server.url, "--prefix", subjects.prefix, "--http-port", "0", "--metrics-port", "0",
                             "--speedup", "60", "--duration-s", "60"], stderr=subprocess.DEVNULL)
    try:
        async def wait_up() -> None:
            client = await OServeClient.connect(server.url, subjects=subjects)
            await ping_until_up(client, 30)
            await client.close()

        asyncio.run(wait_up())
        result = CliRunner().invoke(app, ["replay", "azure-conv", "--minutes", "0.5", "--speedup", "60",
                                          "--nats", server.url, "--prefix", subjects.prefix, "--timeout-s", "20",
                                          "--json"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.output)
        assert summary["requests"] > 0 and summary["answered"] == summary["requests"]
        assert summary["lost"] == 0 and summary["errors"] == 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_each_worker_runs_as_its_own_process(server) -> None:
    subjects = unique_subjects()
    names = ("engines", "switch-planner", "gateway", "forecaster", "scheduler")  # consumers first
    epoch = str(time.time())  # one clock for all of them
    procs = [subprocess.Popen([sys.executable, "-c", LAUNCH, "worker", name, "--nats", server.url,
                               "--prefix", subjects.prefix, "--speedup", "60", "--duration-s", "60",
                               "--epoch", epoch],
                              stderr=subprocess.PIPE, text=True) for name in names]
    try:
        async def main() -> None:
            client = await OServeClient.connect(server.url, subjects=subjects)
            await ping_until_up(client, 40)
            replies = await asyncio.gather(*[client.submit(input_tokens=300, max_tokens=30, timeout_s=10)
                                             for _ in range(20)])
            assert {r.replica_id.split("-")[0] for r in replies} == {"s0"}  # the scheduler's first strategy
            await client.close()

        await asyncio.wait_for(main(), 50)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                _, err = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            assert p.returncode == 0, err


def test_log_lines_carry_no_password() -> None:
    from oserve.cli.live_cmds import redact_url

    assert redact_url("nats://worker:s3cret@nats:4222") == "nats://worker:***@nats:4222"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


async def test_a_connect_error_carries_no_password() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        with pytest.raises(ClientError) as info:
            await OServeClient.connect(f"nats://worker:s3cret@127.0.0.1:{port}", connect_timeout_s=0.5)
        assert "s3cret" not in str(info.value) and "worker:***@127.0.0.1" in str(info.value)

    await asyncio.wait_for(main(), 30)


def test_the_nats_url_can_come_from_the_environment() -> None:
    result = CliRunner().invoke(app, ["worker", "janitor"], env={"OSERVE_NATS_URL": "nats://127.0.0.1:1"})
    assert isinstance(result.exception, ConfigError)  # got past the required --nats option
    assert CliRunner().invoke(app, ["worker", "janitor"], env={"OSERVE_NATS_URL": None}).exit_code == 2
