"""Lifecycle shared by every worker: start / drain / stop, background loops in one owned TaskGroup."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from nats.aio.msg import Msg

from oserve.streams.schemas import SchemaError, decode

log = logging.getLogger(__name__)

RECANCEL_WALL_S = 1.0
"""How long `stop()` waits for the loops to end before it cancels the ones still running again. Python 3.11's
`asyncio.wait_for` can return the result it got at the moment its task was cancelled and so swallow the
cancellation (nats-py's `flush` is one): a loop that did carries on, and its TaskGroup would wait for it
forever."""


class Worker:
    """Base class: subclasses implement `_subscribe()`, `_loops()` and optionally `_drain()`.

    `start()` subscribes and launches the loops inside a TaskGroup owned by one runner task;
    `drain()` finishes in-flight work; `stop()` cancels the loops and unsubscribes (no waiting for
    in-flight work: a stopped worker is as good as a dead one). All three are idempotent.
    """

    name = "worker"

    def __init__(self) -> None:
        self.num_bad_messages = 0
        """Messages a typed subscription (`typed`) could not decode, and skipped."""
        self._subs: list = []
        self._runner: asyncio.Task[None] | None = None
        self._loop_tasks: list[asyncio.Task] = []
        self._state = "new"  # new -> started -> draining -> stopped
        self._drained = asyncio.Event()  # set once the first drain() ends (or is cancelled)
        self.failure: BaseException | None = None
        """The exception that killed a background loop (the worker then stopped itself), else None."""

    def typed(self, kind: Any, handler: Callable[[Any, Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback that decodes each message as `kind` (a schema or a union of them) and
        hands it to `handler(message, msg)`; one that does not validate is counted and skipped."""
        async def callback(msg: Msg) -> None:
            try:
                ev = decode(msg.data, kind)
            except SchemaError as exc:
                self.num_bad_messages += 1
                log.debug("%s: skipped a message on %s: %s", self.name, msg.subject, exc)
                return
            await handler(ev, msg)
        return callback

    @property
    def running(self) -> bool:
        return self._state in ("started", "draining")

    async def _subscribe(self) -> list:
        return []

    def _loops(self) -> list[Callable[[], Awaitable[None]]]:
        return []

    async def _drain(self) -> None:
        return None

    async def _on_stop(self) -> None:
        return None

    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "started"
        self._subs = await self._subscribe()
        loops = self._loops()
        if loops:
            self._runner = asyncio.create_task(self._run_loops(loops), name=f"{self.name}-loops")

    async def _run_loops(self, loops: list[Callable[[], Awaitable[None]]]) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._loop_tasks = [tg.create_task(loop()) for loop in loops]
        except* Exception as group:  # a loop died: the worker stops rather than stay half-alive
            self.failure = group.exceptions[0]
            for exc in group.exceptions:
                log.error("%s: background loop failed; stopping the worker", self.name, exc_info=exc)
            self._runner = None  # this task: stop() must not cancel and await itself
            await self.stop()

    async def drain(self) -> None:
        """Finish in-flight work; a second caller while a drain runs waits for that drain to end."""
        if self._state == "draining":
            await self._drained.wait()
            return
        if self._state != "started":
            return
        self._state = "draining"
        try:
            await self._drain()
        finally:
            self._drained.set()

    async def stop(self) -> None:
        if self._state == "stopped":
            return
        self._state = "stopped"
        self._drained.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            try:
                while not (await asyncio.wait([runner], timeout=RECANCEL_WALL_S))[0]:
                    for task in self._loop_tasks:  # one swallowed its cancellation (RECANCEL_WALL_S)
                        if not task.done():
                            log.debug("%s: a loop outlived its cancellation; cancelling it again", self.name)
                            task.cancel()
                if not runner.cancelled():
                    runner.result()
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # we are being cancelled ourselves: pass it on
                    raise
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed: nothing left to unsubscribe
                log.debug("%s: unsubscribe failed", self.name, exc_info=True)
        self._subs = []
        await self._on_stop()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
        await self.stop()
