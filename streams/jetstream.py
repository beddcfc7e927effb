"""JetStream streams and the strategy KV bucket: idempotent setup.

Streams (file storage, so a NATS restart loses nothing):
- arrivals: `Arrived` events from the gateways (the forecaster's input);
- completions: `Completed` events from the engines (true output lengths);
- plans: forecast, strategy, assignment and switch events;
- ownership: each gateway's journal of the requests it owns (`Owned`, `Settled`), an hour long
  (`StreamLimits.ownership_max_age_s`), so a gateway restarted after a crash takes them back;
- telemetry: heartbeats and telemetry (published on core NATS for the router; captured here with a short
  age and size bound, `StreamLimits.telemetry_max_age_s`, so a telemetry consumer reads recent history).
The plans and telemetry streams allow direct get (`$JS.API.DIRECT.GET.<stream>`), so a read-only user
(`oserve top`) reads their history without creating a consumer.
The KV bucket holds the latest strategy under `Subjects.STRATEGY_KEY`, the assignment the routers
follow under `Subjects.ASSIGNMENT_KEY` and the scheduler's learned capacity under `Subjects.LEARNED_KEY`. The models object store (`ensure_model_store`) holds trained
models, so a restarted worker reuses them instead of training again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from oserve.errors import ConfigError
from oserve.streams.schemas import MAX_MESSAGE_BYTES
from oserve.streams.subjects import Subjects

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Retention and replication of the event streams and buckets."""

    max_age_s: float = 7 * 24 * 3600.0
    """Events older than this are dropped (seconds)."""
    max_bytes: int = 1 << 30
    """Bytes kept per stream."""
    duplicate_window_s: float = 120.0
    """Window in which a repeated `Nats-Msg-Id` is stored once (seconds)."""
    telemetry_max_age_s: float = 3600.0
    """Heartbeats and telemetry older than this are dropped (seconds): a replica heartbeats twice a wall
    second, so an hour is about 7,200 messages (1.5 MB) per replica."""
    telemetry_max_bytes: int = 256 << 20
    """Bytes kept in the telemetry stream; the oldest go first."""
    ownership_max_age_s: float = 3600.0
    """The gateways' journals (`Subjects.ownership`) keep an hour: longer than any request may live
    (`GatewayConfig.max_request_wall_s`, 600 s), so a gateway restarted within it finds all it owned."""
    num_replicas: int = 1
    """Servers that hold a copy of each stream and bucket: 1 for one server, 3 on a 3-node cluster (a
    JetStream stream cannot have more replicas than the cluster has servers; 5 at most)."""

    def __post_init__(self) -> None:
        if self.max_age_s <= 0 or self.max_bytes <= 0 or self.duplicate_window_s <= 0:
            raise ConfigError(f"StreamLimits must be positive, got {self}")
        if not self.ownership_max_age_s > 0:
            raise ConfigError(f"StreamLimits.ownership_max_age_s must be positive, got {self.ownership_max_age_s}")
        if self.telemetry_max_age_s <= 0 or self.telemetry_max_bytes <= 0:
            raise ConfigError(f"StreamLimits: telemetry_max_age_s and telemetry_max_bytes must be positive, got "
                              f"{self.telemetry_max_age_s}, {self.telemetry_max_bytes}")
        if not 1 <= self.num_replicas <= 5:
            raise ConfigError(f"StreamLimits.num_replicas must be in 1..5, got {self.num_replicas}")


def stream_configs(subjects: Subjects, limits: StreamLimits = StreamLimits()) -> list[StreamConfig]:
    """The stream definitions for `subjects`. Pure."""
    common = dict(storage=StorageType.FILE, max_age=limits.max_age_s, max_bytes=limits.max_bytes,
                  max_msg_size=MAX_MESSAGE_BYTES, duplicate_window=limits.duplicate_window_s,
                  num_replicas=limits.num_replicas)
    return [
        StreamConfig(name=subjects.stream_arrivals(), subjects=[subjects.arrivals()], **common),
        StreamConfig(name=subjects.stream_completions(), subjects=[subjects.completions()], **common),
        StreamConfig(name=subjects.stream_plans(), subjects=[subjects.plan_events()], allow_direct=True, **common),
        StreamConfig(name=subjects.stream_ownership(), subjects=[subjects.ownerships()],
                     # a journal record wraps a whole dispatch (its prompt up to MAX_MESSAGE_BYTES) and its inbox
                     **{**common, "max_age": limits.ownership_max_age_s, "max_msg_size": 2 * MAX_MESSAGE_BYTES,
                        "duplicate_window": min(limits.duplicate_window_s, limits.ownership_max_age_s)}),
        StreamConfig(name=subjects.stream_telemetry(), subjects=[subjects.heartbeats(), subjects.all_telemetry()],
                     allow_direct=True,
                     **{**common, "max_age": limits.telemetry_max_age_s, "max_bytes": limits.telemetry_max_bytes,
                        "duplicate_window": min(limits.duplicate_window_s, limits.telemetry_max_age_s)}),
    ]


async def ensure_streams(js: JetStreamContext, subjects: Subjects,
                         limits: StreamLimits = StreamLimits()) -> KeyValue:
    """Create (or bring up to date) the streams and the strategy bucket; safe to call any number of times."""
    for cfg in stream_configs(subjects, limits):
        try:
            await js.stream_info(cfg.name)  # type: ignore[arg-type]
        except NotFoundError:
            try:
                await js.add_stream(cfg)
                continue
            except BadRequestError:  # created concurrently by another worker
                pass
        await js.update_stream(cfg)
    bucket = subjects.strategy_bucket()
    try:
        return await js.key_value(bucket)
    except NotFoundError:  # BucketNotFoundError
        pass
    return await js.create_key_value(KeyValueConfig(bucket=bucket, history=16, storage=StorageType.FILE,
                                                    replicas=limits.num_replicas))


async def ensure_model_store(js: JetStreamContext, subjects: Subjects, num_replicas: int = 1) -> ObjectStore:
    """The object store of trained models (file storage); created if missing, safe to call any number of times."""
    bucket = subjects.models_bucket()
    try:
        return await js.object_store(bucket)
    except NotFoundError:  # BucketNotFoundError
        pass
    try:
        return await js.create_object_store(bucket, config=ObjectStoreConfig(storage=StorageType.FILE,
                                                                                 replicas=num_replicas))
    except BadRequestError:  # created concurrently by another worker
        return await js.object_store(bucket)


class EventPublisher:
    """Publishes control-plane events with acknowledgement: on a subject a stream captures (the plans stream),
    `publish` returns once JetStream has stored the event (its `PubAck`), trying again until it has, so an
    event is never lost without the publisher knowing. Consumers subscribed on core NATS get it as before.

    Each event carries a `Nats-Msg-Id` (the caller's, else a fresh one), so a try whose acknowledgement was lost
    is stored once (the stream's duplicate window); a core subscriber may then hear it twice, which every
    control-plane consumer takes as the same event (strategies, assignments and replica events are idempotent
    by their ids). Without JetStream (`js` None: a server or a test without the streams) it publishes plainly:
    with no stream to acknowledge it, a retried publish would only be heard again.
    """

    def __init__(self, nc, js: JetStreamContext | None, *, timeout_s: float = 2.0, attempts: int = 3,
                 retry_wall_s: float = 0.25) -> None:
        if attempts < 1 or not timeout_s > 0:
            raise ConfigError(f"EventPublisher: attempts >= 1 and timeout_s > 0 required, got {attempts}, {timeout_s}")
        self.nc, self.js = nc, js
        self.timeout_s, self.attempts, self.retry_wall_s = timeout_s, attempts, retry_wall_s
        self.num_acked = 0
        """Events JetStream acknowledged."""
        self.num_retries = 0
        """Tries after the first (a lost or late acknowledgement, a disconnection)."""
        self.num_unacked = 0
        """Events no try got acknowledged (logged; the caller's own recovery takes over)."""
        self._ids = 0

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> bool:
        """Publish one event; True once stored (or, without JetStream, once handed to the connection)."""
        if self.js is None:
            await self.nc.publish(subject, data, headers=headers)
            return True
        out = dict(headers) if headers else {}
        if "Nats-Msg-Id" not in out:
            self._ids += 1
            out["Nats-Msg-Id"] = f"{uuid.uuid4().hex}-{self._ids}"
        for attempt in range(self.attempts):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.retry_wall_s * attempt)
            try:
                await self.js.publish(subject, data, timeout=self.timeout_s, headers=out)
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.debug("event on %s not acknowledged (%s); trying again", subject, exc)
                continue
            self.num_acked += 1
            return True
        self.num_unacked += 1
        log.warning("an event on %s was not acknowledged after %d tries", subject,
                                            self.attempts)
        return False
