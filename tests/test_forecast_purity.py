"""The forecasting core and the online types stay pure: no NATS, OpenTelemetry or clock reads."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

WITHOUT_TORCH = ["oserve.forecast", "oserve.forecast.base", "oserve.forecast.baselines", "oserve.forecast.metrics",
                 "oserve.forecast.servegen_series", "oserve.servegen", "oserve.online_types"]
WITH_TORCH = ["oserve.forecast.lstm", "oserve.forecast.evaluate", "oserve.forecast.bundled"]


def loaded_after_import(modules: list[str]) -> list[str]:
    code = ("import sys; " + "; ".join(f"import {m}" for m in modules) +
            "; print([m for m in ('nats', 'asyncio', 'opentelemetry', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    return eval(out.stdout.strip())  # a list literal printed by the child


def test_baselines_metrics_and_online_types_import_neither_torch_nor_asyncio():
    assert loaded_after_import(WITHOUT_TORCH) == []


def test_lstm_modules_import_no_nats_or_opentelemetry():
    # torch itself imports the standard library's asyncio (through unittest.mock); nothing here uses it
    assert set(loaded_after_import(WITH_TORCH)) <= {"asyncio", "torch"}


def test_core_sources_read_no_clock_and_no_environment():
    files = sorted((REPO / "oserve" / "forecast").glob("*.py")) + [REPO / "oserve" / "online_types.py"]
    pattern = re.compile(r"time\.time\(|perf_counter\(|monotonic\(|datetime\.now|os\.environ|getenv\(|import threading")
    for path in files:
        if path.name == "checks.py":  # the contract suite times forecast() calls, like a test
            continue
        assert not pattern.search(path.read_text()), f"{path.name} reads a clock or the environment"
