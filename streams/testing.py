"""Helpers for tests against a real `nats-server`: a pytest fixture factory and a per-test prefix."""

from __future__ import annotations

import itertools
import os
from typing import Iterator

from oserve.streams.server import NatsServer
from oserve.streams.subjects import Subjects

_counter = itertools.count()


def unique_subjects(stem: str = "t") -> Subjects:
    """A `Subjects` with a prefix no other test in this process uses."""
    return Subjects(f"{stem}{os.getpid()}x{next(_counter)}")


def running_server(**kwargs) -> Iterator[NatsServer]:
    """Generator for a pytest fixture: one real server (JetStream, port -1, temp store) for its scope."""
    server = NatsServer(**kwargs).start()
    try:
        yield server
    finally:
        server.stop()
