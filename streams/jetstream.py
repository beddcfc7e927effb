"""JetStream streams and the strategy KV bucket: idempotent setup.

Streams (file storage, so a NATS restart loses nothing):
- arrivals: `Arrived` events from the gateways (the forecaster's input);
- completions: `Completed` events from the engines (true output lengths);
- plans: forecast, strategy, assignment and switch events;
- telemetry: heartbeats and telemetry (published on core NATS for the router; captured here with a short
  age and size bound, `StreamLimits.telemetry_max_age_s`, so a telemetry consumer reads recent history).
The plans and telemetry streams allow direct get (`$JS.API.DIRECT.GET.<stream>`), so a read-only user
(`oserve top`) reads their history without creating a consumer.
The KV bucket holds the latest strategy under `Subjects.STRATEGY_KEY`, the assignment the routers
follow under `Subjects.ASSIGNMENT_KEY` and the scheduler's learned capacity under `Subjects.LEARNED_KEY`. The models object store (`ensure_model_store`) holds trained
models, so a restarted worker reuses them instead of training again.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from oserve.errors import ConfigError
from oserve.streams.schemas import MAX_MESSAGE_BYTES
from oserve.streams.subjects import Subjects


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
    num_replicas: int = 1
    """Servers that hold a copy of each stream and bucket: 1 for one server, 3 on a 3-node cluster (a
    JetStream stream cannot have more replicas than the cluster has servers; 5 at most)."""

    def __post_init__(self) -> None:
        if self.max_age_s <= 0 or self.max_bytes <= 0 or self.duplicate_window_s <= 0:
            raise ConfigError(f"StreamLimits must be positive, got {self}")
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
