"""Packaging: the service folders import as oserve.* subpackages, installed and editable; core purity."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

import oserve
import oserve.observability
import oserve.streams
import oserve.workers
from conftest import REPO

SUBPACKAGES = {"streams": "oserve.streams", "workers": "oserve.workers", "observability": "oserve.observability"}
CORE_MODULES = ["oserve", "oserve.specs", "oserve.perfmodel", "oserve.calibration", "oserve.capacity",
                "oserve.workload", "oserve.errors", "oserve.scheduler", "oserve.sim.cluster", "oserve.sim.policies",
                "oserve.switch", "oserve.forecast", "oserve.forecast.baselines", "oserve.online_types"]


def test_editable_install_maps_folders_to_subpackages():
    for folder, name in SUBPACKAGES.items():
        module = sys.modules[name]
        if (REPO / folder).exists() and "site-packages" not in module.__file__:
            assert module.__file__.startswith(str(REPO / folder))


@pytest.mark.slow
def test_wheel_holds_subpackages_and_data(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("oserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in SUBPACKAGES.values():
        assert name.replace(".", "/") + "/__init__.py" in names
    assert not any(n.startswith(("streams/", "workers/", "observability/")) for n in names)
    for data in ("perf_coefficients.json", "azure_2023_conv.csv", "ATTRIBUTION.md"):
        assert f"oserve/data/{data}" in names
    # Installed from the wheel, away from the source tree, the subpackages import under oserve.
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    out = subprocess.run([sys.executable, "-S", "-c",
                          f"import sys; sys.path.insert(0, {str(target)!r}); "
                          "import oserve.streams, oserve.workers, oserve.observability; "
                          "print(oserve.streams.__file__)"],
                         check=True, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.stdout.strip().startswith(str(target))


def test_core_imports_no_asyncio_nats_or_opentelemetry():
    code = ("import sys; " + "; ".join(f"import {m}" for m in CORE_MODULES) +
            "; bad = [m for m in ('nats', 'asyncio', 'opentelemetry') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_version():
    assert oserve.__version__
