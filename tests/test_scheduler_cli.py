"""`oserve plan` and `oserve bench scheduler`: output, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from oserve.cli.plan_cmds import parse_rates
from oserve.errors import ConfigError
from conftest import run_cli

RATES = "SISO=30,SILO=5,LISO=12,LILO=3"




def test_plan_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", "llama2-70b", "--gpus", "16",
                             "--rates", RATES, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["search"] == "milp" and plan["gpus"] == 16 and plan["types"] == ["SISO", "SILO", "LISO", "LILO"]
    assert plan["demand_rps"] == {"SISO": 30.0, "SILO": 5.0, "LISO": 12.0, "LILO": 3.0}
    gpus = [g for r in plan["replicas"] for g in r["gpu_ids"]]
    assert len(gpus) == len(set(gpus)) and max(gpus) < 16
    for r in plan["replicas"]:
        assert r["num_gpus"] == r["tp"] * r["pp"] == len(r["gpu_ids"])
        assert 0 <= r["utilisation"] <= 1 + 1e-9
    served = sum(x for row in plan["assignment_rps"].values() for x in row.values())
    assert served == pytest.approx(plan["throughput_rps"])
    assert 0 < plan["throughput_rps"] <= plan["total_demand_rps"] * (1 + 1e-9)
    assert plan["peak_utilisation"] == pytest.approx(max(r["utilisation"] for r in plan["replicas"]))
    assert plan["solve_s"] >= 0


@pytest.mark.parametrize("search", ["paper", "exhaustive"])
def test_plan_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], search: str) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--gpus", "8", "--rates", RATES, "--search", search)
    assert code == 0, err
    for word in ("replica", "GPU ids", "Assignment", "SISO", "LILO", "served", "peak utilisation", f"{search} search"):
        assert word in out


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-9", "--rates", RATES], "unknown model 'gpt-9'"),
    (["--rates", "SISO=-3,SILO=5,LISO=12,LILO=3"], "rate of SISO must be a finite number >= 0"),
    (["--rates", "SISO=30,SILO=5,LISO=12"], "no rate given for workload type(s) LILO"),
    (["--rates", "SISO=30,SILO=five,LISO=12,LILO=3"], "rate of SILO is not a number"),
    (["--rates", "SISO30"], "cannot parse 'SISO30'"),
    (["--rates", ""], "--rates is empty"),
    (["--rates", "SISO=1,SISO=2"], "type SISO is given twice"),
    (["--rates", RATES + ",XL=4"], "unknown workload type 'XL'"),
    (["--gpus", "1", "--rates", RATES], "llama2-70b fits on no replica of the 1-GPU cluster"),
    (["--gpus", "12", "--rates", RATES], "not a whole number of 8-GPU nodes"),
    (["--search", "greedy", "--rates", RATES], "unknown search 'greedy'; known: milp, paper, exhaustive"),
    (["--search", "exhaustive", "--gpus", "32", "--rates", RATES], "exhaustive search is limited to 16 GPUs"),
])
def test_plan_bad_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                        args: list[str], message: str) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "plan", *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_plan_missing_rates_option(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--gpus", "8")
    assert code == 2 and "--rates" in err


def test_parse_rates() -> None:
    assert parse_rates(" SISO = 1.5 ,LILO=0") == {"SISO": 1.5, "LILO": 0.0}
    for bad in ("SISO=inf", "SISO=nan", "=3", "SISO="):
        with pytest.raises(ConfigError):
            parse_rates(bad)


def test_bench_scheduler_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "bench", "scheduler", "--json", "--gpus", "8,32",
                             "--mixes", "S1,S5")
    assert code == 0, err
    cases = json.loads(out)["cases"]
    assert len(cases) == 2 * 3 + 2 * 2  # exhaustive only on 8 GPUs
    for case in cases:
        assert {"gpus", "mix", "search", "seconds", "throughput", "ratio_to_exhaustive"} <= set(case)
        assert case["throughput"] <= case["demand_rps"] * (1 + 1e-9)
        if case["gpus"] == 8:
            assert case["ratio_to_exhaustive"] <= 1 + 1e-9
            if case["search"] == "milp":
                assert case["ratio_to_exhaustive"] >= 0.999
        else:
            assert case["ratio_to_exhaustive"] is None
    assert {c["search"] for c in cases if c["gpus"] == 32} == {"milp", "paper"}


def test_bench_scheduler_bad_mix(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "bench", "scheduler", "--mixes", "S9")
    assert code == 2 and "unknown mix 'S9'" in err
