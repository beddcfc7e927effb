"""Helpers for tests against a real `nats-server`: a pytest fixture factory and a per-test prefix."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Callable, Iterator

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


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for a condition the system reaches on its own (bounded; fails with `what`)."""
    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(loop(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def ping_until_up(client, timeout_s: float) -> None:
    """Wait until a gateway answers `client`'s pings and sees at least one replica (bounded)."""
    from oserve.streams.client import ClientError

    async def loop() -> None:
        while True:
            try:
                if (await client.ping(timeout_s=0.5)).num_replicas > 0:
                    return
            except ClientError:
                pass
            await asyncio.sleep(0.1)
    await asyncio.wait_for(loop(), timeout_s)
