"""The bus contract: subjects, message schemas, JetStream streams and KV buckets, the NATS launcher.

Installed as `oserve.streams` (the folder `streams/` maps to that import name); the core never imports it.
- `subjects`: every subject, stream and bucket name, from one prefix;
- `schemas`: versioned msgspec messages and strict edge decoding (`SchemaError`);
- `jetstream`: idempotent setup of the event streams and the strategy KV bucket;
- `server`: the embedded `nats-server` launcher.
"""

from oserve.streams.subjects import Subjects

__all__ = ["Subjects"]
