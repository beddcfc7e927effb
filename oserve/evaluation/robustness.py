"""Robustness to a wrong capacity model: engines that are not what the planner believes. Pure (a progress
callback may be handed in).

The harness injects a known error: every simulated engine runs on a `ScaledPerf` (its iteration times
stretched per shape, its attention per shape, or everything), while every planner keeps believing the
performance model. Each perturbation is run on each scenario with, side by side on the same window:
- `vllm-static`: the static deployment, chosen on the history by simulating the candidates on the
  *true* engines (an operator measures on the hardware they have);
- `oserve`: capacity learned online with the guard (`oserve.planner.adaptive`);
- `oserve-trusting`: the same planner trusting the model's table (learning off), as before;
- `oserve-true-table`: the planner handed the true table and a twin on the true engines (a reference:
  what a perfectly calibrated model gives).
For `oserve`, the learned table is compared with the true one (the capacity model on the perturbed
engine) on every (shape, class) pair it has evidence on, against the model's error on the same pairs; and
OServe's P99 ratio to static comes with its block-bootstrap interval (`oserve.evaluation.noise`), so "worse
than static" can be told from the spread of one window's draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from oserve.capacity import CapacityTable
from oserve.evaluation.compare import EvalConfig, prepare, run_policy
from oserve.evaluation.noise import p99_ratio_interval
from oserve.evaluation.policies import OServePolicy
from oserve.evaluation.registry import history_trial
from oserve.evaluation.scenarios import Scenario
from oserve.perfmodel import PerfModel, ScaledPerf
from oserve.planner.oserve import OServePlanner
from oserve.sim.kernel import SimResult, simulate
from oserve.specs import ClusterSpec, MemoryConfig, ModelSpec, ReplicaShape, valid_shapes

Injector = Callable[[ModelSpec, ClusterSpec, tuple[ReplicaShape, ...]], ScaledPerf]


@dataclass(frozen=True)
class Perturbation:
    name: str
    description: str
    engine: Injector


def _perf(model: ModelSpec, cluster: ClusterSpec) -> PerfModel:
    return PerfModel(model, cluster.gpu, gpus_per_node=cluster.gpus_per_node)


PERTURBATIONS: dict[str, Perturbation] = {p.name: p for p in (
    Perturbation("none", "engines exactly as the performance model says",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c))),
    Perturbation("global-x0.5", "every engine half as fast as modelled (capacity x0.5)",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c), default=(2.0, 1.0))),
    Perturbation("global-x2", "every engine twice as fast as modelled (capacity x2)",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c), default=(0.5, 1.0))),
    Perturbation("pp-x0.5", "shapes with pipeline stages half as fast (a slower link between stages)",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c), {s: (2.0, 1.0) for s in shapes if s.pp > 1})),
    Perturbation("attention-x4", "attention 4x slower on every shape: long prompts and answers suffer most",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c), default=(1.0, 4.0))),
    Perturbation("tp4-long-x0.5", "TP4 replicas' attention 8x slower: one shape about 2x slower on long inputs",
                 lambda m, c, shapes: ScaledPerf(_perf(m, c), {s: (1.0, 8.0) for s in shapes if s.tp == 4})),
)}
TUNING_PERTURBATIONS = ("none", "global-x0.5", "pp-x0.5")
"""What the learner's and guard's settings were chosen on; the rest are reported only."""


@dataclass
class RobustnessRow:
    scenario: str
    perturbation: str
    results: dict[str, dict]
    """Policy -> finished, admitted, p99_e2e_s, switches."""
    learned_error: float
    """Mean |learned / true - 1| of the capacity over the (shape, class) pairs the learner has evidence on."""
    model_error: float
    """The model's (prior table's) error on the same pairs."""
    pairs: int
    table: list[dict]
    """The learned table's rows (model, learned and true capacity per shape and class)."""
    guard_events: int = 0
    """Times OServe's guard moved it back to the deployment measured to serve best."""
    peak_slowness: float = math.nan
    """OServe's highest pooled time per output token over the model's, over any deployment once it had
    `GuardConfig.slow_min_spans` spans (`SelfCorrectingPlanner.peak_slowness`); NaN if none had."""
    error_by_time: list[dict] | None = None
    """The learned table's error (as `learned_error`, on the pairs with evidence by then) at the first span
    boundary at or after every `checkpoint_s` of the window, and at its last span boundary (what it ended with):
    {"t_s", "learned_error", "model_error", "pairs"}."""
    trial: dict | None = None
    """OServe's trial on the history (`SelfCorrectingPlanner.trial`): its P99 and switches there, the lowest P99
    measured there (static's choice), whether it lost, and whether it deferred to that deployment for the
    window; None without a trial."""
    static_noise: dict | None = None
    """OServe's P99 speedup over vllm-static (static's P99 over OServe's) and its 90% interval over the
    window's minutes (`RatioInterval.as_dict`): `worse_beyond_noise` when the whole interval is below 1."""


def _summary(r: SimResult) -> dict:
    return {"finished": int(r.finished.sum()), "admitted": int(r.admitted.sum()),
            "p99_e2e_s": r.percentile("e2e", 99), "p50_e2e_s": r.percentile("e2e", 50),
            "switches": sum(1 for s in r.spans[1:] if s["switched"])}


class _Checkpointed(OServePolicy):
    """OServe learning its capacity, with a copy of the learner's report taken at the first span boundary at
    or after each multiple of `checkpoint_s` (what it believed then; the run is unchanged)."""

    def __init__(self, *args, checkpoint_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_s = checkpoint_s
        self.snapshots: list[tuple[float, list[dict]]] = []
        self.last_decide_s = 0.0
        """When the learner last changed (it learns only at span boundaries)."""

    def decide(self, view):
        out = super().decide(view)
        self.last_decide_s = view.now_s
        if self.adaptive is not None and view.now_s >= (len(self.snapshots) + 1) * self.checkpoint_s:
            self.snapshots.append((view.now_s, self.adaptive.learner.report()))
        return out


def _table_error(rows: list[dict], true_table: CapacityTable, names: tuple[str, ...]) -> tuple[float, float]:
    """(learned, model) mean |capacity / true - 1| over `rows` (`CapacityLearner.report`); each row gains its
    `true_rps`. NaN for no rows."""
    errs, model_errs = [], []
    for row in rows:
        row["true_rps"] = true_table.rate(_parse_shape(row["shape"]), names.index(row["class"]))
        errs.append(abs(row["learned_rps"] / row["true_rps"] - 1.0))
        model_errs.append(abs(row["model_rps"] / row["true_rps"] - 1.0))
    return (float(np.mean(errs)), float(np.mean(model_errs))) if rows else (math.nan, math.nan)


def run_robustness(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, perturbation: Perturbation,
                   config: EvalConfig = EvalConfig(bound=False),
                   progress: Callable[[str], None] | None = None, checkpoint_s: float = 600.0) -> RobustnessRow:
    """The four runs of the module docstring for one scenario and one injected error (with, before OServe's,
    its trial on the history: `oserve.evaluation.registry.history_trial`); the learned table's error also
    every `checkpoint_s` of the window."""
    shapes = valid_shapes(model, cluster.gpu, cluster.gpus_per_node, cluster.num_gpus, MemoryConfig())
    truth = perturbation.engine(model, cluster, shapes)
    cfg = replace(config, engine=truth, bound=False)
    setup = prepare(model, cluster, scenario, cfg).setup
    results: dict[str, dict] = {}

    def note(what: str) -> None:
        if progress is not None:
            progress(f"{scenario.name} / {perturbation.name}: {what}")

    note("vllm-static")
    static = run_policy(setup, "vllm-static", cfg.sim)[0]
    results["vllm-static"] = _summary(static)
    note("oserve's trial on the history")
    trial = history_trial(setup)
    note("oserve")
    learning = _Checkpointed(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, setup.planner,
                             measured=setup.measured, trial=trial, checkpoint_s=checkpoint_s)
    ours = simulate(model, cluster.gpu, cluster, setup.window, learning, cfg.sim, truth)
    results["oserve"] = _summary(ours)
    # the same requests on both sides (both admit what fits the context window); unfinished ones count as
    # infinitely late in both P99s
    noise = p99_ratio_interval(ours.arrival_s[ours.admitted], ours.e2e_s[ours.admitted],
                               static.e2e_s[static.admitted]).as_dict()
    note("oserve-trusting")
    trusting = OServePolicy(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, setup.planner,
                            name="oserve-trusting", learn_capacity=False)
    results["oserve-trusting"] = _summary(simulate(model, cluster.gpu, cluster, setup.window, trusting, cfg.sim,
                                                   truth))
    note("oserve-true-table")
    t = setup.ctx.table
    true_table = CapacityTable(t.model, t.gpu, t.types, t.target, t.memory, t.gpus_per_node, t.engine, truth,
                               t.max_replica_gpus)
    told = OServePolicy(replace(setup.ctx, table=true_table), setup.prior, setup.new_forecaster(), setup.span_s,
                        setup.planner, name="oserve-true-table", learn_capacity=False)
    told.planner = OServePlanner(replace(setup.ctx, table=true_table), setup.planner, truth)
    results["oserve-true-table"] = _summary(simulate(model, cluster.gpu, cluster, setup.window, told, cfg.sim, truth))
    assert learning.adaptive is not None
    rows = learning.adaptive.learner.report()
    learned_error, model_error = _table_error(rows, true_table, t.type_names)
    by_time = [{"t_s": t_s, "learned_error": e, "model_error": m, "pairs": len(snapshot)}
               for t_s, snapshot in learning.snapshots
               for e, m in [_table_error(snapshot, true_table, t.type_names)]]
    # and the state it ended with, as of its last span boundary, unless a checkpoint already took that one
    if not by_time or by_time[-1]["t_s"] != learning.last_decide_s:
        by_time.append({"t_s": learning.last_decide_s, "learned_error": learned_error, "model_error": model_error,
                        "pairs": len(rows)})
    return RobustnessRow(scenario.name, perturbation.name, results, learned_error, model_error, len(rows), rows,
                         learning.adaptive.guard_events, learning.adaptive.peak_slowness, by_time,
                         learning.adaptive.trial or None, noise)


def _parse_shape(text: str) -> ReplicaShape:
    tp, _, pp = text.removeprefix("TP").partition("xPP")
    return ReplicaShape(int(tp), int(pp or 1))
