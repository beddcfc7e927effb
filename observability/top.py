"""`oserve top`'s feed: a `LiveView` filled from the JetStream streams, history first, then new messages.

It reads only what the read-only `telemetry` user of `deploy/` may read, and creates nothing on the
server: history comes by JetStream direct get (`$JS.API.DIRECT.GET.<stream>`, answered from the stream
without a consumer; the streams set `allow_direct`), new messages by core-NATS subscriptions on the
heartbeat, telemetry and plan subjects. It reads the telemetry stream (heartbeats and telemetry; the
latest message of each replica) and the plans stream (the latest event of each kind, so the plan in
force shows however old it is, and every event of the last `history_wall_s`, so recent switches show).
The telemetry user may not create consumers, since a push consumer's deliver subject is not checked
against its creator's permissions and could re-publish stored events onto any subject.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from oserve.errors import ConfigError
from oserve.observability.live_view import LiveView
from oserve.streams.subjects import Subjects

MAX_MULTI_LAST_SUBJECTS = 1024
"""A direct get for the last message of several subjects answers 413 beyond this many (nats-server 2.11+)."""


@dataclass(frozen=True, slots=True)
class TopConfig:
    subjects: Subjects = field(default_factory=Subjects)
    history_wall_s: float = 3600.0
    """Plan events of this many past wall seconds are read on start (beside the latest of each kind)."""
    fetch_batch: int = 256
    """Messages asked for per direct-get request (at most `MAX_MULTI_LAST_SUBJECTS`)."""
    request_timeout_s: float = 5.0
    """How long one direct-get request may take to answer in full (wall seconds)."""

    def __post_init__(self) -> None:
        if not (self.history_wall_s >= 0 and 1 <= self.fetch_batch <= MAX_MULTI_LAST_SUBJECTS
                and self.request_timeout_s > 0):
            raise ConfigError(f"TopConfig: history_wall_s must be >= 0, fetch_batch in 1..{MAX_MULTI_LAST_SUBJECTS} "
                              f"and request_timeout_s positive, got {self}")


class TelemetryFeed:
    """Folds the telemetry and plans streams into `view`; `catch_up()` reads what is stored, `follow()`
    then applies new messages until cancelled."""

    def __init__(self, nc: Client, view: LiveView, config: TopConfig) -> None:
        self.nc, self.view, self.config = nc, view, config
        self._subs: list = []
        self._live: asyncio.Queue[Msg] = asyncio.Queue()
        self._num_early = 0  # live messages that arrived during catch-up, maybe also read from a stream
        self._caught_up: set[tuple[str, bytes]] = set()  # (subject, data) applied by catch-up
        self.num_messages = 0

    async def _direct_batch(self, stream: str, request: dict) -> tuple[list[Msg], int]:
        """One batched direct get: the messages it answers and the number still pending after them."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        out: list[Msg] = []
        try:
            await self.nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
            deadline_s = time.monotonic() + self.config.request_timeout_s
            while True:
                try:
                    msg = await sub.next_msg(timeout=max(deadline_s - time.monotonic(), 0.001))
                except nats.errors.TimeoutError:
                    raise ConfigError(f"no answer to a direct get on stream {stream} within "
                                      f"{self.config.request_timeout_s} s") from None
                headers = msg.headers or {}
                status = headers.get("Status")
                if status is None:
                    out.append(msg)
                elif status == "204":  # end of batch
                    return out, int(headers.get("Nats-Num-Pending", "0"))
                elif status == "404":  # nothing (more) matches
                    return out, 0
                else:
                    raise ConfigError(f"direct get on stream {stream} answered {status} "
                                      f"{headers.get('Description', '')}: {request}")
        finally:
            await sub.unsubscribe()

    async def _check_direct(self, stream: str, subjects_filter: str | None = None) -> list[str]:
        """The stream's subjects matching `subjects_filter` (none asked: none listed); refuses a stream
        without direct get (raises `nats.js.errors.NotFoundError` for a missing one)."""
        info = await self.nc.jetstream().stream_info(stream, subjects_filter=subjects_filter)
        if not info.config.allow_direct:
            raise ConfigError(f"stream {stream} does not allow direct get: start a worker of this OServe version "
                              f"once (its stream setup turns allow_direct on)")
        return sorted(info.state.subjects or {}) if subjects_filter else []

    async def _last_per_subject(self, stream: str, subjects: list[str]) -> list[Msg]:
        """The latest stored message of each of `subjects`, in stream order."""
        out: list[Msg] = []
        n = self.config.fetch_batch
        for i in range(0, len(subjects), n):
            chunk = subjects[i:i + n]
            msgs, _ = await self._direct_batch(stream, {"multi_last": chunk, "batch": len(chunk)})
            out.extend(msgs)
        return sorted(out, key=_seq)

    async def _since(self, stream: str, subject: str, start: datetime) -> list[Msg]:
        """Every stored message on `subject` (wildcards allowed) stored at or after `start`, in order."""
        request: dict = {"start_time": start.isoformat(), "next_by_subj": subject, "batch": self.config.fetch_batch}
        out: list[Msg] = []
        while True:
            msgs, num_pending = await self._direct_batch(stream, request)
            out.extend(msgs)
            if not msgs or num_pending == 0:
                return out
            request = {"seq": _seq(msgs[-1]) + 1, "next_by_subj": subject, "batch": self.config.fetch_batch}

    async def _on_live(self, msg: Msg) -> None:
        self._live.put_nowait(msg)

    async def catch_up(self, follow: bool = True) -> None:
        """Read the stored state: the latest telemetry of each replica, the latest and the recent plan events.
        With `follow`, subscribe first, so `follow()` misses nothing stored meanwhile."""
        s = self.config.subjects
        if follow:
            for subject in (s.heartbeats(), s.all_telemetry(), s.plan_events()):
                self._subs.append(await self.nc.subscribe(subject, cb=self._on_live))
            await self.nc.flush()
        # ">" lists every subject of the stream: its heartbeats and telemetry of each replica
        telemetry_subjects = await self._check_direct(s.stream_telemetry(), ">")
        await self._check_direct(s.stream_plans())
        for msg in await self._last_per_subject(s.stream_telemetry(), telemetry_subjects):
            self._apply_stored(msg)
        since = datetime.now(timezone.utc) - timedelta(seconds=self.config.history_wall_s)
        latest = await self._last_per_subject(s.stream_plans(), [s.plan_events()])
        recent = await self._since(s.stream_plans(), s.plan_events(), since)
        # the latest of each kind and the recent ones overlap: apply each stored message once, in order
        plans = {_seq(m): m for m in latest + recent}
        for seq in sorted(plans):
            self._apply_stored(plans[seq])
        self._num_early = self._live.qsize()

    def _apply_stored(self, msg: Msg) -> None:
        subject = (msg.headers or {})["Nats-Subject"]  # a direct get answer arrives on our inbox
        self.num_messages += 1
        self._caught_up.add((subject, msg.data))
        self.view.apply(subject, msg.data)

    async def follow(self) -> None:
        """Apply new messages as they arrive, until cancelled (call `catch_up()` first)."""
        while True:
            msg = await self._live.get()
            # a message that arrived during catch-up may be one catch-up read from the stream: apply it once
            # (one older than the stored latest of its replica shows until that replica's next heartbeat)
            if self._num_early:
                self._num_early -= 1
                if (msg.subject, msg.data) in self._caught_up:
                    continue
            else:
                self._caught_up.clear()
            self.num_messages += 1
            self.view.apply(msg.subject, msg.data)

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:  # connection already closing: its subscriptions end with it
                pass
        self._subs = []


def _seq(msg: Msg) -> int:
    """A direct get answer's stream sequence."""
    return int((msg.headers or {})["Nats-Sequence"])


async def snapshot_once(nc: Client, config: TopConfig) -> LiveView:
    """A view of what the streams hold now (what `oserve top --once` prints)."""
    view = LiveView(config.subjects)
    feed = TelemetryFeed(nc, view, config)
    try:
        await feed.catch_up(follow=False)
    finally:
        await feed.close()
    return view


def now_unix_s() -> float:
    """Wall time to judge heartbeats' age by (their clock fields map `at_s` onto it)."""
    return time.time()
