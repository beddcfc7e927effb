"""The forecaster stage: per-class arrivals per span -> a forecast event at each span boundary.

Counts the gateway's `Arrived` events per span and class on the clock; at each span boundary it
publishes a `ForecastMade`: the span's counts, the next span's forecast rates (`RateForecaster` over
any forecaster of `oserve.forecast`, fitted on the counts the system started with), which forecaster
produced them, and the fraction of the span's completions whose true type differs from the class
they were routed as. One re-plan's trace starts here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from opentelemetry.trace import SpanKind, Tracer

from oserve.defaults import SPAN_S
from oserve.errors import ConfigError
from oserve.forecast.baselines import LastValue
from oserve.forecast.rates import RateForecaster
from oserve.observability.tracing import inject
from oserve.streams.schemas import Arrived, Completed, ForecastMade, encode
from oserve.streams.subjects import Subjects
from oserve.workers.base import Worker
from oserve.workers.clock import Clock
from oserve.workload_types import WorkloadTypes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ForecasterConfig:
    subjects: Subjects = field(default_factory=Subjects)
    span_s: float = SPAN_S
    """Span length on the clock (seconds)."""
    num_types: int = 4
    grace_wall_s: float = 0.2
    """Wall seconds after a span boundary before its counts are closed (arrival events are batched)."""
    max_history_spans: int = 1440
    """Spans of per-type counts kept (and rebuilt from the arrivals stream on a restart)."""

    def __post_init__(self) -> None:
        if not self.span_s > 0 or self.num_types < 1 or self.grace_wall_s < 0 or self.max_history_spans < 1:
            raise ConfigError(f"ForecasterConfig: invalid values {self}")


class ForecasterStage(Worker):
    """Per-type arrivals per span -> a forecast event at each span boundary.

    Given a JetStream context, it reads arrivals from the arrivals stream from its start (an ordered
    consumer), so a restarted stage rebuilds the span counts it had (the clock must be the same one:
    `Clock.from_epoch`); without one it listens to live arrivals only.
    """

    name = "forecaster"

    def __init__(self, nc: NATS, config: ForecasterConfig, clock: Clock, *, forecaster: RateForecaster | None = None,
                 types: WorkloadTypes | None = None, tracer: Tracer | None = None,
                 js: JetStreamContext | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.js = nc, config, clock, tracer, js
        self.forecaster = forecaster or RateForecaster(LastValue(config.num_types), config.span_s)
        if self.forecaster.k != config.num_types:
            raise ConfigError(f"ForecasterStage: the forecaster has {self.forecaster.k} classes, the config "
                              f"{config.num_types}")
        self.types = types
        """True types of completions (by their true lengths), to measure the arrival-time misclassification."""
        self._counts: dict[int, np.ndarray] = {}  # span index -> per-type arrivals
        self._misclassified = [0, 0]  # (wrong, total) completions since the last event
        self.history: list[np.ndarray] = []
        self.num_events = 0
        self._emitted: int | None = None  # last span closed

    async def _subscribe(self) -> list:
        s = self.config.subjects
        if self.js is not None:
            arrivals = await self.js.subscribe(s.arrivals(), cb=self.typed(Arrived, self._on_arrived),
                                               ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
                                               stream=s.stream_arrivals())
        else:
            arrivals = await self.nc.subscribe(s.arrivals(), cb=self.typed(Arrived, self._on_arrived))
        return [arrivals, await self.nc.subscribe(s.completions(), cb=self.typed(Completed, self._on_completed))]

    def _loops(self):
        return [self._span_loop]

    async def _on_arrived(self, ev: Arrived, msg: Msg) -> None:
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

    async def _on_completed(self, ev: Completed, msg: Msg) -> None:
        if self.types is None:
            return
        for c in ev.items:
            self._misclassified[0] += self.types.classify_one(c.input_tokens, c.output_tokens) != c.type_index
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
                rebuilt = self._counts.pop(s, zeros)
                self.history.append(rebuilt)
                self.forecaster.observe(rebuilt)
        counts = self._counts.pop(span, zeros)
        for old in [s for s in self._counts if s < span]:
            del self._counts[old]
        self._emitted = span
        self.history.append(counts)
        del self.history[:-self.config.max_history_spans]
        self.forecaster.observe(counts)
        rates = self.forecaster.rates_rps()
        wrong, total = self._misclassified
        self._misclassified = [0, 0]
        ev = ForecastMade(span_index=span, span_start_s=span * self.config.span_s, span_s=self.config.span_s,
                          observed_counts=[int(c) for c in counts], forecast_rps=[float(r) for r in rates],
                          misclassified_frac=wrong / total if total else 0.0, forecaster=self.forecaster.source)
        headers = None
        if self.tracer is not None:
            with self.tracer.start_as_current_span("forecast.made", kind=SpanKind.PRODUCER,
                                                   attributes={"oserve.span_index": span}) as sp:
                headers = inject(sp)
        await self.nc.publish(self.config.subjects.plan_event("forecast"), encode(ev), headers=headers)
        self.num_events += 1
        return ev
