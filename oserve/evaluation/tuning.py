"""The planner's thresholds, tuned on one set of scenarios and reported on another. Pure (a timer and a
progress callback may be handed in).

`TUNING_SET` is what `oserve bench tune` searches the thresholds on; `TEST_SET` (disjoint: other
mixes, other sequences, other traces) is what `oserve bench e2e` reports. The shipped defaults of
`PlannerConfig` are the tuning's result, so the reported figures never come from thresholds chosen on
the scenarios they are reported on.

The search is coordinate-wise: each tuned threshold in turn takes the value of its grid that gives
the best objective, the others held at their current best; the objective is the geometric mean over
the tuning set of OServe's P99 speedup over vllm-static (`oserve.evaluation.compare.speedup`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from oserve.evaluation.compare import EvalConfig, prepare, run_policy, speedup
from oserve.evaluation.scenarios import build_scenario
from oserve.planner.config import PlannerConfig
from oserve.specs import ClusterSpec, ModelSpec

TUNING_SET: tuple[str, ...] = ("S1", "S3", "T1", "T3", "azure-code")
TEST_SET: tuple[str, ...] = ("S2", "S4", "S5", "T2", "T4", "azure-conv", "servegen-m-large", "servegen-m-mid")
GRID: dict[str, tuple[float, ...]] = {
    "switch_gain": (0.05, 0.1, 0.2),
    "neighbour_min_gain": (0.05, 0.1, 0.2),
    "neighbour_capacity_slack": (0.0, 0.05, 0.15),
}
"""The tuned thresholds (`PlannerConfig` fields) and the values tried for each."""


@dataclass
class TuningResult:
    best: dict[str, float]
    objective: float
    """Geometric mean speedup over vllm-static on the tuning set, at `best`."""
    trials: list[dict] = field(default_factory=list)
    """Every configuration tried: its thresholds, per-scenario speedups and objective."""


def tune(model: ModelSpec, cluster: ClusterSpec, scenarios: tuple[str, ...] = TUNING_SET, load: float = 0.8,
         minutes: float | None = None, grid: dict[str, tuple[float, ...]] = GRID,
         base: PlannerConfig = PlannerConfig(), config: EvalConfig = EvalConfig(),
         progress: Callable[[str], None] | None = None) -> TuningResult:
    """Coordinate search of the thresholds in `grid` on `scenarios` (module docstring)."""
    setups, statics = {}, {}
    for name in scenarios:
        sc = build_scenario(name, model, cluster, load=load, minutes=minutes)
        setups[name] = prepare(model, cluster, sc, config).setup
        statics[name] = run_policy(setups[name], "vllm-static", config.sim)[0]
    cache: dict[tuple, dict] = {}

    def evaluate(values: dict[str, float]) -> dict:
        key = tuple(sorted(values.items()))
        if key not in cache:
            planner = replace(base, **values)
            speedups = {}
            for name, setup in setups.items():
                if progress is not None:
                    progress(f"{name}: {values}")
                result = run_policy(replace(setup, planner=planner), "oserve", config.sim)[0]
                speedups[name] = speedup(result, statics[name])
            finite = [v for v in speedups.values() if math.isfinite(v) and v > 0]
            objective = float(np.exp(np.mean(np.log(finite)))) if len(finite) == len(speedups) else 0.0
            cache[key] = {"thresholds": dict(values), "speedups": speedups, "objective": objective}
        return cache[key]

    current = {name: getattr(base, name) for name in grid}
    best = evaluate(current)
    for name, values in grid.items():
        for v in values:
            trial = evaluate({**current, name: v})
            if trial["objective"] > best["objective"] + 1e-12:
                best, current = trial, dict(trial["thresholds"])
    return TuningResult(current, best["objective"], list(cache.values()))
