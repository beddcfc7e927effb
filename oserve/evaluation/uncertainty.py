"""How much OServe's plan depends on knowing each request's type at arrival: the accuracy curve. For
measurement only, like `oserve.evaluation.peeking`: these policies are handed the window's true lengths.

At accuracy p, each request is classed by its true type with probability p; otherwise it gets a wrong
class: the one the arrival-time estimator (as the history left it, `Prior.estimator`) gives it when that
one is wrong, else a uniformly drawn other class. So the rate of errors is set, and their shape is the
real estimator's where it has one. The planner plans with the types themselves (each class is a type),
as when every request is routed by its true type; what p changes is only the class each request is
counted and routed as. The draw is seeded per request, so a curve is reproducible and the requests a
lower accuracy misclasses include those a higher one does (the draws are nested).

`curve` runs vllm-static once and OServe at each accuracy, and OServe as it really is (the estimator
learning online, planned and corrected as `EvalConfig.planner` says: the honest policy of
`oserve.evaluation.compare`), each with its measured accuracy on the window.

`levers` is honest throughout (no policy is told a true length): it runs vllm-static once and OServe
with its estimator under each combination of the two other levers of `LEVERS`, how the plan sees a
class (`PlannerConfig.class_lengths`) and whether outgrown requests move (`PlannerConfig.correction`),
so what each lever adds, alone and together, is measured on one window against one static baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from oserve.evaluation.baselines import StaticPolicy
from oserve.correction import CorrectionConfig
from oserve.evaluation.compare import EvalConfig, class_accuracy, prepare, speedup
from oserve.evaluation.peeking import TrueTypePolicy, true_type_setup, window_runner
from oserve.evaluation.policies import OServePolicy
from oserve.evaluation.registry import Setup, history_trial
from oserve.evaluation.scenarios import Scenario
from oserve.planner.prior import client_tag, planning_table
from oserve.sim.kernel import ArrivalInfo, SimResult
from oserve.specs import ClusterSpec, ModelSpec
from oserve.traces import Trace

ACCURACIES: tuple[float, ...] = (1.0, 0.95, 0.9, 0.8)
LEVERS: tuple[tuple[str, str, bool], ...] = (
    ("estimated", "estimated", False),
    ("estimated + moves", "estimated", True),
    ("types", "types", False),
    ("types + moves", "types", True),
)
"""(label, `PlannerConfig.class_lengths`, outgrown requests move) of each variant `levers` runs."""


class NoisyTypePolicy(TrueTypePolicy):
    """OServe told each request's type correctly with probability `accuracy` (module docstring)."""

    def __init__(self, setup: Setup, window: Trace, accuracy: float, seed: int = 0) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
        super().__init__(setup, window)
        self.name = f"oserve-accuracy-{accuracy:g}"
        self.accuracy = accuracy
        rng = np.random.default_rng(seed)
        self._draw = rng.random(len(window))  # one draw per request: nested errors across accuracies
        self._other = rng.random(len(window))
        self._estimator = setup.prior.fresh_estimator()  # frozen: it only predicts here

    def classify(self, arrival: ArrivalInfo) -> int:
        i, true = arrival.request_index, self.true_type(arrival)
        cls, k = true, len(self.types.names)
        if self._draw[i] >= self.accuracy and k > 1:
            est = self._estimator.predict_one(arrival.input_tokens, tag=client_tag(arrival.client_id),
                                              max_tokens=arrival.max_tokens or None)
            cls = est if est != true else wrong_class(true, k, float(self._other[i]))
        return self._record(arrival, cls)


def wrong_class(true: int, k: int, u: float) -> int:
    """A class other than `true` among `k`, uniformly by `u` in [0, 1). Pure."""
    j = min(int(u * (k - 1)), k - 2)
    return j if j < true else j + 1


@dataclass(frozen=True)
class CurvePoint:
    label: str
    """An accuracy as a percentage ("100%", "95%", ...) or "estimator"."""
    accuracy: float
    """Measured on the window: the fraction of admitted requests classed as their true type."""
    oserve_p99_s: float
    speedup: float
    """vllm-static's P99 over OServe's (capped at 1 when OServe finished fewer)."""
    migrations: int = 0
    """Live KV moves in the run: a switch's and the correction's."""


@dataclass(frozen=True)
class Curve:
    scenario: str
    static_p99_s: float
    static_shape: str
    points: tuple[CurvePoint, ...]


def curve(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, accuracies: tuple[float, ...] = ACCURACIES,
          config: EvalConfig = EvalConfig(), seed: int = 0,
          progress: Callable[[str], None] | None = None) -> Curve:
    """vllm-static, OServe at each accuracy and OServe with its estimator, on the scenario's window."""
    honest = prepare(model, cluster, scenario, config).setup
    typed = true_type_setup(honest, honest.prior, config)

    run = window_runner(model, cluster, scenario, config, progress)
    static = run("vllm-static", StaticPolicy(honest.static, len(honest.prior.class_names)))

    def point(label: str, r: SimResult) -> CurvePoint:
        return CurvePoint(label, class_accuracy(r, honest.prior), r.percentile("e2e", 99), speedup(r, static),
                          r.num_migrations)

    points = [point(f"{p:.0%}", run(f"oserve at {p:.0%}", NoisyTypePolicy(typed, scenario.window, p, seed)))
              for p in accuracies]
    points.append(point("estimator", run("oserve with its estimator",
                                         OServePolicy(honest.ctx, honest.prior, honest.new_forecaster(),
                                                      honest.span_s, honest.planner))))
    return Curve(scenario.name, static.percentile("e2e", 99), str(honest.static.replicas[0].shape), tuple(points))


def with_class_lengths(setup: Setup, class_lengths: str) -> Setup:
    """`setup` with OServe planning by `planning_table(prior, class_lengths)`: the same prior, estimator,
    counts and static choice, one lever moved."""
    return replace(setup, ctx=replace(setup.ctx, table=planning_table(setup.prior, class_lengths)))


def levers(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, config: EvalConfig = EvalConfig(),
           correction: CorrectionConfig | None = None, variants: tuple[tuple[str, str, bool], ...] = LEVERS,
           progress: Callable[[str], None] | None = None) -> Curve:
    """vllm-static and OServe with its estimator under each of `variants` (module docstring), on the
    scenario's window; each OServe is the product's policy (`oserve` in `oserve.evaluation.registry`)
    with only the two levers set. The moves, where a variant has them, are `correction`, else the
    config's planner's (`config.planner.correction`), else the defaults of `CorrectionConfig`."""
    correction = correction or config.planner.correction or CorrectionConfig()
    prepared = prepare(model, cluster, scenario, config).setup
    run = window_runner(model, cluster, scenario, config, progress)
    static = run("vllm-static", StaticPolicy(prepared.static, len(prepared.prior.class_names)))
    points = []
    for label, class_lengths, moves in variants:
        s = with_class_lengths(prepared, class_lengths)
        planner = replace(s.planner, class_lengths=class_lengths, correction=correction if moves else None)
        trial = history_trial(s, planner)  # its own, per variant
        r = run(f"oserve, {label}", OServePolicy(s.ctx, s.prior, s.new_forecaster(), s.span_s, planner,
                                                 measured=s.measured, trial=trial))
        points.append(CurvePoint(label, class_accuracy(r, s.prior), r.percentile("e2e", 99), speedup(r, static),
                                 r.num_migrations))
    return Curve(scenario.name, static.percentile("e2e", 99), str(prepared.static.replicas[0].shape), tuple(points))
