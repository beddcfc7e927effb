"""`oserve forecast` and `oserve bench forecast` through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)




def test_forecast_json_and_png(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "forecast", "--trace", "azure-conv", "--span", "30",
                             "--model", "lv,ma,hw,sn", "--out", str(tmp_path), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["spans"] == 116 and res["train_spans"] == 104
    assert set(res["rrmse"]) == {"last_value", "moving_average", "holt_winters", "seasonal_naive"}
    assert set(res["rrmse_per_type"]["last_value"]) == {"SISO", "SILO", "LISO", "LILO"}
    assert 0 < res["noise_floor"] < res["rrmse"]["last_value"]
    assert Path(res["png"]).is_file() and Path(res["png"]).stat().st_size > 10_000


def test_forecast_table_lstm_on_a_short_trace_shortens_its_lookback(monkeypatch, capsys, tmp_path):
    model = tmp_path / "m.json"
    code, out, err = run_cli(monkeypatch, capsys, "forecast", "--trace", "azure-conv", "--model", "lstm",
                             "--out", str(tmp_path), "--save-model", str(model))
    assert code == 0, err
    assert "lstm" in out and "noise floor" in out and "lookback shortened to 26" in out
    from oserve.forecast import load_forecaster

    fc = load_forecaster(model)
    assert fc.lookback_spans == 26 and fc.meta["span_s"] == 60.0 and fc.ready


def test_forecast_errors_are_one_line(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "forecast", "--trace", "azure-conv", "--model", "prophet",
                           "--out", str(tmp_path))
    assert code == 2 and "unknown forecaster 'prophet'" in err
    code, _, err = run_cli(monkeypatch, capsys, "forecast", "--trace", str(tmp_path / "none.csv"))
    assert code == 2 and "not found" in err
    code, _, err = run_cli(monkeypatch, capsys, "forecast", "--trace", "azure-conv", "--span", "5000")
    assert code == 2 and "try a shorter --span" in err


def test_bench_forecast_json_skips_missing_servegen(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "forecast", "--json", "--data-dir", str(tmp_path))
    assert code == 0, err
    res = json.loads(out)
    assert [s["name"] for s in res["skipped"]] == ["servegen_m-large", "servegen_m-mid"]
    assert "not found" in res["skipped"][0]["reason"]
    names = ["lstm", "last_value", "moving_average", "seasonal_naive", "holt_winters"]
    assert [t["name"] for t in res["traces"]] == ["azure-conv", "azure-code"]
    for t in res["traces"]:
        assert t["span_s"] == 10.0 and t["spans"] > 300
        assert list(t["rrmse"]) == names and list(t["latency_ms"]) == names
        assert all(v > 0 for v in t["rrmse"].values())
        assert 0 < t["noise_floor"] < 1
        assert t["latency_ms"]["lstm"] < 10
        assert 0 <= t["arrival_misclassification"]["regressor"] < 1
        assert "lstm_over_noise_floor" in t["targets"]


def _write_servegen(tmp: Path) -> Path:
    """Two clients over 2 x 6 hours of 10-min windows; client 1 has no length rows (like the big ones)."""
    rows = ["client_id,timestamp_s,rate_rps,iat_cv,iat_dist,iat_shape,iat_scale"]
    for c, per_window in ((0, 6), (1, 3)):
        for w in range(72):
            n = 0 if w == 40 else per_window * (1 + w % 3)  # window 40: nobody (a collection gap)
            rows.append(f"{c},{w * 600},{n / 600},1.0,Gamma,1.0,1.0")
    trace = tmp / "servegen_tiny.csv"
    trace.write_text("\n".join(rows) + "\n")
    cols = "client_id,window_start_s,field,n_support,mean,min,p1,p5,p10,p20,p25,p30,p40,p50,p60,p70,p75,p80,p90,p95,p99,p99.9,max"
    lines = [cols]
    for w in (0, 21600):
        short = ",".join(["10"] * 18)
        long_ = ",".join(["2000"] * 18)
        lines.append(f"0,{w},input_tokens,1,10,{short}")
        lines.append(f"0,{w},output_tokens,1,2000,{long_}")
    (tmp / "servegen_tiny_lengths.csv").write_text("\n".join(lines) + "\n")
    return trace


def test_forecast_on_a_servegen_file(monkeypatch, capsys, tmp_path):
    trace = _write_servegen(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "forecast", "--trace", str(trace), "--model", "lv,ma",
                             "--k", "1", "--out", str(tmp_path), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["span_s"] == 600.0 and res["spans"] == 72
    assert "collection-gap" in res["note"]
