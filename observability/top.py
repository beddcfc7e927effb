"""`oserve top`'s feed: a `LiveView` filled from the JetStream streams, history first, then new messages.

It reads only what a telemetry consumer may read (the read-only `telemetry` user of `deploy/`): the
telemetry stream (heartbeats and telemetry; the latest message of each replica) and the plans stream
(the latest event of each kind, so the plan in force shows however old it is, and every event of the
last `history_wall_s`, so recent switches show). Its consumers are ephemeral pull consumers with no
acks, which the server forgets once they are idle for `inactive_wall_s`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from oserve.errors import ConfigError
from oserve.observability.live_view import LiveView
from oserve.streams.subjects import Subjects


@dataclass(frozen=True, slots=True)
class TopConfig:
    subjects: Subjects = field(default_factory=Subjects)
    history_wall_s: float = 3600.0
    """Plan events of this many past wall seconds are read on start (beside the latest of each kind)."""
    fetch_batch: int = 256
    """Messages asked for per pull."""
    fetch_wait_s: float = 0.5
    """How long one pull waits for a message (wall seconds); also how long an empty stream delays start."""
    inactive_wall_s: float = 30.0
    """The server deletes a consumer of ours idle this long (wall seconds)."""

    def __post_init__(self) -> None:
        if not (self.history_wall_s >= 0 and self.fetch_batch >= 1 and self.fetch_wait_s > 0
                and self.inactive_wall_s > 0):
            raise ConfigError(f"TopConfig: history_wall_s must be >= 0 and fetch_batch, fetch_wait_s, "
                              f"inactive_wall_s positive, got {self}")


class TelemetryFeed:
    """Folds the telemetry and plans streams into `view`; `catch_up()` reads what is stored, `follow()`
    then applies new messages until cancelled."""

    def __init__(self, js: JetStreamContext, view: LiveView, config: TopConfig) -> None:
        self.js, self.view, self.config = js, view, config
        self._subs: list = []
        self._following: list = []  # the subscriptions that keep delivering after catch-up
        self.num_messages = 0

    def _consumer(self, deliver: DeliverPolicy, filters: list[str], **extra) -> ConsumerConfig:
        return ConsumerConfig(deliver_policy=deliver, ack_policy=AckPolicy.NONE, filter_subjects=filters,
                              inactive_threshold=self.config.inactive_wall_s, **extra)

    async def _pull(self, stream: str, cfg: ConsumerConfig):
        sub = await self.js.pull_subscribe(cfg.filter_subjects[0], stream=stream, config=cfg)  # type: ignore[index]
        self._subs.append(sub)
        return sub

    async def _drain(self, sub) -> list:
        """Every message the consumer has now (stops at the first with nothing pending after it)."""
        out: list = []
        while True:
            try:
                msgs = await sub.fetch(self.config.fetch_batch, timeout=self.config.fetch_wait_s)
            except nats.errors.TimeoutError:
                return out
            out.extend(msgs)
            if msgs and msgs[-1].metadata.num_pending == 0:
                return out

    async def catch_up(self) -> None:
        """Read the stored state: the latest telemetry of each replica, the latest and the recent plan events."""
        s = self.config.subjects
        telemetry = await self._pull(s.stream_telemetry(), self._consumer(
            DeliverPolicy.LAST_PER_SUBJECT, [s.heartbeats(), s.all_telemetry()]))
        latest_plans = await self._pull(s.stream_plans(), self._consumer(DeliverPolicy.LAST_PER_SUBJECT,
                                                                          [s.plan_events()]))
        since = datetime.now(timezone.utc) - timedelta(seconds=self.config.history_wall_s)
        recent_plans = await self._pull(s.stream_plans(), self._consumer(
            DeliverPolicy.BY_START_TIME, [s.plan_events()], opt_start_time=since))
        for msg in await self._drain(telemetry):
            self._apply(msg)
        # the latest of each kind and the recent ones overlap: apply each stored message once, in order
        plans = {m.metadata.sequence.stream: m for m in (await self._drain(latest_plans)) +
                 (await self._drain(recent_plans))}
        for seq in sorted(plans):
            self._apply(plans[seq])
        self._following = [telemetry, recent_plans]
        await latest_plans.unsubscribe()
        self._subs.remove(latest_plans)

    def _apply(self, msg) -> None:
        self.num_messages += 1
        self.view.apply(msg.subject, msg.data)

    async def follow(self) -> None:
        """Apply new messages as they are stored, until cancelled (call `catch_up()` first)."""
        async def one(sub) -> None:
            while True:
                try:
                    msgs = await sub.fetch(self.config.fetch_batch, timeout=self.config.fetch_wait_s)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    self._apply(msg)

        async with asyncio.TaskGroup() as tg:
            for sub in self._following:
                tg.create_task(one(sub))

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:  # connection already closing: the server forgets idle consumers anyway
                pass
        self._subs = []


async def snapshot_once(js: JetStreamContext, config: TopConfig) -> LiveView:
    """A view of what the streams hold now (what `oserve top --once` prints)."""
    view = LiveView(config.subjects)
    feed = TelemetryFeed(js, view, config)
    try:
        await feed.catch_up()
    finally:
        await feed.close()
    return view


def now_unix_s() -> float:
    """Wall time to judge heartbeats' age by (their clock fields map `at_s` onto it)."""
    return time.time()
