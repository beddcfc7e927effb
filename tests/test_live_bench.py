"""`oserve bench bus --json` runs end to end (small counts; the full-size figures are in the report)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import oserve.cli.live_cmds  # noqa: F401  (registers the live commands)
from oserve.cli import app


def test_bench_bus_prints_the_figures() -> None:
    result = CliRunner().invoke(app, ["bench", "bus", "--json", "--requests", "1500", "--latency-requests", "300",
                                      "--concurrency", "32"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    for key in ("routed_per_s", "echo_per_s", "ratio", "p99_added_ms"):
        assert figures[key] == figures[key]  # not NaN
    assert figures["routed_per_s"] > 0 and figures["echo_per_s"] > 0
    assert figures["ratio"] > 0.2  # loose: a 2-core CI box shares its cores with the server
