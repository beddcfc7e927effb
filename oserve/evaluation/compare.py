"""Every policy on one scenario, side by side: the engine behind `oserve simulate` and `oserve bench e2e`.

Pure apart from the optional progress callback and timer. Honest by construction:
- Each policy knows only the scenario's history (`oserve.planner.prior.fit_prior`: types, estimator,
  class lengths, capacity table, span counts) and what the simulator shows it (`oserve.sim.kernel`).
- The static deployment (vllm-static, vllm-static-rr, llumnix, and dynamo's shape) is chosen before
  the window, as an operator would choose it: every homogeneous deployment within
  `static_min_capacity_frac` of the best modelled capacity for the history's mix (at most
  `static_candidates`) is simulated on the history, and the one with the lowest P99 is kept.
- Latency percentiles count a request that never finished as infinitely late, and a speedup over a
  policy that finished more requests is capped at 1: serving fewer is never reported as faster.
- `bound_p99_s` is a true lower bound on any policy's P99 (`oserve.evaluation.bounds`); the
  perfect-forecast reference's P99 is not a bound, only what OServe's planner does with a perfect
  forecast and free switching.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from oserve.capacity import LatencyTarget
from oserve.errors import ConfigError
from oserve.evaluation.policies import MeasuringStaticPolicy
from oserve.evaluation.bounds import isolated_latency_bound, p99_bound_s
from oserve.evaluation.noise import latency_ratio
from oserve.evaluation.registry import NEEDS_STATIC_RUNS, POLICY_NAMES, Setup, history_trial, policy_spec
from oserve.evaluation.scenarios import Scenario
from oserve.forecast.registry import resolve_name
from oserve.planner.candidates import homogeneous_deployment, static_capacity_rps
from oserve.planner.adaptive import MeasuredRun, Trial, static_choice
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext, SwitchCosts
from oserve.planner.prior import Prior, fit_prior, planning_table
from oserve.sim.kernel import SimConfig, SimResult, simulate
from oserve.specs import ClusterSpec, Deployment, ModelSpec
from oserve.traces import Trace


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """How a comparison is run."""

    sim: SimConfig = field(default_factory=SimConfig)
    target: LatencyTarget = field(default_factory=LatencyTarget)
    costs: SwitchCosts = field(default_factory=SwitchCosts)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    forecaster: str = "last_value"
    """Forecaster of the forecasting policies (OServe, vllm-reload, the perfect-forecast's warm start)."""
    static_candidates: int = 6
    """At most this many homogeneous deployments are simulated on the history to pick the static one."""
    static_min_capacity_frac: float = 0.9
    """... each with at least this fraction of the best one's modelled capacity: below it a deployment runs
    the busy minutes past 0.9 / 0.9 of capacity and cannot win on P99."""
    bound: bool = True
    """Compute the isolated-latency lower bound on P99."""
    engine: object | None = None
    """The simulated engines' true speed when it is not the performance model's: a `PerfModel`-like object
    (`oserve.perfmodel.ScaledPerf`, the robustness harness's injected errors). Every policy and the static
    choice on the history run on it; the planners still believe the performance model."""
    history_trial: bool = True
    """OServe runs its whole policy on the history where the static candidates were measured, and defers to
    the best of them for the window when it did worse there (`oserve.planner.adaptive`, "The trial on the
    history"; `GuardConfig.trial_tolerance`)."""

    def __post_init__(self) -> None:
        if self.static_candidates < 1:
            raise ConfigError(f"EvalConfig: static_candidates must be >= 1, got {self.static_candidates}")
        if not 0 < self.static_min_capacity_frac <= 1:
            raise ConfigError(f"EvalConfig: static_min_capacity_frac must be in (0, 1], got "
                              f"{self.static_min_capacity_frac}")
        resolve_name(self.forecaster)


def speedup(reference: SimResult, other: SimResult) -> float:
    """`other`'s P99 end-to-end latency over `reference`'s (> 1: the reference is faster; `latency_ratio`),
    capped at 1 when the reference finished fewer requests: serving fewer is never reported as faster. Pure."""
    ratio = latency_ratio(reference.percentile("e2e", 99), other.percentile("e2e", 99))
    if reference.finished.sum() < other.finished.sum():
        ratio = min(ratio, 1.0)
    return ratio


@dataclass
class Comparison:
    """Every policy's result on one scenario."""

    scenario: str
    results: dict[str, SimResult]
    static_shape: str
    static_tried: dict[str, float]
    """shape -> P99 e2e on the history of each static candidate tried."""
    prior: Prior
    bound_p99_s: float = math.nan
    class_accuracy: dict[str, float] = field(default_factory=dict)
    """Policy -> fraction of its admitted requests whose class at arrival was their true type (by the
    prior's types on true lengths); only for policies that classify."""

    def speedup_p99(self, reference: str = "oserve") -> dict[str, float]:
        """Every other policy's P99 e2e over the reference's (`speedup`)."""
        ref = self.results[reference]
        return {name: speedup(ref, r) for name, r in self.results.items() if name != reference}


def choose_static(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, prior: Prior, config: EvalConfig,
                  progress: Callable[[str, float], None] | None = None,
                  runs: list[MeasuredRun] | None = None) -> tuple[Deployment, dict[str, float]]:
    """The static deployment, chosen on the history (module docstring): (deployment, shape -> P99 tried).
    Each candidate's run is appended to `runs` when given: its engines' telemetry span by span (classes by
    the prior's estimator) and its P99, what an operator measured before the window and OServe may learn
    from too (`OServePolicy(measured=...)`)."""
    k = len(prior.class_names)
    mix = prior.counts.sum(axis=0)
    mix = mix / mix.sum() if mix.sum() > 0 else np.full(k, 1.0 / k)
    ranked = static_capacity_rps(prior.table, cluster, mix)
    floor = config.static_min_capacity_frac * ranked[0][0]
    ranked = [r for r in ranked if r[0] >= floor][:config.static_candidates]
    measured: list[MeasuredRun] = []
    tried: dict[str, float] = {}
    for _, shape in ranked:
        dep = homogeneous_deployment(cluster, shape)
        cb = (lambda f, s=shape: progress(f"static {s} on history", f)) if progress else None
        policy = MeasuringStaticPolicy(dep, prior.fresh_estimator())
        res = simulate(model, cluster.gpu, cluster, scenario.history, policy, config.sim, config.engine, progress=cb)
        tried[str(shape)] = res.percentile("e2e", 99)
        measured.append(MeasuredRun(dep, tuple(policy.spans), tried[str(shape)], int(res.dropped.sum()), res.e2e_s))
    if runs is not None:
        runs.extend(measured)
    return static_choice(measured).deployment, tried


@dataclass(frozen=True, eq=False)
class Prepared:
    """A scenario ready to serve: what its policies are built from, and how the static one was chosen."""

    setup: Setup
    static_tried: dict[str, float]


def prepare(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, config: EvalConfig = EvalConfig(),
            needs_static: bool = True, progress: Callable[[str, float], None] | None = None) -> Prepared:
    """Fit the prior on the scenario's history and, when asked, choose the static deployment on it."""
    span_s = config.sim.span_s
    prior = fit_prior(scenario.history, model, cluster, target=config.target, span_s=span_s,
                      duration_s=scenario.history_s)
    ctx = PlanningContext(model, cluster, planning_table(prior, config.planner.class_lengths), config.costs,
                          classes=prior.types)
    runs: list[MeasuredRun] = []
    static, tried = (choose_static(model, cluster, scenario, prior, config, progress, runs) if needs_static
                     else (Deployment.empty(), {}))
    return Prepared(Setup(model, cluster, ctx, prior, scenario.history, scenario.history_s, static, span_s,
                          config.planner, config.forecaster, scenario.window, config.engine, tuple(runs), config.sim,
                          config.history_trial), tried)


@dataclass(frozen=True, eq=False)
class HistoryMeasurements:
    """What an operator measures on the history before serving: the static candidates' runs, the one chosen
    (the static baseline's deployment) and OServe's trial there."""

    static: Deployment
    tried: dict[str, float]
    """shape -> P99 e2e on the history of each static candidate tried."""
    runs: tuple[MeasuredRun, ...]
    trial: Trial | None


def measure_history(ctx: PlanningContext, prior: Prior, history: Trace, history_s: float, planner: PlannerConfig,
                    config: EvalConfig = EvalConfig(),
                    progress: Callable[[str, float], None] | None = None) -> HistoryMeasurements:
    """The static candidates simulated on `history` (`choose_static`) and OServe's trial there
    (`oserve.evaluation.registry.history_trial`, `planner` and `ctx` being the planner's own), as `prepare`
    measures them for the simulator's OServe: what a live scheduler's `SelfCorrectingPlanner.seed` takes, so
    the live planner starts from what the simulated one does (`oserve demo`). Sees the history only.
    Deterministic."""
    empty = history.take(np.zeros(0, dtype=int))
    scenario = Scenario("history", history, history_s, empty, prior.types, 0.0)
    sim = replace(config.sim, span_s=prior.span_s)
    config = replace(config, sim=sim)
    runs: list[MeasuredRun] = []
    static, tried = choose_static(ctx.model, ctx.cluster, scenario, prior, config, progress, runs)
    setup = Setup(ctx.model, ctx.cluster, ctx, prior, history, history_s, static, prior.span_s, planner,
                  config.forecaster, empty, config.engine, tuple(runs), sim, config.history_trial)
    return HistoryMeasurements(static, tried, tuple(runs), history_trial(setup))


def run_policy(setup: Setup, name: str, sim: SimConfig, progress: Callable[[float], None] | None = None,
               timer: Callable[[], float] | None = None) -> tuple[SimResult, float]:
    """One policy on the setup's window: its result, and the fraction of its admitted requests whose class
    at arrival was their true type (by the prior's types on true lengths; NaN for a policy that does not
    classify)."""
    policy = policy_spec(name).build(setup)
    r = simulate(setup.model, setup.cluster.gpu, setup.cluster, setup.window, policy, sim, setup.engine, progress=progress,
                 timer=timer)
    adaptive = getattr(policy, "adaptive", None)
    if adaptive is not None and adaptive.trial:
        r.policy_notes["trial"] = dict(adaptive.trial)
    return r, (class_accuracy(r, setup.prior) if getattr(policy, "classifies", False) else math.nan)


def class_accuracy(result: SimResult, prior: Prior) -> float:
    """Fraction of the run's admitted requests whose class at arrival was their true type (by the prior's
    types on true lengths); NaN when none was admitted. Pure."""
    if not result.admitted.any():
        return math.nan
    truth = prior.types.classify(result.input_tokens[result.admitted], result.output_tokens[result.admitted])
    return float((result.routed_class[result.admitted] == truth).mean())


def compare(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, policies: tuple[str, ...] = POLICY_NAMES,
            config: EvalConfig = EvalConfig(), progress: Callable[[str, float], None] | None = None,
            timer: Callable[[], float] | None = None) -> Comparison:
    """Simulate each named policy on the scenario's window, every one fitted on its history only.
    Deterministic (`timer` only measures decision times)."""
    for name in policies:
        policy_spec(name)
    prepared = prepare(model, cluster, scenario, config, any(p in NEEDS_STATIC_RUNS for p in policies), progress)
    setup = prepared.setup
    results: dict[str, SimResult] = {}
    accuracy: dict[str, float] = {}
    for name in policies:
        cb = (lambda f, n=name: progress(n, f)) if progress else None
        results[name], acc = run_policy(setup, name, config.sim, cb, timer)
        if not math.isnan(acc):
            accuracy[name] = acc
    bound = math.nan
    if config.bound and config.engine is None:
        bound = p99_bound_s(isolated_latency_bound(model, cluster, setup.prior.table, scenario.window, config.sim))
    static_shape = str(setup.static.replicas[0].shape) if setup.static.replicas else ""
    return Comparison(scenario.name, results, static_shape, prepared.static_tried, setup.prior, bound, accuracy)
