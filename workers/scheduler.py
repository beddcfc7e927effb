"""The scheduler worker: forecast events -> OServe's planner -> strategy events (and the KV bucket).

It calls `oserve.planner.OServePlanner.plan` — the very call the simulator's OServe policy makes —
with the forecast's rates, the decision in force and the arrivals the gateway saw in the span that
just closed (read from its `Arrived` events: offsets and classes, never output lengths at arrival) and
what each class turned out to contain lately (the lengths of the requests that finished in the last
`TwinConfig.recent_spans` spans, from the engines' `Completed` events, by class at arrival). The decision
goes to the strategy KV bucket (so a restarted scheduler resumes from the deployment in force) and out
as a `StrategyChosen` event. Planning runs in a thread, or in a child process that holds the planner
(`SchedulerConfig.planner_process`, `oserve.planner.process`): the event loop keeps serving meanwhile.

With a `SelfCorrectingPlanner` (one that has `observe`) the scheduler also learns capacity, as the
simulator's OServe policy does: it keeps each replica's latest `Heartbeat` and the `Completed` events, and
at each forecast event, before planning, tells the planner what every replica of the decision in force
did in the span that closed (`oserve.workers.span_telemetry.span_record`). The learner's state goes to the
strategy bucket after each decision (`Subjects.LEARNED_KEY`), so a restarted scheduler resumes with it,
and each strategy event carries the learned capacity it was planned with (`StrategyChosen.capacity_scales`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import msgspec
import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, Tracer

from oserve.decision import Decision
from oserve.defaults import SPAN_S
from oserve.errors import ConfigError
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import extract, inject, messaging_attributes, messaging_span_name
from oserve.planner.adaptive import SelfCorrectingPlanner, SpanRecord
from oserve.planner.learned import Correction
from oserve.planner.oserve import OServePlanner
from oserve.planner.process import PlannerProcess, observe_and_plan
from oserve.planner.static import StaticPlanner
from oserve.planner.twin import ArrivalPattern, RecentLengths, TwinConfig
from oserve.specs import Deployment, Replica, ReplicaShape
from oserve.streams.jetstream import EventPublisher
from oserve.streams.schemas import (Arrived, Completed, Completion, ForecastMade, Heartbeat, ReplicaSpec,
                                    StrategyChosen, decode, encode)
from oserve.streams.subjects import Subjects
from oserve.workers.base import Worker
from oserve.workers.clock import Clock
from oserve.workers.span_telemetry import ReplicaCounters, snapshot, span_record

log = logging.getLogger(__name__)
MSG_ID = "Nats-Msg-Id"  # JetStream stores a message once per id within the stream's duplicate window


def shares_from_weights(weights: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each class's per-replica rates as fractions of the class, summing to 1 (`{}` for a class whose
    rates are all 0: the plan gives it no replica). Pure."""
    shares = []
    for row in weights:
        total = sum(w for w in row.values() if w > 0)
        shares.append({rid: max(w, 0.0) / total for rid, w in row.items()} if total > 0 else {})
    return shares


def strategy_from_decision(decision: Decision, strategy_id: str, span_index: int, decide_wall_s: float = 0.0,
                           budget_wall_s: float = 0.0) -> StrategyChosen:
    """The bus form of a decision (with the wall seconds it took and its budget), its rates also as shares.
    Pure; the clock fields are left at their defaults (the worker stamps them)."""
    reps = decision.deployment.replicas
    weights = [{r.replica_id: float(w) for r, w in zip(reps, row)} for row in decision.weights]
    return StrategyChosen(
        strategy_id=strategy_id, span_index=span_index,
        replicas=[ReplicaSpec(replica_id=r.replica_id, tp=r.shape.tp, pp=r.shape.pp, gpu_ids=list(r.gpu_ids))
                  for r in reps],
        weights=weights, shares=shares_from_weights(weights),
        switch_s=float(decision.switch_s), forecast_rps=[float(x) for x in decision.forecast_rps],
        label=decision.label, scored_rps=[float(x) for x in decision.scored_rps],
        deferred_spans=decision.deferred_spans, decide_wall_s=decide_wall_s, budget_wall_s=budget_wall_s)


def capacity_rows(correction: Correction) -> list[list[float]]:
    """The bus form of a learned correction (`StrategyChosen.capacity_scales`): `[tp, pp, class_index, scale,
    sd]` for every pair of a shape with evidence and every pair whose (rounded) scale is not 1, by shape and
    class. Pure."""
    pairs = {p for p in correction.sd if correction.windows.get(p[0], 0) > 0} | set(correction.scales)
    return [[float(shape.tp), float(shape.pp), float(j), float(correction.scales.get((shape, j), 1.0)),
             float(correction.sd[(shape, j)])]
            for shape, j in sorted(pairs, key=lambda p: (p[0].tp, p[0].pp, p[1])) if (shape, j) in correction.sd]


def decision_from_strategy(s: StrategyChosen) -> Decision:
    """The decision a strategy event carries (to resume from the KV bucket). Pure."""
    reps = tuple(Replica(r.replica_id, ReplicaShape(r.tp, r.pp), tuple(r.gpu_ids)) for r in s.replicas)
    weights = tuple(tuple(row.get(r.replica_id, 0.0) for r in reps) for row in s.weights)
    return Decision(Deployment(reps), weights, s.switch_s, tuple(s.forecast_rps), s.label,
                    scored_rps=tuple(s.scored_rps), deferred_spans=s.deferred_spans)


def rename_new(decision: Decision, old: Deployment, strategy_id: str) -> Decision:
    """Give replicas new in `decision` ids unique to this strategy (kept ones keep theirs). Pure."""
    old_ids = {r.replica_id for r in old.replicas}
    reps = tuple(r if r.replica_id in old_ids else Replica(f"{strategy_id}-{r.replica_id}", r.shape, r.gpu_ids)
                 for r in decision.deployment.replicas)
    return replace(decision, deployment=Deployment(reps))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    subjects: Subjects = field(default_factory=Subjects)
    span_s: float = SPAN_S
    """Span length on the clock (seconds); the forecasts it receives are per span."""
    budget_frac: float = 0.1
    """A decision should take at most this fraction of a span (in wall time, at the clock's speed): a plan
    that arrives late serves less of the span it was made for. Held by `PlannerConfig.max_twin_scores`;
    each strategy event carries the time taken and this budget, and overruns are counted."""
    planner_process: bool = False
    """Make each decision in a child process that holds the planner (`oserve.planner.process`), not on a thread
    of this one: a decision is CPU work that otherwise holds the interpreter lock against this process's event
    loop (and whatever else it serves). The worker's `planner` is then a mirror, replaced after each decision
    by the state the child sends back; a child that dies costs one decision made here, and loses nothing learned."""

    def __post_init__(self) -> None:
        if not self.span_s > 0:
            raise ConfigError(f"SchedulerConfig.span_s must be > 0, got {self.span_s}")
        if not 0 < self.budget_frac <= 1:
            raise ConfigError(f"SchedulerConfig.budget_frac must be in (0, 1], got {self.budget_frac}")


class SchedulerWorker(Worker):
    """Forecast events -> strategy events (and the KV bucket), by the planner's `plan` (module docstring)."""

    name = "scheduler"

    def __init__(self, nc: NATS, kv: KeyValue, config: SchedulerConfig, clock: Clock,
                 planner: SelfCorrectingPlanner | OServePlanner | StaticPlanner, initial_rps: np.ndarray, *,
                 tracer: Tracer | None = None, metrics: Metrics | None = None,
                 events: EventPublisher | None = None) -> None:
        super().__init__()
        self.nc, self.kv, self.config, self.clock, self.planner, self.tracer = nc, kv, config, clock, planner, tracer
        self.events = events or EventPublisher(nc, None)
        """Strategy events go out through it: acknowledged by the plans stream where there is one."""
        self.metrics = metrics
        """Each decision's label and wall time, and overruns of its budget (None: no metrics)."""
        k = len(planner.class_names)
        self.initial_rps = np.asarray(initial_rps, dtype=float)
        if self.initial_rps.shape != (k,):
            raise ConfigError(f"SchedulerWorker: initial_rps needs {k} rates, got {self.initial_rps.shape}")
        self.current: Decision | None = None
        self.strategies: list[StrategyChosen] = []
        self.decide_s: list[float] = []
        """Wall seconds each decision took (learning from the span that closed, then planning)."""
        self.num_over_budget = 0
        """Decisions (after the first, made before serving) that took longer than the budget."""
        self._process = PlannerProcess() if config.planner_process and not isinstance(planner, StaticPlanner) \
            else None
        self._arrivals: dict[int, list[tuple[float, int]]] = {}  # span index -> (offset_s, class) seen so far
        twin = getattr(getattr(planner, "config", None), "twin", None)
        self.reads_lengths = twin is not None
        """The planner scores on the twin: the worker reads completions for what each class contained lately."""
        self._recent_spans = (twin or TwinConfig()).recent_spans
        self._finished: dict[int, list[tuple[int, int, int]]] = {}
        """span index -> (class at arrival, input, output tokens) of the requests that finished in it: what each
        class turned out to contain lately, for the twin (`oserve.planner.twin.RecentLengths`)."""
        self.learning = isinstance(planner, SelfCorrectingPlanner)
        """The planner learns capacity (it has `observe`): the worker reads heartbeats and completions."""
        self.records: list[SpanRecord] = []
        """What each span showed, as the planner was told it (learning only)."""
        self.heartbeats: dict[str, Heartbeat] = {}
        """replica id -> its latest heartbeat (learning only; a replica not in the decision in force is forgotten
        at the next forecast event)."""
        self._counters: dict[str, ReplicaCounters] = {}  # replica id -> counters at the last forecast event
        self._saturated: frozenset[str] = frozenset()  # replica ids saturated through the last span
        self._completions: list[Completion] = []  # finished after their replica's heartbeat at the last snapshot
        self._num_completed: dict[int, int] = {}  # span index -> completions that finished in it
        self._lock = asyncio.Lock()
        self._run_id = uuid.uuid4().hex[:12]  # message ids are unique per run of this worker

    async def _subscribe(self) -> list:
        s = self.config.subjects
        subs = [await self.nc.subscribe(s.arrivals(), cb=self.typed(Arrived, self._on_arrived))]
        if self.learning:
            subs.append(await self.nc.subscribe(s.heartbeats(), cb=self.typed(Heartbeat, self._on_heartbeat)))
        if self.learning or self.reads_lengths:
            subs.append(await self.nc.subscribe(s.completions(), cb=self.typed(Completed, self._on_completed)))
        forecasts = await self.nc.subscribe(s.plan_event("forecast"), cb=self.typed(ForecastMade, self._on_forecast))
        return [*subs, forecasts]

    async def start(self) -> None:
        if self._state != "new":
            return
        try:
            entry = await self.kv.get(Subjects.STRATEGY_KEY)
            s = decode(entry.value, StrategyChosen)
            assert isinstance(s, StrategyChosen)
            self.current = decision_from_strategy(s)  # resume: the deployment that is serving
            self.strategies.append(s)
        except KeyNotFoundError:
            pass
        if self.learning:
            await self._load_learned()
        if self._process is not None:
            self._process.start(self.planner)  # from the loop's thread: the child ignores Ctrl-C from the start
        await super().start()
        if self.current is None:
            await self._decide(-1, self.initial_rps, None, None)

    async def _load_learned(self) -> None:
        """Resume the learner from the strategy bucket; a state it refuses (another model's classes or shapes,
        or not JSON) is logged and the learner starts from its prior."""
        planner = self.planner
        assert isinstance(planner, SelfCorrectingPlanner)
        try:
            entry = await self.kv.get(Subjects.LEARNED_KEY)
        except KeyNotFoundError:
            return
        try:
            planner.learner.load_dict(json.loads(entry.value))
        except (ConfigError, ValueError, KeyError, TypeError) as exc:
            log.warning("scheduler: the learned capacity in the strategy bucket does not fit this planner; "
                        "starting from the performance model's: %s", exc)
            return
        planner.refresh()  # plan with the loaded correction from the first decision on

    async def _on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        last = self.heartbeats.get(hb.replica_id)
        if last is None or hb.at_s >= last.at_s:
            self.heartbeats[hb.replica_id] = hb

    async def _on_completed(self, ev: Completed, msg: Msg) -> None:
        span_s = self.config.span_s
        for c in ev.items:
            span = int(c.finished_at_s // span_s)
            if self.reads_lengths:
                self._finished.setdefault(span, []).append((c.type_index, c.input_tokens, c.output_tokens))
            if self.learning:
                self._completions.append(c)
                self._num_completed[span] = self._num_completed.get(span, 0) + 1

    def span_record(self, span_index: int, arrivals: int, arrivals_by_class: tuple[float, ...] = ()) -> SpanRecord:
        """What the replicas of the decision in force did since the last forecast event (their latest heartbeats
        now against then, their completions between), and the span's arrivals and completions; moves the
        snapshot on and forgets what it no longer needs."""
        planner = self.planner
        assert isinstance(planner, SelfCorrectingPlanner)
        now = snapshot(self.heartbeats, self.current)
        record, self._saturated = span_record(
            self._counters, now, self._completions, len(planner.class_names), self.config.span_s, arrivals=arrivals,
            num_completed=self._num_completed.get(span_index, 0), saturated_before=self._saturated,
            saturated_frac=planner.learner.config.saturated_frac, arrivals_by_class=arrivals_by_class)
        self._counters = now
        self._completions = [c for c in self._completions
                             if c.replica_id in now and c.finished_at_s > now[c.replica_id].at_s]
        self.heartbeats = {rid: hb for rid, hb in self.heartbeats.items() if rid in now}
        self._num_completed = {i: n for i, n in self._num_completed.items() if i > span_index}
        self.records.append(record)
        return record

    async def _on_arrived(self, ev: Arrived, msg: Msg) -> None:
        span_s = self.config.span_s
        for a in ev.items:
            span = int(a.at_s // span_s)
            self._arrivals.setdefault(span, []).append((a.at_s - span * span_s, a.type_index))

    def pattern(self, span_index: int) -> ArrivalPattern | None:
        """What arrived in span `span_index` (forgetting it and anything older), with the lengths of what each
        class contained among the requests that finished in the last `TwinConfig.recent_spans` spans up to it
        (forgetting older ones); None if nothing arrived (the twin then plays Poisson arrivals with the
        lengths measured before serving)."""
        seen = self._arrivals.pop(span_index, [])
        for old in [s for s in self._arrivals if s < span_index]:
            del self._arrivals[old]
        recent = RecentLengths(len(self.planner.class_names), self._recent_spans)
        for span in range(span_index - self._recent_spans + 1, span_index + 1):
            recent.add_span(self._finished.get(span, ()))
        for old in [s for s in self._finished if s <= span_index - self._recent_spans]:
            del self._finished[old]
        if not seen:
            return None
        offsets, classes = zip(*seen)
        return ArrivalPattern(np.array(offsets), np.array(classes), self.config.span_s, recent.lengths())

    async def _on_forecast(self, ev: ForecastMade, msg: Msg) -> None:
        try:
            rates = np.asarray(ev.forecast_rps, dtype=float)
            seen = self._arrivals.get(ev.span_index, ())
            by_class = np.bincount([c for _, c in seen if c >= 0], minlength=len(rates)) if seen else np.zeros(len(rates))
            await self._decide(ev.span_index, rates, self.pattern(ev.span_index), msg.headers, len(seen),
                               tuple(float(c) for c in by_class))
        except Exception:  # outermost: a failed plan keeps the current strategy
            log.exception("scheduler: planning for span %d failed", ev.span_index)

    def _observe_and_plan(self, record: SpanRecord | None, rates: np.ndarray,
                          recent: ArrivalPattern | None) -> Decision:
        if self._process is None:
            return observe_and_plan(self.planner, record, self.current, rates, recent, self.config.span_s)
        decision, self.planner = self._process.decide(self.planner, record, self.current, rates, recent,
                                                      self.config.span_s)
        return decision

    @property
    def planner_process(self) -> PlannerProcess | None:
        """The child process decisions are made in (`SchedulerConfig.planner_process`; None: on a thread)."""
        return self._process

    async def _on_stop(self) -> None:
        if self._process is not None:
            self._process.close()

    async def _decide(self, span_index: int, rates: np.ndarray, recent: ArrivalPattern | None,
                      headers, arrivals: int = 0, arrivals_by_class: tuple[float, ...] = ()) -> StrategyChosen:
        async with self._lock:
            span = None
            if self.tracer is not None:
                # processing a forecast message; the first decision, made before serving, processes none
                subject = self.config.subjects.plan_event("forecast" if span_index >= 0 else "strategy")
                op = ("process", "process") if span_index >= 0 else ("send", "publish")
                span = self.tracer.start_span(
                    messaging_span_name(op[1], subject), context=extract(headers),
                    kind=SpanKind.CONSUMER if span_index >= 0 else SpanKind.PRODUCER,
                    attributes={"oserve.step": "scheduler.decide", "oserve.span_index": span_index,
                                **messaging_attributes(subject, *op, message_id=f"span{span_index}"
                                                       if span_index >= 0 else "")})
            try:
                # the span that closed, before planning; learning (a model replica simulated per new class mix)
                # is part of the decision's time: the strategy waits for it
                record = self.span_record(span_index, arrivals, arrivals_by_class) \
                    if self.learning and span_index >= 0 else None
                started = time.perf_counter()
                decision = await asyncio.to_thread(self._observe_and_plan, record, rates, recent)
                took = time.perf_counter() - started
                self.decide_s.append(took)
                budget = self.clock.to_wall_s(self.config.budget_frac * self.config.span_s)
                over_budget = self.current is not None and took > budget  # the first, before serving, has none
                if over_budget:
                    self.num_over_budget += 1
                    log.warning("scheduler: the decision for span %d took %.2f s, over its budget of %.2f s",
                                span_index + 1, took, budget)
                strategy_id = f"s{span_index + 1}"
                old = self.current.deployment if self.current else Deployment.empty()
                decision = rename_new(decision, old, strategy_id)
                self.current = decision
                s = msgspec.structs.replace(strategy_from_decision(decision, strategy_id, span_index + 1, took, budget),
                                            **self.clock.stamp())
                if isinstance(self.planner, SelfCorrectingPlanner):
                    p = self.planner
                    s = msgspec.structs.replace(s, capacity_scales=capacity_rows(p.correction),
                                                guard_events=p.guard_events, underserved=p.last.underserved)
                    await self.kv.put(Subjects.LEARNED_KEY, json.dumps(p.learner.to_dict()).encode())
                await self.kv.put(Subjects.STRATEGY_KEY, encode(s))
                headers_out = inject(span) if span is not None else {}
                headers_out[MSG_ID] = f"{self._run_id}:{strategy_id}"
                await self.events.publish(self.config.subjects.plan_event("strategy"), encode(s), headers_out)
                self.strategies.append(s)
                if self.metrics is not None:
                    self.metrics.decision_made(s.label, took, over_budget=over_budget)
                return s
            finally:
                if span is not None:
                    span.end()
