"""`oserve bench chaos` end to end: workers as separate processes, one fault of each family, real files."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from oserve.workers.chaos import BASELINE, DOCUMENTED_CODES, ChaosConfig


def test_chaos_config_refuses_an_unknown_fault() -> None:
    from oserve.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown"):
        ChaosConfig(faults=("engines", "meteor"))


def test_chaos_bench_loses_nothing_and_answers_once_through_an_engine_kill_and_a_nats_restart(
        monkeypatch, capsys, tmp_path) -> None:
    code, out, _ = run_cli(monkeypatch, capsys, "bench", "chaos", "--faults", "engines,nats-short",
                           "--phase-s", "8", "--json", "--out", str(tmp_path))
    assert code == 0
    result = json.loads(out)
    assert [p["fault"] for p in result["phases"]] == [BASELINE, "engines", "nats-short"]
    for p in result["phases"]:
        assert p["sent"] == 64 and p["answered"] + sum(p["errors"].values()) == p["sent"], p
        assert p["lost"] == 0 and p["answered_twice"] == 0, p
        assert set(p["errors"]) <= DOCUMENTED_CODES, p
    engines = result["phases"][1]
    assert engines["fault_at_s"] >= 3.0 and engines["recovery_s"] < 8.0
    assert result["meets_targets"] is True
    saved = json.loads((tmp_path / "chaos.json").read_text())
    assert saved["totals"] == result["totals"] and (tmp_path / "chaos.png").stat().st_size > 10_000
