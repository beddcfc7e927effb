"""Shared test settings: hypothesis profiles sized for a 2-core CI machine, and a dump of every asyncio
task's stack when an async test runs long (pytest-timeout shows threads only, and a hung test's threads all sit
in the event loop's select)."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

TASK_DUMP_AFTER_S = float(os.environ.get("OSERVE_TEST_TASK_DUMP_S", "300"))
"""An async test still running after this long prints where each of its tasks waits (stderr, once)."""


def _dump_tasks(name: str) -> None:
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    print(f"\n--- {name}: still running after {TASK_DUMP_AFTER_S:g} s; {len(tasks)} asyncio tasks ---", file=out)
    for task in tasks:
        task.print_stack(limit=12, file=out)
    sys.stderr.write(out.getvalue())


@pytest.fixture
async def _dump_tasks_when_slow(request):
    """Schedules the task dump on the test's own loop; cancelled when the test ends."""
    handle = asyncio.get_running_loop().call_later(TASK_DUMP_AFTER_S, _dump_tasks, request.node.nodeid)
    yield
    handle.cancel()


def pytest_collection_modifyitems(items) -> None:
    for item in items:  # async tests only: a sync test has no loop to watch
        if asyncio.iscoroutinefunction(getattr(item, "function", None)):
            item.fixturenames.append("_dump_tasks_when_slow")


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run `oserve ARGS` in this process through the real entry point; returns (code, stdout, stderr)."""
    from oserve.cli import main

    monkeypatch.setattr(sys, "argv", ["oserve", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


FAST_HB = dict(heartbeat_interval_wall_s=0.05)
"""Engine heartbeats fast enough for tests to see a replica come and go within a second."""


async def start_system(stack, url: str, replica_ids=("r0", "r1"), speedup: float = 50.0,
                       gateway_kwargs=None, engine_kwargs=None, estimator=None):
    """A gateway and simulated engines on one connection to `url`, under a fresh prefix, closed with `stack`;
    returns (nc, subjects, gateway, engines, a client)."""
    import nats

    from oserve.streams.client import OServeClient
    from oserve.streams.testing import unique_subjects
    from oserve.workers.clock import Clock
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig
    from oserve.workers.gateway import Gateway, GatewayConfig

    subjects = unique_subjects()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    clock = Clock(speedup=speedup)
    engines = []
    for rid in replica_ids:
        cfg = EngineWorkerConfig(rid, subjects=subjects, **{**FAST_HB, **(engine_kwargs or {})})
        engines.append(await stack.enter_async_context(EngineWorker(nc, cfg, clock)))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects, **(gateway_kwargs or {})),
                                                 clock, estimator=estimator))
    await gw.wait_for_replicas(len(replica_ids), 5.0)
    return nc, subjects, gw, engines, OServeClient(nc, subjects, default_timeout_s=10.0)
