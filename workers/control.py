"""The control plane on the bus: forecaster stage -> scheduler worker -> switch planner -> engine hosts.

- `ForecasterStage`: counts arrivals per type and span on the clock; at each span boundary publishes a
  `ForecastMade` (the span's counts and the next span's forecast rates, from a forecaster with the
  policies' `forecast_rps` interface) and the misclassification rate seen in completions.
- `SchedulerWorker`: forecast -> `StrategyChosen` (deployment + weights), written to the KV bucket.
  The decision is the simulator's own `OServePolicy.decide` (forecast -> MILP deployment ->
  `stabilize` -> switch only when worth it); nothing is re-implemented here.
- `SwitchPlannerWorker`: strategy -> switch, as a transaction: start the new replicas, wait until all
  report ready, then flip the router (`AssignmentSet`) and drain the retired ones; if the new
  replicas are not ready in time, drain them again and publish `SwitchRolledBack`, the old
  deployment serving throughout.
- `EngineHost`: runs engine workers on one host on command (`StartReplica` after the modelled weight
  transfer time, `DrainReplica`).
One re-plan is one trace when a tracer is given: forecast -> strategy -> switch -> replica commands.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, Tracer

from oserve.observability.tracing import extract, inject
from oserve.scheduler.search import SearchConfig
from oserve.sim.cluster import Decision, SpanView
from oserve.sim.policies import Forecaster, LastSpanForecaster, OServePolicy, PlanningContext
from oserve.sim.twin import TwinConfig
from oserve.specs import Deployment, Replica, ReplicaShape
from oserve.streams.schemas import (Arrived, AssignmentSet, Completed, DrainReplica, ForecastMade, HostCommand,
                                    ReplicaDrained, ReplicaEvent, ReplicaReady, ReplicaSpec, SchemaError,
                                    StartReplica, StrategyChosen, SwitchCompleted, SwitchPlanned, SwitchRolledBack,
                                    decode, encode)
from oserve.streams.subjects import Subjects
from oserve.workers.backends import SimBackendConfig
from oserve.workers.base import Worker
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.router import Classifier

log = logging.getLogger(__name__)
MSG_ID = "Nats-Msg-Id"  # JetStream stores a message once per id within the stream's duplicate window


def _headers(span, msg_id: str) -> dict[str, str]:
    """Fresh headers: trace context (when traced) and the idempotency key."""
    out = inject(span)
    out[MSG_ID] = msg_id
    return out


# --- forecaster stage ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForecasterConfig:
    subjects: Subjects = field(default_factory=Subjects)
    span_s: float = 60.0
    """Span length on the clock (seconds)."""
    num_types: int = 4
    grace_wall_s: float = 0.2
    """Wall seconds after a span boundary before its counts are closed (arrival events are batched)."""
    max_history_spans: int = 1440
    """Spans of per-type counts kept (and rebuilt from the arrivals stream on a restart)."""

    def __post_init__(self) -> None:
        if not self.span_s > 0 or self.num_types < 1 or self.grace_wall_s < 0 or self.max_history_spans < 1:
            raise ValueError(f"ForecasterConfig: invalid values {self}")


class ForecasterStage(Worker):
    """Per-type arrivals per span -> a forecast event at each span boundary.

    Given a JetStream context, it reads arrivals from the arrivals stream from its start (an ordered
    consumer), so a restarted stage rebuilds the span counts it had (the clock must be the same one:
    `Clock.from_epoch`); without one it listens to live arrivals only.
    """

    name = "forecaster"

    def __init__(self, nc: NATS, config: ForecasterConfig, clock: Clock, *, forecaster: Forecaster | None = None,
                 classifier: Classifier | None = None, tracer: Tracer | None = None,
                 js: JetStreamContext | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.js = nc, config, clock, tracer, js
        self.forecaster = forecaster or LastSpanForecaster()
        self.classifier = classifier
        self._counts: dict[int, np.ndarray] = {}  # span index -> per-type arrivals
        self._misclassified = [0, 0]  # (wrong, total) completions since the last event
        self.history: list[np.ndarray] = []
        self.num_events = 0
        self._emitted: int | None = None  # last span closed

    async def _subscribe(self) -> list:
        s = self.config.subjects
        if self.js is not None:
            arrivals = await self.js.subscribe(s.arrivals(), cb=self._on_arrived, ordered_consumer=True,
                                               deliver_policy=DeliverPolicy.ALL, stream=s.stream_arrivals())
        else:
            arrivals = await self.nc.subscribe(s.arrivals(), cb=self._on_arrived)
        return [arrivals, await self.nc.subscribe(s.completions(), cb=self._on_completed)]

    def _loops(self):
        return [self._span_loop]

    async def _on_arrived(self, msg: Msg) -> None:
        try:
            ev = decode(msg.data, Arrived)
        except SchemaError:
            return
        assert isinstance(ev, Arrived)
        for a in ev.items:
            self.observe(a.type_index, a.at_s)

    def observe(self, type_index: int, at_s: float, num_requests: int = 1) -> None:
        """Count arrivals of a type at clock time `at_s` into their span (unless that span is closed)."""
        k, span_s = self.config.num_types, self.config.span_s
        span = int(at_s // span_s)
        oldest = self._emitted + 1 if self._emitted is not None else \
            int(self.clock.now_s() // span_s) - self.config.max_history_spans
        if span < oldest:
            return  # already closed, or beyond the history kept
        row = self._counts.get(span)
        if row is None:
            row = self._counts[span] = np.zeros(k, dtype=np.int64)
        row[min(max(type_index, 0), k - 1)] += num_requests

    @property
    def num_open_arrivals(self) -> int:
        """Arrivals counted in spans not closed yet."""
        return sum(int(c.sum()) for c in self._counts.values())

    async def _on_completed(self, msg: Msg) -> None:
        if self.classifier is None:
            return
        try:
            ev = decode(msg.data, Completed)
        except SchemaError:
            return
        assert isinstance(ev, Completed)
        for c in ev.items:
            self._misclassified[0] += self.classifier.classify(c.input_tokens, c.output_tokens) != c.type_index
            self._misclassified[1] += 1

    async def _span_loop(self) -> None:
        span_s = self.config.span_s
        span = int(self.clock.now_s() // span_s)
        while True:
            await self.clock.sleep_until((span + 1) * span_s)
            await asyncio.sleep(self.config.grace_wall_s)
            await self.emit(span)
            span += 1

    async def emit(self, span: int) -> ForecastMade:
        """Close span `span`: record its counts, forecast the next one, publish the event."""
        zeros = np.zeros(self.config.num_types, dtype=np.int64)
        if self._emitted is None and self._counts:
            # first close since start: spans rebuilt from the arrivals stream become the history
            for s in range(max(min(self._counts), span - self.config.max_history_spans), span):
                self.history.append(self._counts.pop(s, zeros))
        counts = self._counts.pop(span, zeros)
        for old in [s for s in self._counts if s < span]:
            del self._counts[old]
        self._emitted = span
        self.history.append(counts)
        del self.history[:-self.config.max_history_spans]
        rates = self.forecaster.forecast_rps(np.array(self.history, dtype=float), self.config.span_s)
        rates = np.maximum(np.nan_to_num(np.asarray(rates, dtype=float), nan=0.0, posinf=0.0), 0.0)  # JSON has no NaN
        wrong, total = self._misclassified
        self._misclassified = [0, 0]
        ev = ForecastMade(span_index=span, span_start_s=span * self.config.span_s, span_s=self.config.span_s,
                          observed_counts=[int(c) for c in counts], forecast_rps=[float(r) for r in rates],
                          misclassified_frac=wrong / total if total else 0.0)
        headers = None
        if self.tracer is not None:
            with self.tracer.start_as_current_span("forecast.made", kind=SpanKind.PRODUCER,
                                                   attributes={"oserve.span_index": span}) as sp:
                headers = inject(sp)
        await self.nc.publish(self.config.subjects.plan_event("forecast"), encode(ev), headers=headers)
        self.num_events += 1
        return ev


# --- scheduler worker ----------------------------------------------------------------------------------


class _GivenRates:
    """A forecaster that answers with the rates of the forecast event being handled."""

    def __init__(self) -> None:
        self.rates = np.zeros(0)

    def forecast_rps(self, observed_counts: np.ndarray, span_s: float) -> np.ndarray:
        return self.rates


def strategy_from_decision(decision: Decision, strategy_id: str, span_index: int) -> StrategyChosen:
    """The bus form of a policy decision. Pure."""
    reps = decision.deployment.replicas
    return StrategyChosen(
        strategy_id=strategy_id, span_index=span_index,
        replicas=[ReplicaSpec(replica_id=r.replica_id, tp=r.shape.tp, pp=r.shape.pp, gpu_ids=list(r.gpu_ids))
                  for r in reps],
        weights=[{r.replica_id: float(w) for r, w in zip(reps, row)} for row in decision.weights],
        switch_s=float(decision.switch_s), forecast_rps=[float(x) for x in decision.forecast_rps],
        label=decision.label)


def decision_from_strategy(s: StrategyChosen) -> Decision:
    """The policy form of a strategy event (to resume from the KV bucket). Pure."""
    reps = tuple(Replica(r.replica_id, ReplicaShape(r.tp, r.pp), tuple(r.gpu_ids)) for r in s.replicas)
    weights = tuple(tuple(row.get(r.replica_id, 0.0) for r in reps) for row in s.weights)
    return Decision(Deployment(reps), weights, s.switch_s, tuple(s.forecast_rps), s.label)


def _rename_new(decision: Decision, old: Deployment, strategy_id: str) -> Decision:
    """Give replicas new in `decision` ids unique to this strategy (kept ones keep theirs). Pure."""
    old_ids = {r.replica_id for r in old.replicas}
    reps = tuple(r if r.replica_id in old_ids else Replica(f"{strategy_id}-{r.replica_id}", r.shape, r.gpu_ids)
                 for r in decision.deployment.replicas)
    return Decision(Deployment(reps), decision.weights, decision.switch_s, decision.forecast_rps, decision.label,
                    decision.drain_retired)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    subjects: Subjects = field(default_factory=Subjects)
    span_s: float = 60.0
    """Span length on the clock (seconds); the forecasts it receives are per span."""

    def __post_init__(self) -> None:
        if not self.span_s > 0:
            raise ValueError(f"SchedulerConfig.span_s must be > 0, got {self.span_s}")


class SchedulerWorker(Worker):
    """Forecast events -> strategy events (and the KV bucket), by `OServePolicy.decide`."""

    name = "scheduler"

    def __init__(self, nc: NATS, kv: KeyValue, config: SchedulerConfig, clock: Clock, ctx: PlanningContext, *,
                 search_name: str = "milp", fewer_replicas_slack: float = 0.02, twin: bool = False,
                 tracer: Tracer | None = None) -> None:
        super().__init__()
        self.nc, self.kv, self.config, self.clock, self.ctx, self.tracer = nc, kv, config, clock, ctx, tracer
        self._given = _GivenRates()
        self.policy = OServePolicy(ctx, self._given, search_name=search_name,
                                   search_config=SearchConfig(fewer_replicas_slack=fewer_replicas_slack),
                                   twin=TwinConfig() if twin else None)
        self.current: Decision | None = None
        self.history: list[list[int]] = []
        self.strategies: list[StrategyChosen] = []
        self._lock = asyncio.Lock()
        self._run_id = uuid.uuid4().hex[:12]  # message ids are unique per run of this worker

    async def _subscribe(self) -> list:
        return [await self.nc.subscribe(self.config.subjects.plan_event("forecast"), cb=self._on_forecast)]

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
            await self._decide(-1, None, None)

    async def _on_forecast(self, msg: Msg) -> None:
        try:
            ev = decode(msg.data, ForecastMade)
        except SchemaError:
            return
        assert isinstance(ev, ForecastMade)
        try:
            await self._decide(ev.span_index, ev, msg.headers)
        except Exception:  # outermost: a failed plan keeps the current strategy
            log.exception("scheduler: planning for span %d failed", ev.span_index)

    async def _decide(self, span_index: int, ev: ForecastMade | None, headers) -> StrategyChosen:
        async with self._lock:
            if ev is not None:
                self.history.append(list(ev.observed_counts))
                self._given.rates = np.asarray(ev.forecast_rps, dtype=float)
            k = len(self.ctx.type_names)
            view = SpanView(span_index + 1, self.clock.now_s(), self.config.span_s,
                            np.array(self.history, dtype=float).reshape(-1, k), None, self.current)
            span = None
            if self.tracer is not None:
                span = self.tracer.start_span("scheduler.decide", context=extract(headers), kind=SpanKind.CONSUMER,
                                              attributes={"oserve.span_index": span_index})
            try:
                decision = await asyncio.to_thread(self.policy.decide, view)
                strategy_id = f"s{span_index + 1}"
                old = self.current.deployment if self.current else Deployment.empty()
                decision = _rename_new(decision, old, strategy_id)
                self.current = decision
                s = strategy_from_decision(decision, strategy_id, span_index + 1)
                await self.kv.put(Subjects.STRATEGY_KEY, encode(s))
                await self.nc.publish(self.config.subjects.plan_event("strategy"), encode(s),
                                      headers=_headers(span, f"{self._run_id}:{strategy_id}"))
                self.strategies.append(s)
                return s
            finally:
                if span is not None:
                    span.end()


# --- switch planner ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwitchPlannerConfig:
    subjects: Subjects = field(default_factory=Subjects)
    host_ids: tuple[str, ...] = ("local",)
    """Engine hosts; a replica goes to the host of its first GPU's node (node % number of hosts)."""
    gpus_per_node: int = 8
    ready_slack_wall_s: float = 5.0
    """Wall seconds allowed beyond the modelled switch time before a switch is rolled back."""

    def __post_init__(self) -> None:
        if not self.host_ids or self.gpus_per_node < 1 or self.ready_slack_wall_s <= 0:
            raise ValueError(f"SwitchPlannerConfig: invalid values {self}")


class SwitchPlannerWorker(Worker):
    """Strategy events -> replica commands -> router flip, as a transaction (see the module docstring)."""

    name = "switch-planner"

    def __init__(self, nc: NATS, config: SwitchPlannerConfig, clock: Clock, *, tracer: Tracer | None = None,
                 kv: KeyValue | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.kv = nc, config, clock, tracer, kv
        self.current: dict[str, ReplicaSpec] = {}  # replica_id -> spec, of the serving deployment
        self.strategy_id = ""
        self._queue: asyncio.Queue[tuple[StrategyChosen, dict | None]] = asyncio.Queue()
        self._ready: set[str] = set()
        self._ready_changed = asyncio.Event()
        self.events: list[str] = []  # switch event tags in order, for views and tests

    async def _subscribe(self) -> list:
        s = self.config.subjects
        return [await self.nc.subscribe(s.plan_event("strategy"), cb=self._on_strategy),
                await self.nc.subscribe(s.plan_event("replica"), cb=self._on_replica)]

    def _loops(self):
        return [self._switch_loop]

    async def _on_strategy(self, msg: Msg) -> None:
        try:
            s = decode(msg.data, StrategyChosen)
        except SchemaError:
            return
        assert isinstance(s, StrategyChosen)
        self._queue.put_nowait((s, msg.headers))

    async def _on_replica(self, msg: Msg) -> None:
        try:
            ev = decode(msg.data, ReplicaEvent)
        except SchemaError:
            return
        if isinstance(ev, ReplicaReady):
            self._ready.add(ev.replica_id)
        elif isinstance(ev, ReplicaDrained):
            self._ready.discard(ev.replica_id)
        self._ready_changed.set()

    def host_of(self, spec: ReplicaSpec) -> str:
        node = spec.gpu_ids[0] // self.config.gpus_per_node if spec.gpu_ids else 0
        return self.config.host_ids[node % len(self.config.host_ids)]

    async def _switch_loop(self) -> None:
        while True:
            s, headers = await self._queue.get()
            while not self._queue.empty():  # only the latest strategy matters
                s, headers = self._queue.get_nowait()
            try:
                await self.switch(s, headers)
            except Exception:  # outermost: report and keep the old deployment
                log.exception("switch planner: switch to %s failed", s.strategy_id)
                await self._publish_switch(SwitchRolledBack(strategy_id=s.strategy_id, reason="internal error"), None)

    async def _publish_switch(self, ev, headers) -> None:
        tag = ev.__struct_config__.tag
        self.events.append(tag)
        out = dict(headers) if headers else {}
        out[MSG_ID] = f"{ev.strategy_id}:{tag}:{len(self.events)}"
        await self.nc.publish(self.config.subjects.plan_event("switch"), encode(ev), headers=out)

    async def _command(self, spec_or_id, cmd, headers) -> None:
        host = self.host_of(spec_or_id) if isinstance(spec_or_id, ReplicaSpec) else \
            self.host_of(self.current.get(spec_or_id, ReplicaSpec(replica_id=spec_or_id, tp=1, pp=1, gpu_ids=[])))
        await self.nc.publish(self.config.subjects.host_control(host), encode(cmd), headers=headers)

    async def switch(self, s: StrategyChosen, headers=None) -> bool:
        """Carry out one strategy; True when it is serving, False when rolled back."""
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("switch.execute", context=extract(headers), kind=SpanKind.CONSUMER,
                                          attributes={"oserve.strategy_id": s.strategy_id})
        hdr = inject(span) if span is not None else None
        started = time.monotonic()
        try:
            target = {r.replica_id: r for r in s.replicas}
            start = [r for rid, r in target.items() if rid not in self.current]
            retire = [rid for rid in self.current if rid not in target]
            await self._publish_switch(SwitchPlanned(strategy_id=s.strategy_id, start_ids=[r.replica_id for r in start],
                                                     retire_ids=retire, switch_s=s.switch_s), hdr)
            if start:
                for r in start:
                    await self._command(r, StartReplica(strategy_id=s.strategy_id, replica=r,
                                                        ready_after_s=s.switch_s), hdr)
                need = {r.replica_id for r in start}
                timeout = self.clock.to_wall_s(s.switch_s) + self.config.ready_slack_wall_s

                async def all_ready() -> None:
                    while not need <= self._ready:
                        self._ready_changed.clear()
                        await self._ready_changed.wait()
                try:
                    await asyncio.wait_for(all_ready(), timeout)
                except TimeoutError:
                    for r in start:  # roll back: the old deployment never stopped serving
                        await self._command(r, DrainReplica(strategy_id=s.strategy_id, replica_id=r.replica_id), hdr)
                    missing = sorted(need - self._ready)
                    await self._publish_switch(SwitchRolledBack(
                        strategy_id=s.strategy_id, reason=f"replicas not ready after {timeout:.1f} s: {missing}"), hdr)
                    return False
            # every new replica serves: flip the router (and record it for routers that start later),
            # then retire the old ones
            assignment = encode(AssignmentSet(strategy_id=s.strategy_id, weights=s.weights))
            if self.kv is not None:
                await self.kv.put(Subjects.ASSIGNMENT_KEY, assignment)
            await self.nc.publish(self.config.subjects.plan_event("assignment"), assignment, headers=hdr)
            for rid in retire:
                await self._command(rid, DrainReplica(strategy_id=s.strategy_id, replica_id=rid), hdr)
            self.current = target
            self.strategy_id = s.strategy_id
            await self._publish_switch(SwitchCompleted(strategy_id=s.strategy_id,
                                                       switch_wall_s=time.monotonic() - started), hdr)
            return True
        finally:
            if span is not None:
                span.end()


# --- engine host ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineHostConfig:
    host_id: str = "local"
    subjects: Subjects = field(default_factory=Subjects)
    model: str = "llama2-7b"
    gpu: str = "h100-80gb"
    gpus_per_node: int = 8
    backend: str = "sim"
    """`sim` or `echo` (see `EngineWorkerConfig.backend`)."""
    heartbeat_interval_wall_s: float = 0.5

    def __post_init__(self) -> None:
        self.subjects.host_control(self.host_id)  # validates the id as a subject token
        if self.backend not in ("sim", "echo") or self.heartbeat_interval_wall_s <= 0 or self.gpus_per_node < 1:
            raise ValueError(f"EngineHostConfig: invalid values {self}")


class EngineHost(Worker):
    """Engine workers of one host, started and drained on command."""

    name = "engine-host"

    def __init__(self, nc: NATS, config: EngineHostConfig, clock: Clock, *, tracer: Tracer | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer = nc, config, clock, tracer
        self.engines: dict[str, EngineWorker] = {}
        self._retiring: dict[str, EngineWorker] = {}  # replica_id -> engine being drained on command
        self._starting: set[str] = set()
        self._cancelled_starts: set[str] = set()  # replica ids drained while starting; honoured after the sleep
        self._queue: asyncio.Queue[tuple[StartReplica | DrainReplica, dict | None]] = asyncio.Queue()

    async def _subscribe(self) -> list:
        return [await self.nc.subscribe(self.config.subjects.host_control(self.config.host_id), cb=self._on_command)]

    def _loops(self):
        return [self._command_loop]

    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd = decode(msg.data, HostCommand)
        except SchemaError:
            return
        self._queue.put_nowait((cmd, msg.headers))  # type: ignore[arg-type]

    async def _command_loop(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                cmd, headers = await self._queue.get()
                tg.create_task(self._run(cmd, headers))

    async def _run(self, cmd, headers) -> None:
        try:
            if isinstance(cmd, StartReplica):
                await self._start_replica(cmd, headers)
            else:
                await self._drain_replica(cmd, headers)
        except Exception:  # outermost for one command: the switch planner times out and rolls back
            log.exception("%s: command %s failed", self.config.host_id, cmd)

    async def _start_replica(self, cmd: StartReplica, headers) -> None:
        rid = cmd.replica.replica_id
        if rid not in self.engines and rid not in self._starting:
            self._starting.add(rid)
            try:
                await self.clock.sleep(cmd.ready_after_s)  # the modelled weight transfer
                if rid in self._cancelled_starts:  # drained while it started: never serves
                    log.info("%s: start of %s cancelled by a drain", self.config.host_id, rid)
                    return
                cfg = EngineWorkerConfig(rid, subjects=self.config.subjects,
                                         backend=self.config.backend,  # type: ignore[arg-type]
                                         sim=SimBackendConfig(self.config.model, self.config.gpu, cmd.replica.tp,
                                                              cmd.replica.pp, self.config.gpus_per_node),
                                         heartbeat_interval_wall_s=self.config.heartbeat_interval_wall_s)
                engine = EngineWorker(self.nc, cfg, self.clock, tracer=self.tracer)
                await engine.start()
                if rid in self._cancelled_starts:  # the drain came while it subscribed
                    await engine.stop()
                    return
                self.engines[rid] = engine
            finally:
                self._starting.discard(rid)
                self._cancelled_starts.discard(rid)
        if rid in self.engines:
            await self.nc.publish(self.config.subjects.plan_event("replica"),
                                  encode(ReplicaReady(strategy_id=cmd.strategy_id, replica_id=rid)), headers=headers)

    async def _drain_replica(self, cmd: DrainReplica, headers) -> None:
        engine = self.engines.pop(cmd.replica_id, None)
        if engine is None:
            if cmd.replica_id in self._starting:  # still loading: cancel the start, nothing to drain
                self._cancelled_starts.add(cmd.replica_id)
                await self.nc.publish(self.config.subjects.plan_event("replica"),
                                      encode(ReplicaDrained(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id)),
                                      headers=headers)
            return
        self._retiring[cmd.replica_id] = engine  # the host's own drain and stop still see it
        await engine.drain()
        await engine.stop()
        self._retiring.pop(cmd.replica_id, None)  # not on cancellation: the host's stop stops it
        await self.nc.publish(self.config.subjects.plan_event("replica"),
                              encode(ReplicaDrained(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id)),
                              headers=headers)

    async def _drain(self) -> None:
        await asyncio.gather(*(e.drain() for e in [*self.engines.values(), *self._retiring.values()]))

    async def _on_stop(self) -> None:
        for e in [*self.engines.values(), *self._retiring.values()]:
            await e.stop()
            await e.fail_inflight()  # stopped mid-drain: each client gets an error, not silence
        self.engines.clear()
        self._retiring.clear()
