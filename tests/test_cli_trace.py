"""Tests of `oserve trace stats`: output on the bundled trace, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli




def test_stats_json_on_bundled_trace(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "trace", "stats", "azure-conv", "--out", str(tmp_path),
                             "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["requests"] == 19_366
    assert summary["duration_s"] == pytest.approx(3501.7, abs=0.1)
    assert summary["input_tokens"]["p50"] == 1020 and summary["input_tokens"]["p90"] == pytest.approx(2734.5)
    assert summary["output_tokens"]["p99"] == 601
    assert summary["num_spans"] == 58  # 3501.7 s: 58 full minutes, the partial one dropped
    assert [t["name"] for t in summary["types"]] == ["SISO", "SILO", "LISO", "LILO"]
    assert sum(t["share"] for t in summary["types"]) == pytest.approx(1.0)
    assert all(t["mix_cv"] > t["mix_cv_noise"] > 0 for t in summary["types"])
    png = tmp_path / "trace_stats.png"
    assert summary["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                     tmp_path: Path) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = run_cli(monkeypatch, capsys, "trace", "stats", "azure-code", "--out", str(tmp_path),
                             "--span", "300", "--k", "3")
    assert code == 0, err
    assert "8,819" in out and "T0" in out and "T2" in out and "mix CV" in out
    assert (tmp_path / "trace_stats.png").exists()


def test_stats_on_jsonl_file(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                             tmp_path: Path) -> None:
    lines = [json.dumps({"timestamp": i * 0.5, "input_length": 10 + (i * 37) % 4000,
                         "output_length": 5 + (i * 11) % 500}) for i in range(400)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run_cli(monkeypatch, capsys, "trace", "stats", str(path), "--out", str(tmp_path),
                             "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["requests"] == 400 and summary["num_spans"] == 3


@pytest.mark.parametrize("content, args, expected", [
    (None, [], "trace file not found"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,2\n2023-11-16 18:15:47,-1,2\n",
     [], "line 3: negative token count in ContextTokens: -1"),
    ("TIMESTAMP,Context\n2023-11-16 18:15:46.68,1\n", [], "missing columns ContextTokens, GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", [], "empty trace"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,2\n", ["--span", "0"],
     "--span must be a positive number"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,2\n", [],
     "k=4 types need at least 4 distinct"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path, content: str | None, args: list[str],
                                          expected: str) -> None:
    path = tmp_path / "bad.csv"
    if content is not None:
        path.write_text(content)
    code, out, err = run_cli(monkeypatch, capsys, "trace", "stats", str(path), "--out", str(tmp_path), *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert expected in err
    assert not (tmp_path / "trace_stats.png").exists()


def test_entry_point_in_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n'
                    '{"timestamp": "soon", "input_length": 3, "output_length": 1}\n')
    proc = subprocess.run([sys.executable, "-c", "from oserve.cli import main; main()",
                           "trace", "stats", str(path), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: line 2: cannot parse timestamp 'soon'; expected seconds as a number"]
