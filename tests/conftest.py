"""Shared test settings: hypothesis profiles sized for a 2-core CI machine."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

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
                       gateway_kwargs=None, engine_kwargs=None):
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
                                                 clock))
    await gw.wait_for_replicas(len(replica_ids), 5.0)
    return nc, subjects, gw, engines, OServeClient(nc, subjects, default_timeout_s=10.0)
