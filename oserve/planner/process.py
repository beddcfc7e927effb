"""A planner's decisions in a process of its own.

A live decision is CPU work in Python and numpy: learning from the span that closed (a model replica
simulated per new class mix), MILP solves that build the candidates, and twin simulations that score them.
On a thread of the process that also serves requests it shares one interpreter lock with the event loop,
and each slows the other: in the demo the gateway, the engines, the client and the scheduler share one
process, with the clock at 20x.

`PlannerProcess` makes each decision in a child process that holds the planner (and its caches) between
decisions. The caller's planner is a mirror: the child sends the planner back after every decision (a
pickle of tens of kilobytes, a millisecond or two each way), so whatever reads the planner reads what the
child holds. The first decision hands the caller's planner to the child, and so does any later one made
with a planner object the child did not send (one replaced or loaded meanwhile). A child that dies loses
nothing: the decision is made on the caller's thread with the mirror, which is the planner as of the last
decision, and the next decision starts a new child. A child whose parent is gone exits within half a
second. Pure in what it decides: the same planner state and inputs give the same decision in the child as
on a thread (a test checks it).

Measured in the demo (README, "What the demo measured"): the slowest decision took 1.00-1.05 s of wall time
in a child against 1.50-1.63 s on a thread. In the child a rescoring's wall time is its CPU time (0.41-0.83
s), so what is left over the 0.3 s budget at 20x is the decision's own work, not the lock.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any

import numpy as np

from oserve.decision import Decision

log = logging.getLogger(__name__)

_held: Any = None
"""The planner the child holds (in the child process)."""


def _watch_parent(parent_pid: int) -> None:
    """In the child: exit once the process that started it is gone (killed, say), instead of idling on."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="planner-parent-watch", daemon=True).start()


def _adopt(state: bytes) -> int:
    global _held
    _held = pickle.loads(state)
    return 0


def observe_and_plan(planner: Any, record: Any, current: Decision | None, rates: np.ndarray, recent: Any,
                     span_s: float) -> Decision:
    """Learn from the span that closed (`record`, under `current`; a planner with `observe` only), then plan.
    What the scheduler does for each decision, in whichever process."""
    if record is not None and current is not None and hasattr(planner, "observe"):
        planner.observe(record, current)
    return planner.plan(rates, current, recent, span_s)


def _decide(record: Any, current: Decision | None, rates: np.ndarray, recent: Any,
            span_s: float) -> tuple[Decision, bytes]:
    decision = observe_and_plan(_held, record, current, rates, recent, span_s)
    return decision, pickle.dumps(_held)


class PlannerProcess:
    """Decisions made in a child process (module docstring). `decide` blocks: call it from a thread."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._mirror: Any = None
        """The planner object last sent back by the child: the child holds the same state."""
        self.num_children = 0
        """Child processes started (more than one: a child died and was replaced)."""
        self.num_fallbacks = 0
        """Decisions made on the caller's thread because the child died."""

    def decide(self, planner: Any, record: Any, current: Decision | None, rates: np.ndarray, recent: Any,
               span_s: float) -> tuple[Decision, Any]:
        """The decision, and the planner as it stands after it (the caller keeps that one)."""
        try:
            if self._pool is None:
                self._start(planner)
            elif planner is not self._mirror:
                self._pool.submit(_adopt, pickle.dumps(planner)).result()
            decision, state = self._pool.submit(_decide, record, current, rates, recent, span_s).result()
        except BrokenProcessPool:
            log.warning("planner process died; this decision is made in the scheduler's process, the next one in "
                        "a new child")
            self.close()
            self.num_fallbacks += 1
            return observe_and_plan(planner, record, current, rates, recent, span_s), planner
        self._mirror = pickle.loads(state)
        return decision, self._mirror

    def _start(self, planner: Any) -> None:
        """Start the child, holding `planner`. It starts with Ctrl-C blocked: a terminal sends SIGINT to the whole
        foreground process group, and the child is not the one to answer it (its parent drains, then stops it)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:  # the process is spawned by the first submit, from this thread: it inherits this thread's mask
            self._pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_watch_parent,
                                             initargs=(os.getpid(),))
            self.num_children += 1
            self._mirror = None
            future = self._pool.submit(_adopt, pickle.dumps(planner))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        future.result()

    def close(self) -> None:
        """Stop the child (it holds nothing the caller's mirror does not)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            self._mirror = None
