"""`oserve bench switch`: JSON shape and the issue's targets on a quick subset."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from oserve.cli import app
from oserve.cli import switch_cmds  # noqa: F401  (registers `bench switch` until oserve.cli imports it)

KEYS = {"name", "planner", "plan_seconds", "switch_seconds", "lower_bound_seconds", "reload_seconds", "nvlink_bytes",
        "network_bytes"}


def test_bench_switch_json_paper_cases():
    result = CliRunner().invoke(app, ["bench", "switch", "--json", "--model", "llama2-70b", "--model", "opt-66b",
                                      "--gpus", "16", "--no-scheduler", "--no-executor"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"cases", "executor", "targets"} and out["executor"] is None
    cases = out["cases"]
    assert len(cases) == 2 * 2 * 2  # 2 models x 2 paper switches x 2 planners
    for row in cases:
        assert KEYS <= set(row) and row["planner"] in ("greedy", "improved")
        assert row["lower_bound_seconds"] <= row["switch_seconds"] * (1 + 1e-9)
    by = {(r["name"], r["planner"]): r for r in cases}
    for name in {r["name"] for r in cases}:
        imp, gre = by[(name, "improved")], by[(name, "greedy")]
        assert imp["switch_seconds"] <= 1.05 * imp["lower_bound_seconds"] + 1e-12
        assert imp["switch_seconds"] <= gre["switch_seconds"] * (1 + 1e-9)  # times within 1e-9 tie in plan_switch
    assert out["targets"]["improved_within_1_05_of_bound"] and out["targets"]["improved_never_slower_than_greedy"]
    assert out["targets"]["llama2_70b_16gpu_min_reload_over_switch"] >= 10


def test_bench_switch_table():
    result = CliRunner().invoke(app, ["bench", "switch", "--model", "opt-66b", "--gpus", "8", "--no-scheduler",
                                      "--no-executor"])
    assert result.exit_code == 0, result.output
    assert "improved" in result.stdout and "greedy" in result.stdout and "met" in result.stdout
