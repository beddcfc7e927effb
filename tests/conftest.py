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
