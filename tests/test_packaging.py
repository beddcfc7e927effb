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
                "oserve.traces", "oserve.workload_types", "oserve.servegen", "oserve.errors", "oserve.scheduler",
                "oserve.sim.kernel", "oserve.engine_model", "oserve.routing", "oserve.decision", "oserve.switch",
                "oserve.forecast", "oserve.forecast.baselines", "oserve.forecast.rates", "oserve.online_types",
                "oserve.planner.oserve", "oserve.planner.prior", "oserve.evaluation.compare",
                "oserve.evaluation.registry", "oserve.evaluation.tuning"]


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


# --- the layout: data flows one way, core <- planner <- evaluation and workers ----------------------------

def _imports(path) -> set[str]:
    """The oserve modules a source file imports (at any depth of the file)."""
    import ast

    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("oserve"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("oserve"))
    return out


def _room(module: str) -> str:
    """The room of a module: cli, evaluation, planner, workers, streams, observability, or core."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("cli", "evaluation", "planner", "workers", "streams", "observability"):
        return parts[1]
    return "core"


# room -> rooms it must never import (the reverse direction, or a sideways one)
FORBIDDEN = {
    "core": {"planner", "evaluation", "workers", "cli", "streams", "observability"},
    "planner": {"evaluation", "workers", "cli", "streams", "observability"},
    "evaluation": {"workers", "cli", "streams"},
    "workers": {"evaluation", "cli"},
}


def _files():
    for folder, prefix in (("oserve", "oserve"), ("workers", "oserve.workers"), ("streams", "oserve.streams"),
                           ("observability", "oserve.observability")):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            yield path, ".".join([prefix, *rel.parts]).removesuffix(".__init__")


def test_data_flows_one_way_between_the_rooms():
    bad = []
    for path, module in _files():
        room = _room(module)
        for imported in _imports(path):
            if _room(imported) in FORBIDDEN.get(room, ()):
                bad.append(f"{module} ({room}) imports {imported}")
    assert bad == []


def test_workers_call_the_planner_not_the_simulator():
    bad = [f"{module} imports {m}" for path, module in _files() if _room(module) == "workers"
           for m in _imports(path) if m == "oserve.sim" or m.startswith("oserve.sim.")]
    assert bad == []
