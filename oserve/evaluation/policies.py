"""The gateway every simulated policy runs, OServe's policy, and the perfect-forecast reference. Pure.

`Gateway` does what the live gateway does (`oserve.workers.gateway`), as the simulator drives it: it
classifies each arrival once with the online estimator (`oserve.online_types.OnlineTypes`, copied
from the prior fitted on history), counts arrivals per span by that class and keeps the last span's
arrival pattern, learns the estimator from each span's completions (true lengths, known only now; at
most `LEARN_PER_SPAN` of them, evenly spread, which bounds the cost of learning at high load), keeps
all of them by class at arrival for the twin (`oserve.planner.twin.RecentLengths`), and routes by the
one rule (`oserve.routing.least_loaded`) among the replicas the decision allows.
Policies differ in how they decide, not in what they may see.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oserve.correction import OutgrownMover
from oserve.decision import Decision
from oserve.forecast.base import Forecaster
from oserve.forecast.rates import RateForecaster
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext
from oserve.planner.adaptive import GuardConfig, MeasuredRun, SelfCorrectingPlanner, SpanRecord, Trial
from oserve.planner.learned import LearnerConfig, replica_windows, saturated_gpus
from oserve.planner.oserve import OServePlanner
from oserve.online_types import OnlineTypes
from oserve.planner.prior import Prior, client_tag
from oserve.planner.static import everywhere
from oserve.planner.twin import ArrivalPattern, RecentLengths, TwinConfig
from oserve.routing import ReplicaLoad, beyond_plan, least_loaded
from oserve.sim.kernel import ArrivalInfo, BalancerView, Migration, SpanView
from oserve.specs import Deployment
from oserve.traces import Trace


LEARN_PER_SPAN = 600
"""Completions the simulated gateway learns from per span, at most (every k-th when more finished): at
18 us a learn it keeps an 800-minute run's learning to seconds; 600 a minute is ample for a Hoeffding
tree that splits every 200 requests per leaf."""


class Gateway:
    """Classify, count and route as a gateway does (see the module docstring); subclasses decide.

    Without an `estimator` every request is class 0: for policies that route every request alike
    (static, Llumnix, Dynamo), whose decisions do not depend on classes.
    """

    def __init__(self, name: str, num_classes: int, estimator: OnlineTypes | None = None,
                 recent_spans: int = TwinConfig().recent_spans) -> None:
        self.name = name
        self.k = num_classes
        self.estimator = estimator
        self.recent = RecentLengths(num_classes, recent_spans)
        """What each class turned out to contain lately (completions by class at arrival), for the twin."""
        self._classes_seen: dict[tuple[int, int, int], int] = {}
        """(input, max tokens, client) -> class, as the estimator answers until it next learns (a span
        boundary): a cache, not knowledge; the answers are the estimator's own."""
        self.current: Decision | None = None
        self._span_start_s = 0.0
        self._last_arrival_s = 0.0
        self._counts = np.zeros(self.k)
        self._offsets: list[float] = []
        self._classes: list[int] = []
        self.mover: OutgrownMover | None = None
        """Moves requests that outgrow their class (`oserve.correction`); None: they stay where routed."""
        self.migration_interval_s: float | None = None
        """How often the kernel asks `plan_migrations` (None: never)."""

    def correct_after_the_fact(self, mover: OutgrownMover) -> None:
        """Move requests that outgrow the class they were routed as (`oserve.correction`)."""
        self.mover = mover
        self.migration_interval_s = mover.config.interval_s

    def plan_migrations(self, replicas: list[BalancerView], now_s: float) -> list[Migration]:
        if self.mover is None or self.current is None:
            return []
        return self.mover.plan(replicas, self.current.eligible)

    @property
    def classifies(self) -> bool:
        return self.estimator is not None

    # --- at arrival --------------------------------------------------------------------------------

    def classify(self, arrival: ArrivalInfo) -> int:
        if self.estimator is None:
            cls = 0
        else:
            key = (arrival.input_tokens, arrival.max_tokens, arrival.client_id)
            cls = self._classes_seen.get(key, -1)
            if cls < 0:
                cls = self._classes_seen[key] = self.estimator.predict_one(
                    arrival.input_tokens, tag=client_tag(arrival.client_id), max_tokens=arrival.max_tokens or None)
        return self._record(arrival, cls)

    def _record(self, arrival: ArrivalInfo, cls: int) -> int:
        """Count the arrival in class `cls` for the span's counts and arrival pattern; return `cls`."""
        self._counts[cls] += 1
        if self.mover is not None:
            self.mover.admit(arrival.request_index, arrival.input_tokens, cls)
        self._last_arrival_s = arrival.arrival_s
        self._offsets.append(arrival.arrival_s - self._span_start_s)
        self._classes.append(cls)
        return cls

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        current = self.current
        if current is None:
            return least_loaded(loads, None)
        eligible = current.eligible(class_index)
        if eligible is not None and beyond_plan(float(self._counts[class_index]), float(sum(eligible)),
                                                self._last_arrival_s - self._span_start_s):
            eligible = None  # this class came beyond its plan: any replica (`oserve.routing.beyond_plan`)
        return least_loaded(loads, eligible)

    # --- at a span boundary -------------------------------------------------------------------------

    def close_span(self, view: SpanView) -> tuple[np.ndarray, ArrivalPattern]:
        """Learn the span's completions; return its per-class arrival counts and arrival pattern, and
        start counting the next span."""
        if self.estimator is not None and view.completed:
            step = -(-len(view.completed) // LEARN_PER_SPAN)
            for c in view.completed[::step]:
                self.estimator.learn_one(c.input_tokens, c.output_tokens, tag=client_tag(c.client_id),
                                         max_tokens=c.max_tokens or None)
            self._classes_seen.clear()
        self.recent.add_span((c.routed_class, c.input_tokens, c.output_tokens) for c in view.completed)
        if self.mover is not None:
            for c in view.completed:
                self.mover.done(c.request_index)
        counts = self._counts
        pattern = ArrivalPattern(np.array(self._offsets), np.array(self._classes, dtype=np.int64), view.span_s,
                                 self.recent.lengths())
        self._counts, self._offsets, self._classes = np.zeros(self.k), [], []
        self._span_start_s = view.now_s
        return counts, pattern

    def decide(self, view: SpanView) -> Decision | None:
        counts, pattern = self.close_span(view)
        decision = self.plan(view, counts, pattern)
        if decision is not None:
            self.current = decision
        return decision

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        """The subclass's decision for the coming span (None: keep the current one)."""
        raise NotImplementedError


class OServePolicy(Gateway):
    """OServe: forecast per-class rates, then the planner, the live scheduler's very call: with
    `learn_capacity` (the default) `SelfCorrectingPlanner.plan`, told each span what every replica did
    (`ReplicaWindow`s from the engines' counters) and first what the `measured` runs before the window
    showed (the static candidates on the history) and how its own trial there did (`trial`,
    `oserve.evaluation.registry.history_trial`), else `OServePlanner.plan` on the prior's table."""

    def __init__(self, ctx: PlanningContext, prior: Prior, forecaster: Forecaster, span_s: float,
                 config: PlannerConfig = PlannerConfig(), name: str = "oserve", learn_capacity: bool = True,
                 learner: LearnerConfig = LearnerConfig(), guard: GuardConfig = GuardConfig(),
                 measured: tuple[MeasuredRun, ...] = (), trial: Trial | None = None) -> None:
        super().__init__(name, len(prior.class_names), prior.fresh_estimator(),
                         (config.twin or TwinConfig()).recent_spans)
        if config.correction is not None:
            self.correct_after_the_fact(OutgrownMover(ctx.model, ctx.cluster, self.class_so_far,
                                                      self.class_log_outputs, config.correction))
        self.adaptive = SelfCorrectingPlanner(ctx, config, learner, guard, prior.counts.sum(axis=0)) \
            if learn_capacity else None
        if self.adaptive is not None:
            self.adaptive.seed(measured, trial)
        self.telemetry = Telemetry(self.k, learner.saturated_frac)
        self.planner = self.adaptive if self.adaptive is not None else OServePlanner(ctx, config)
        forecaster.fit(prior.counts)
        self.rates = RateForecaster(forecaster, span_s)
        self.outcomes: list[dict] = []
        """Per span with learning: what the span showed (saturated replicas, backlog, underserved, slow) and the
        correction then in force."""

    def decide(self, view: SpanView) -> Decision | None:
        if self.adaptive is not None:
            span = self.telemetry.span(view, float(self._counts.sum()), self._counts)
            if view.current is not None:
                out = self.adaptive.observe(span, view.current)
                self.outcomes.append({"span_index": view.span_index, "underserved": out.underserved, "slow": out.slow,
                                      "saturated_replicas": out.saturated_replicas, "learned": out.learned,
                                      "waiting_growth": out.backlog_growth, "arrivals": span.arrivals,
                                      "scales": {f"{s}/{self.adaptive.class_names[j]}": v
                                                 for (s, j), v in self.adaptive.correction.scales.items()}})
        return super().decide(view)

    def class_so_far(self, input_tokens: int, generated_tokens: int) -> int:
        """The class of a request with this input that has generated this many tokens so far."""
        assert self.estimator is not None
        return self.estimator.predict_one(input_tokens, output_hint=generated_tokens)

    def class_log_outputs(self) -> np.ndarray:
        """Each class's centroid output (log1p tokens), as the estimator has them now."""
        assert self.estimator is not None
        return self.estimator.centroids_log[:, 1]

    def next_rates(self, view: SpanView, counts: np.ndarray) -> np.ndarray:
        """The forecast for the coming span (the first from the history alone)."""
        if view.current is not None:
            self.rates.observe(counts)
        return self.rates.rates_rps()

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        rates = self.next_rates(view, counts)
        # the first deployment is scored on a long Poisson span: there is no span of this window yet
        recent = pattern if view.current is not None else None
        return self.planner.plan(rates, view.current, recent, view.span_s)


class Telemetry:
    """Turns the span views a policy is shown into `SpanRecord`s: each replica's counters differenced over
    the span (`oserve.planner.learned.replica_windows`), with the span's arrivals and completions."""

    def __init__(self, num_classes: int, saturated_frac: float = LearnerConfig().saturated_frac) -> None:
        self.k = num_classes
        self.saturated_frac = saturated_frac
        self._before: dict = {}
        self._saturated: set = set()

    def span(self, view: SpanView, arrivals: float, by_class: np.ndarray | None = None) -> SpanRecord:
        windows = replica_windows(self._before, view.replicas, view.completed, self.k, view.span_s, self._saturated)
        self._saturated = saturated_gpus(self._before, view.replicas, view.span_s, self.saturated_frac)
        growth = sum(r.num_waiting - self._before[tuple(r.gpu_ids)].num_waiting for r in view.replicas
                     if tuple(r.gpu_ids) in self._before and self._before[tuple(r.gpu_ids)].shape == r.shape)
        self._before = {tuple(r.gpu_ids): r for r in view.replicas}
        return SpanRecord(tuple(windows), arrivals, float(len(view.completed)), view.span_s, float(growth),
                          tuple(float(c) for c in by_class) if by_class is not None else ())


class MeasuringStaticPolicy(Gateway):
    """The static deployment as an operator measures it before the window: served as vllm-static serves it
    (every replica eligible, least loaded), each arrival classed by the estimator so the engines'
    telemetry per class can be kept (`spans`) for OServe's learned capacity (`MeasuredRun`)."""

    def __init__(self, deployment: Deployment, estimator: OnlineTypes, name: str = "static-measured") -> None:
        super().__init__(name, len(estimator.types.names), estimator)
        self.deployment = deployment
        self.telemetry = Telemetry(self.k)
        self.spans: list[SpanRecord] = []

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        return least_loaded(loads, None)

    def decide(self, view: SpanView) -> Decision | None:
        span = self.telemetry.span(view, float(self._counts.sum()))
        if view.current is not None:
            self.spans.append(span)
        return super().decide(view)

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        if view.current is not None:
            return None
        return Decision(self.deployment, everywhere(self.deployment, self.k), 0.0, (), "static")


class PerfectForecastPolicy(OServePolicy):
    """A reference, not a product: OServe's planner told the coming span's true per-class counts and
    arrival times (each request classed as the gateway would class it), switching for free (retired
    replicas finish their requests, new ones serve at once). It is handed the window it serves."""

    def __init__(self, ctx: PlanningContext, prior: Prior, forecaster: Forecaster, span_s: float, window: Trace,
                 config: PlannerConfig = PlannerConfig(), name: str = "perfect-forecast") -> None:
        from dataclasses import replace

        super().__init__(ctx, prior, forecaster, span_s, replace(config, free_switching=True), name)
        self.window = window

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        lo, hi = np.searchsorted(self.window.arrival_s, [view.now_s, view.now_s + view.span_s], side="left")
        assert self.estimator is not None
        classes = np.array([self.estimator.predict_one(int(self.window.input_tokens[i]),
                                                       tag=client_tag(int(self.window.client_ids[i])),
                                                       max_tokens=int(self.window.max_tokens[i]) or None)
                            for i in range(lo, hi)], dtype=np.int64)
        rates = np.bincount(classes, minlength=self.k) / view.span_s
        future = ArrivalPattern(self.window.arrival_s[lo:hi] - view.now_s, classes, view.span_s)
        return self.planner.plan(rates, view.current, future, view.span_s)
