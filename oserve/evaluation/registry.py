"""Every simulated policy by name: what it is, and how it is built from one `Setup`. Pure.

All of them run the same gateway (`oserve.evaluation.policies.Gateway`): classes estimated at arrival,
learned at completion, the least-loaded routing rule among the replicas a decision allows (Llumnix
dispatches by its freeness, vllm-static-rr by round robin: they are those baselines).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from oserve.errors import ConfigError, UnknownNameError
from oserve.evaluation.baselines import ReloadPolicy, RoundRobinPolicy, StaticPolicy
from oserve.evaluation.dynamo import DynamoPolicy
from oserve.evaluation.llumnix import LlumnixPolicy
from oserve.evaluation.noise import p99_ratio_interval
from oserve.evaluation.policies import OServePolicy, PerfectForecastPolicy
from oserve.forecast.registry import make_forecaster
from oserve.planner.adaptive import Trial, Untouched, static_choice
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext
from oserve.planner.prior import Prior
from oserve.sim.kernel import Policy, SimConfig, SimResult, latency_percentile, simulate
from oserve.specs import ClusterSpec, Deployment, ModelSpec
from oserve.traces import Trace


@dataclass(frozen=True, eq=False)
class Setup:
    """What the policies of one comparison are built from."""

    model: ModelSpec
    cluster: ClusterSpec
    ctx: PlanningContext
    prior: Prior
    """Fitted on the scenario's history only."""
    history: Trace
    history_s: float
    static: Deployment
    """The homogeneous deployment chosen for the static baselines before the window."""
    span_s: float
    planner: PlannerConfig
    forecaster: str
    """Forecaster kind of the forecasting policies (`oserve.forecast.registry`)."""
    window: Trace
    """The requests served. Only the perfect-forecast reference is handed it."""
    engine: object | None = None
    """The simulated engines' true speed (`EvalConfig.engine`); None: the performance model's."""
    measured: tuple = ()
    """The static candidates' runs on the history (`oserve.planner.adaptive.MeasuredRun`): what an operator
    measured before the window; OServe's learned capacity starts from them."""
    sim: SimConfig = field(default_factory=SimConfig)
    """How the history was simulated (OServe's trial runs there the same way)."""
    history_trial: bool = True
    """OServe runs its trial on the history (`history_trial`) when the static candidates were measured."""

    @property
    def num_classes(self) -> int:
        return len(self.prior.class_names)

    def new_forecaster(self):
        return make_forecaster(self.forecaster, len(self.prior.class_names))


def history_trial(setup: Setup, planner: PlannerConfig | None = None) -> Trial | None:
    """None when the setup runs no trial (`Setup.history_trial` off, or no static candidate measured);
    else OServe's run on the history, where the static candidates were measured: its whole policy (`planner`,
    the setup's by default, seeded with those measurements as in the window) on the same requests and the
    same engines (`oserve.planner.adaptive.SelfCorrectingPlanner.seed`). Its forecaster starts fitted on
    that history, as the window's does, so the trial knows the history's counts in advance: it is, if
    anything, kind to OServe."""
    if not (setup.history_trial and setup.measured):
        return None
    policy = OServePolicy(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, planner or setup.planner,
                          name="oserve-trial", measured=setup.measured)
    r = simulate(setup.model, setup.cluster.gpu, setup.cluster, setup.history, policy, setup.sim, setup.engine)
    switch_at = [s["start_s"] for s in r.spans[1:] if s["switched"]]
    return Trial(r.percentile("e2e", 99), len(switch_at), int(r.dropped.sum()),
                 untouched=untouched_comparison(setup, r, switch_at) if switch_at else None)


MIN_UNTOUCHED = 200
"""A switching trial is judged on the requests its switches did not touch only when there are at least this
many (two in the P99's tail)."""


def untouched_by_switches(arrival_s: np.ndarray, e2e_s: np.ndarray, switch_at_s: Iterable[float],
                          span_s: float) -> np.ndarray:
    """Bool per request: no switch touched it. A switch at `t` (seconds from the first arrival, at a span's
    start) touches the requests that arrive in the span it starts (`[t, t + span_s)`: the outage and the
    queue it leaves) and those running when it comes (arrived before `t`, finished after it, `e2e_s` inf
    for never). Pure."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    e2e_s = np.asarray(e2e_s, dtype=float)
    if arrival_s.shape != e2e_s.shape or not span_s > 0:
        raise ConfigError(f"untouched_by_switches: arrivals and latencies of one shape and span_s > 0, got "
                          f"{arrival_s.shape}, {e2e_s.shape}, {span_s}")
    t = arrival_s - arrival_s.min() if len(arrival_s) else arrival_s
    keep = np.ones(len(t), dtype=bool)
    for at in switch_at_s:
        keep &= ~(((t >= at) & (t < at + span_s)) | ((t < at) & (t + e2e_s > at)))
    return keep


def untouched_comparison(setup: Setup, trial: SimResult, switch_at: list[float]) -> Untouched | None:
    """The trial against static's choice (the measured run `seed` compares it with) on the history's admitted
    requests that the trial's switches did not touch, the bootstrap's blocks a span long; None when that
    run kept no latencies, or fewer than `MIN_UNTOUCHED` requests are left. Both ran on the history, so
    their requests are the same, in the same order.

    Lenient to the trial by construction: a request it left unfinished, or queued across a switch, before
    its last switch is not compared (it was running at a switch); `seed` compares the unfinished counts of
    the whole history first."""
    best = static_choice(setup.measured)
    if best.e2e_s is None:
        return None
    if len(best.e2e_s) != len(trial.e2e_s):
        raise ConfigError(f"untouched_comparison: static's run on the history has {len(best.e2e_s)} requests, "
                          f"the trial's {len(trial.e2e_s)}: they ran on different histories")
    keep = untouched_by_switches(trial.arrival_s, trial.e2e_s, switch_at, setup.span_s) & trial.admitted
    if keep.sum() < MIN_UNTOUCHED:
        return None
    ours, theirs = trial.e2e_s[keep], best.e2e_s[keep]
    spread = p99_ratio_interval(trial.arrival_s[keep], ours, theirs, block_s=setup.span_s)
    return Untouched(int(keep.sum()), latency_percentile(ours, 99), latency_percentile(theirs, 99), spread.low,
                     spread.high)


def oserve_policy(s: Setup) -> OServePolicy:
    """The product's policy: seeded with the history's measurements and, when they exist, its trial there."""
    return OServePolicy(s.ctx, s.prior, s.new_forecaster(), s.span_s, s.planner, measured=s.measured,
                        trial=history_trial(s))


@dataclass(frozen=True)
class PolicySpec:
    name: str
    description: str
    build: Callable[[Setup], Policy]
    reference: bool = False
    """Not a product: told what no real system knows (reported as a gap, never as a baseline)."""


_SPECS = (
    PolicySpec("oserve", "OServe: per-class forecast, deployment chosen on the digital twin, GPU-to-GPU switches",
               oserve_policy),
    PolicySpec("vllm-static", "the best homogeneous deployment (chosen on the history), least-loaded routing",
               lambda s: StaticPolicy(s.static, s.num_classes)),
    PolicySpec("vllm-static-rr", "the same static deployment with round-robin routing (vLLM's router)",
               lambda s: RoundRobinPolicy(s.static, s.num_classes)),
    PolicySpec("vllm-reload", "the best homogeneous deployment for each span's forecast, switched by reloading",
               # by the table of what the classes really carry, as the static shape is chosen: OServe's planning
               # lever (`PlannerConfig.class_lengths`) is OServe's, not the baselines'
               lambda s: ReloadPolicy(replace(s.ctx, table=s.prior.table), s.prior, s.new_forecaster(), s.span_s,
                                      s.planner)),
    PolicySpec("llumnix", "the static deployment, freeness dispatch and live migration of running requests",
               lambda s: LlumnixPolicy(s.static, s.num_classes, s.model, s.cluster)),
    PolicySpec("dynamo", "the static shape, replica count scaled from an aggregate forecast, KV-aware routing",
               lambda s: DynamoPolicy(s.ctx, s.prior, s.static.replicas[0].shape, s.history, s.history_s,
                                      s.span_s)),
    PolicySpec("perfect-forecast", "reference: OServe's planner told the next span's true arrivals, "
                                   "switching for free", lambda s: PerfectForecastPolicy(
                                       s.ctx, s.prior, s.new_forecaster(), s.span_s, s.window, s.planner),
               reference=True),
)
POLICIES: dict[str, PolicySpec] = {spec.name: spec for spec in _SPECS}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
BASELINES: tuple[str, ...] = tuple(n for n, s in POLICIES.items() if n != "oserve" and not s.reference)
NEEDS_STATIC_RUNS = ("oserve", "vllm-static", "vllm-static-rr", "llumnix", "dynamo")
"""Policies that need the static candidates run on the history: the static baselines serve the one chosen
there, and OServe learns from those runs and holds its trial against that choice (`oserve_policy`). So
OServe is the same policy whether or not a static baseline is asked for beside it."""


def policy_spec(name: str) -> PolicySpec:
    if name not in POLICIES:
        raise UnknownNameError("policy", name, POLICY_NAMES)
    return POLICIES[name]
