"""The forecaster stage: per-class arrivals per span -> a forecast event at each span boundary.

Counts the gateway's `Arrived` events per span and class on the clock; at each span boundary it
publishes a `ForecastMade`: the span's counts, the next span's forecast rates, which forecaster
produced them and the recent relative RMSE of each, and the fraction of the span's completions whose
true type differs from the class they were routed as. One re-plan's trace starts here.

The forecast comes from `oserve.forecast.gate.GatedForecaster`: last value, or an LSTM
(`oserve.forecast.lstm`) while it beats last value on the recent spans. The LSTM is trained on a
thread of its own (never on the event loop), first once the history the system starts from and the
spans counted since hold enough spans, then again every `retrain_every_spans` spans; each trained network is put in
the JetStream object store with the class names and the last span it learned, so a restarted stage
loads it instead of training again, and re-learns only the spans after it (from the arrivals stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import ObjectStore
from opentelemetry.trace import SpanKind, Tracer

from oserve.defaults import SPAN_S
from oserve.errors import ConfigError, OServeError
from oserve.forecast.baselines import LastValue
from oserve.forecast.gate import GatedForecaster
from oserve.forecast.registry import forecaster_from_dict
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import inject, messaging_attributes, messaging_span_name
from oserve.streams.jetstream import EventPublisher
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
    `Clock.from_epoch`); without one it listens to live arrivals only. Given an object store, it saves
    every trained LSTM there and, at start, loads the one saved for the same class names.
    """

    name = "forecaster"

    def __init__(self, nc: NATS, config: ForecasterConfig, clock: Clock, *, forecaster: GatedForecaster | None = None,
                 types: WorkloadTypes | None = None, tracer: Tracer | None = None,
                 js: JetStreamContext | None = None, store: ObjectStore | None = None,
                 class_names: tuple[str, ...] = (), metrics: Metrics | None = None,
                 events: EventPublisher | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.js, self.store = nc, config, clock, tracer, js, store
        self.events = events or EventPublisher(nc, None)
        """Forecast events go out through it: acknowledged by the plans stream where there is one."""
        self.metrics = metrics
        """Each forecast's observed and forecast rates per type, errors, misclassification (None: no metrics)."""
        self.forecaster = forecaster or GatedForecaster(LastValue(config.num_types), config.span_s)
        if self.forecaster.k != config.num_types:
            raise ConfigError(f"ForecasterStage: the forecaster has {self.forecaster.k} classes, the config "
                              f"{config.num_types}")
        self.class_names = tuple(class_names)
        """The classes' names, saved with the LSTM: a saved network is reused only for the same classes."""
        self.types = types
        """True types of completions (by their true lengths), to measure the arrival-time misclassification."""
        self._counts: dict[int, np.ndarray] = {}  # span index -> per-type arrivals
        self._misclassified = [0, 0]  # (wrong, total) completions since the last event
        self.history: list[np.ndarray] = []
        self.num_events = 0
        self.num_trainings = 0
        """LSTM trainings finished by this stage (0 after a restart that loaded a saved network)."""
        self.loaded_from_store = False
        self._emitted: int | None = None  # last span closed
        self._learned_through = -1  # the saved LSTM learned every span up to this one
        self._retrain = asyncio.Event()

    async def start(self) -> None:
        if self._state == "new":
            await self._load_saved()
        await super().start()

    async def _load_saved(self) -> None:
        """Put the saved LSTM in the challenger's place when it was trained for these classes."""
        challenger = self.forecaster.challenger
        if self.store is None or challenger is None:
            return
        try:
            data = json.loads((await self.store.get(Subjects.FORECASTER_OBJECT)).data or b"{}")
            saved = forecaster_from_dict(data.get("forecaster"), "the saved forecaster")
            meta = dict(data["meta"])
            learned_through = int(meta["last_span_index"])
            saved_at = (float(meta["saved_unix_s"]), float(meta["saved_clock_s"]))
        except ObjectNotFoundError:
            return
        except (ValueError, TypeError, KeyError, AttributeError, OServeError) as exc:  # unreadable: train again
            log.warning("forecaster: ignoring the saved LSTM: %s", exc)
            return
        if tuple(meta.get("class_names", ())) != self.class_names or meta.get("span_s") != self.config.span_s \
                or saved.kind != challenger.kind or saved.params() != challenger.params():
            log.info("forecaster: the saved LSTM is for other classes, spans or settings (%s); training anew", meta)
            return
        # its spans are spans of the clock it was saved on: this clock must read what that one would now
        expected_s = saved_at[1] + (time.time() - saved_at[0]) * self.clock.speedup
        if abs(self.clock.now_s() - expected_s) > self.config.span_s:
            log.info("forecaster: the saved LSTM was saved on another clock; it learns every span from here")
            learned_through = -1
        self.forecaster.challenger = saved
        self._learned_through = learned_through
        self.loaded_from_store = True
        log.info("forecaster: loaded the saved LSTM (learned through span %d)", self._learned_through)

    async def _save(self) -> None:
        challenger = self.forecaster.challenger
        if self.store is None or challenger is None:
            return
        last = self._emitted if self._emitted is not None else -1
        data = {"meta": {"class_names": list(self.class_names), "span_s": self.config.span_s,
                         "last_span_index": last, "saved_unix_s": time.time(), "saved_clock_s": self.clock.now_s()},
                "forecaster": challenger.to_dict()}
        await self.store.put(Subjects.FORECASTER_OBJECT, json.dumps(data, separators=(",", ":")).encode())

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
        return [self._span_loop, self._retrain_loop]

    async def _retrain_loop(self) -> None:
        """Train the LSTM on a thread whenever it asks to be, one training at a time."""
        while True:
            job = self.forecaster.retrain_job()  # a snapshot of what has been learned up to now
            if job is None:
                self._retrain.clear()
                await self._retrain.wait()
                continue
            try:
                trained = await asyncio.to_thread(job.run)
            except Exception:  # outermost for one training: keep the network in use
                log.exception("forecaster: LSTM training failed; keeping the current network")
                self._retrain.clear()
                await self._retrain.wait()
                continue
            self.forecaster.install(trained)
            self.num_trainings += 1
            log.info("forecaster: LSTM trained on %d spans (%d epochs)", len(job.history), trained.epochs_run)
            try:
                await self._save()
            except Exception:  # the store is a convenience: a failed save costs a training after a restart
                log.warning("forecaster: could not save the LSTM", exc_info=True)

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
            if self._emitted is not None or any(s <= span for s in self._counts):
                await self.emit(span)
            # else: nothing has arrived since the system started (arrivals stamped in the next span, come in during
            # the grace, do not count): an empty span says nothing of the demand (the system was starting), and the
            # strategy planned from the history stays in force
            span += 1

    def _observe_span(self, counts: np.ndarray, span: int) -> None:
        """Feed a closed span to the forecasters; a loaded LSTM skips the spans it learned before it was saved."""
        challenger = self.forecaster.challenger
        learned = (challenger.kind,) if challenger is not None and span <= self._learned_through else ()
        self.forecaster.observe(counts, learned_by=learned)

    async def emit(self, span: int) -> ForecastMade:
        """Close span `span`: record its counts, forecast the next one, publish the event."""
        zeros = np.zeros(self.config.num_types, dtype=np.int64)
        if self._emitted is None and self._counts:
            # first close since start: spans rebuilt from the arrivals stream become the history (a
            # loaded LSTM has learned those up to `_learned_through` already)
            for s in range(max(min(self._counts), span - self.config.max_history_spans), span):
                rebuilt = self._counts.pop(s, zeros)
                self.history.append(rebuilt)
                self._observe_span(rebuilt, s)
        counts = self._counts.pop(span, zeros)
        for old in [s for s in self._counts if s < span]:
            del self._counts[old]
        self._emitted = span
        self.history.append(counts)
        del self.history[:-self.config.max_history_spans]
        self._observe_span(counts, span)
        rates = self.forecaster.rates_rps()
        if self.forecaster.needs_retrain():
            self._retrain.set()
        wrong, total = self._misclassified
        self._misclassified = [0, 0]
        errors = {kind: e for kind, e in self.forecaster.recent_rrmse().items() if math.isfinite(e)}
        ev = ForecastMade(span_index=span, span_start_s=span * self.config.span_s, span_s=self.config.span_s,
                          observed_counts=[int(c) for c in counts], forecast_rps=[float(r) for r in rates],
                          misclassified_frac=wrong / total if total else 0.0, forecaster=self.forecaster.source,
                          recent_rrmse=errors, forecaster_note=self.forecaster.why_not_challenger()
                          if self.forecaster.challenger is not None else "", **self.clock.stamp())
        if self.metrics is not None:
            k = self.config.num_types
            names = self.class_names if len(self.class_names) == k else tuple(str(j) for j in range(k))
            self.metrics.forecast_made(type_names=names, observed_rps=[c / self.config.span_s for c in ev.observed_counts],
                                       forecast_rps=ev.forecast_rps, recent_rrmse=errors,
                                       misclassified_frac=ev.misclassified_frac, forecaster=ev.forecaster)
        headers = None
        subject, payload = self.config.subjects.plan_event("forecast"), encode(ev)
        if self.tracer is not None:
            with self.tracer.start_as_current_span(
                    messaging_span_name("publish", subject), kind=SpanKind.PRODUCER,
                    attributes={"oserve.step": "forecast.made", "oserve.span_index": span,
                                **messaging_attributes(subject, "send", "publish", message_id=f"span{span}",
                                                       body_size_bytes=len(payload))}) as sp:
                headers = inject(sp)
        await self.events.publish(subject, payload, headers)
        self.num_events += 1
        return ev
