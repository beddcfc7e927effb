"""The scheduler worker: forecast events -> OServe's planner -> strategy events (and the KV bucket).

It calls `oserve.planner.OServePlanner.plan` — the very call the simulator's OServe policy makes —
with the forecast's rates, the decision in force and the arrivals the gateway saw in the span that
just closed (read from its `Arrived` events: offsets and classes, never output lengths). The decision
goes to the strategy KV bucket (so a restarted scheduler resumes from the deployment in force) and out
as a `StrategyChosen` event. Planning runs in a thread: the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
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
from oserve.planner.oserve import OServePlanner
from oserve.planner.static import StaticPlanner
from oserve.planner.twin import ArrivalPattern
from oserve.specs import Deployment, Replica, ReplicaShape
from oserve.streams.schemas import Arrived, ForecastMade, ReplicaSpec, StrategyChosen, decode, encode
from oserve.streams.subjects import Subjects
from oserve.workers.base import Worker
from oserve.workers.clock import Clock

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

    def __post_init__(self) -> None:
        if not self.span_s > 0:
            raise ConfigError(f"SchedulerConfig.span_s must be > 0, got {self.span_s}")
        if not 0 < self.budget_frac <= 1:
            raise ConfigError(f"SchedulerConfig.budget_frac must be in (0, 1], got {self.budget_frac}")


class SchedulerWorker(Worker):
    """Forecast events -> strategy events (and the KV bucket), by `OServePlanner.plan`."""

    name = "scheduler"

    def __init__(self, nc: NATS, kv: KeyValue, config: SchedulerConfig, clock: Clock,
                 planner: OServePlanner | StaticPlanner, initial_rps: np.ndarray, *, tracer: Tracer | None = None,
                 metrics: Metrics | None = None) -> None:
        super().__init__()
        self.nc, self.kv, self.config, self.clock, self.planner, self.tracer = nc, kv, config, clock, planner, tracer
        self.metrics = metrics
        """Each decision's label and wall time, and overruns of its budget (None: no metrics)."""
        k = len(planner.class_names)
        self.initial_rps = np.asarray(initial_rps, dtype=float)
        if self.initial_rps.shape != (k,):
            raise ConfigError(f"SchedulerWorker: initial_rps needs {k} rates, got {self.initial_rps.shape}")
        self.current: Decision | None = None
        self.strategies: list[StrategyChosen] = []
        self.decide_s: list[float] = []
        """Wall seconds each plan took."""
        self.num_over_budget = 0
        """Decisions (after the first, made before serving) that took longer than the budget."""
        self._arrivals: dict[int, list[tuple[float, int]]] = {}  # span index -> (offset_s, class) seen so far
        self._lock = asyncio.Lock()
        self._run_id = uuid.uuid4().hex[:12]  # message ids are unique per run of this worker

    async def _subscribe(self) -> list:
        s = self.config.subjects
        return [await self.nc.subscribe(s.arrivals(), cb=self.typed(Arrived, self._on_arrived)),
                await self.nc.subscribe(s.plan_event("forecast"), cb=self.typed(ForecastMade, self._on_forecast))]

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
        await super().start()
        if self.current is None:
            await self._decide(-1, self.initial_rps, None, None)

    async def _on_arrived(self, ev: Arrived, msg: Msg) -> None:
        span_s = self.config.span_s
        for a in ev.items:
            span = int(a.at_s // span_s)
            self._arrivals.setdefault(span, []).append((a.at_s - span * span_s, a.type_index))

    def pattern(self, span_index: int) -> ArrivalPattern | None:
        """What arrived in span `span_index` (forgetting it and anything older); None if nothing did."""
        seen = self._arrivals.pop(span_index, [])
        for old in [s for s in self._arrivals if s < span_index]:
            del self._arrivals[old]
        if not seen:
            return None
        offsets, classes = zip(*seen)
        return ArrivalPattern(np.array(offsets), np.array(classes), self.config.span_s)

    async def _on_forecast(self, ev: ForecastMade, msg: Msg) -> None:
        try:
            rates = np.asarray(ev.forecast_rps, dtype=float)
            await self._decide(ev.span_index, rates, self.pattern(ev.span_index), msg.headers)
        except Exception:  # outermost: a failed plan keeps the current strategy
            log.exception("scheduler: planning for span %d failed", ev.span_index)

    async def _decide(self, span_index: int, rates: np.ndarray, recent: ArrivalPattern | None,
                      headers) -> StrategyChosen:
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
                started = time.perf_counter()
                decision = await asyncio.to_thread(self.planner.plan, rates, self.current, recent, self.config.span_s)
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
                await self.kv.put(Subjects.STRATEGY_KEY, encode(s))
                headers_out = inject(span) if span is not None else {}
                headers_out[MSG_ID] = f"{self._run_id}:{strategy_id}"
                await self.nc.publish(self.config.subjects.plan_event("strategy"), encode(s), headers=headers_out)
                self.strategies.append(s)
                if self.metrics is not None:
                    self.metrics.decision_made(s.label, took, over_budget=over_budget)
                return s
            finally:
                if span is not None:
                    span.end()
