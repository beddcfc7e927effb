"""`oserve --version`, and result tables that fit an 80-column terminal without cutting a number."""

from __future__ import annotations

from rich.console import Console

import oserve
from conftest import run_cli


def test_version(monkeypatch, capsys) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "--version")
    assert (code, out) == (0, f"oserve {oserve.__version__}\n") and oserve.__version__ == "0.1.0"


def test_simulate_tables_fit_80_columns(monkeypatch, capsys) -> None:
    import oserve.cli.sim_cmds as sim_cmds

    console = Console(width=80, record=True)
    monkeypatch.setattr(sim_cmds, "out_console", lambda: console)
    code, _, err = run_cli(monkeypatch, capsys, "simulate", "--trace", "S1", "--minutes", "1", "--history-minutes",
                           "2", "--gpus", "8", "--model", "llama2-7b", "--policy", "oserve,vllm-static,perfect-forecast")
    assert code == 0, err
    text = console.export_text()
    assert "perfect-forecast" in text and "P99/OS" in text
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_other_tables_fit_80_columns(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # rich's Console() takes its width from COLUMNS
    for args in (("bench", "bus", "--requests", "200", "--latency-requests", "50", "--concurrency", "16"),):
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
        assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80, out
