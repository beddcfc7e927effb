"""A planner's decisions in a process of its own.

A live decision is CPU work in Python and numpy: learning from the span that closed (a model replica
simulated per new class mix), MILP solves that build the candidates, and twin simulations that score them.
On a thread of the process that also serves requests it shares one interpreter lock with the event loop,
and each slows the other: in the demo the gateway, the engines, the client and the scheduler share one
process, with the clock at 20x.

`PlannerProcess` makes each decision in a child process that holds the planner (and its caches) between
decisions. The caller's planner is a mirror: the child sends the planner back after every decision (a pickle
of tens of kilobytes, a millisecond or two each way), so whatever reads the planner reads what the child
holds. The first decision hands the caller's planner to the child, and so does any later one made with a
planner object the child did not send (one replaced meanwhile; a planner changed in place between decisions is
not seen, and nothing here does that after the first decision). A child that dies, or cannot be started or
reached, loses nothing: the decision is made on the caller's thread with the mirror, which is the planner as
of the last decision, and the next decision starts a new child. A planner that raises in the child raises
`PlannerFailed` here, after what it learned first has come back to the mirror, as on a thread. A child whose
parent is gone exits within half a second, and a child ignores Ctrl-C (`start`, `_child_init`). Pure in what
it decides: the same planner state and inputs give the same decision in the child as on a thread (a test
checks it).

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
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import numpy as np

from oserve.decision import Decision

log = logging.getLogger(__name__)

_held: Any = None
"""The planner the child holds (in the child process)."""


def _child_init(parent_pid: int) -> None:
    """In the child, before its first task: ignore Ctrl-C, and exit once the process that started it is gone
    (killed, say) instead of idling on. A terminal sends SIGINT to the whole foreground process group; the
    parent answers it (it drains, then stops the child). A child started from the main thread (`start`)
    ignores SIGINT from its first instruction, since it inherits the ignoring; this makes sure of it after the
    planner's modules are imported: one of them (polars, through `oserve.traces`) installs a SIGINT handler of
    its own in C when imported (measured: the kernel's disposition changed, the handler Python reports did
    not)."""
    import oserve.planner.adaptive  # noqa: F401  (what the planner unpickles into; see above)

    signal.signal(signal.SIGINT, signal.SIG_IGN)

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
            span_s: float) -> tuple[Decision | None, bytes, str]:
    """In the child: the decision (None when the planner raised), the planner as it stands after it (what
    `observe` learned is kept even when `plan` raised, as on a thread) and the planner's traceback ("" if none)."""
    try:
        decision, failed = observe_and_plan(_held, record, current, rates, recent, span_s), ""
    except Exception:  # the planner's own failure: the caller raises it, with what was learned kept
        decision, failed = None, traceback.format_exc()
    return decision, pickle.dumps(_held), failed


class PlannerFailed(RuntimeError):
    """The planner raised in the child process (its traceback is the message)."""


class PlannerProcess:
    """Decisions made in a child process (module docstring). `decide` blocks: call it from a thread (one
    decision at a time; a lock holds any other)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._mirror: Any = None
        """The planner object last sent back by the child: the child holds the same state. A planner handed
        in that is not this object is handed over; one changed in place between decisions is not seen."""
        self._adopting: Future | None = None
        """The child's first task, taking the planner `start` handed it (waited for by the first decision)."""
        self._lock = threading.Lock()
        self._closed = False
        self.num_children = 0
        """Child processes started (more than one: a child died and was replaced)."""
        self.num_fallbacks = 0
        """Decisions made on the caller's thread because the child could not make them (it died, or could
        not be started or reached) or because this was closed."""

    def decide(self, planner: Any, record: Any, current: Decision | None, rates: np.ndarray, recent: Any,
               span_s: float) -> tuple[Decision, Any]:
        """The decision, and the planner as it stands after it (the caller keeps that one). Raises
        `PlannerFailed` when the planner itself raised (what it learned first is in the planner returned with
        nothing: the caller's mirror is brought up to date before raising)."""
        with self._lock:
            if self._closed:
                self.num_fallbacks += 1
                return observe_and_plan(planner, record, current, rates, recent, span_s), planner
            try:
                if self._pool is None:
                    self._start(planner)
                if self._adopting is not None:
                    self._adopting.result()  # a child that could not take the planner falls back below
                    self._adopting = None
                if planner is not self._mirror:
                    self._pool.submit(_adopt, pickle.dumps(planner)).result()
                decision, state, failed = self._pool.submit(_decide, record, current, rates, recent, span_s).result()
            except Exception as exc:  # the child, not the planner (its failures come back as values)
                log.warning("planner process: %s: %s; this decision is made in the scheduler's process, the next "
                            "one in a new child", type(exc).__name__, exc)
                self._shutdown()
                self.num_fallbacks += 1
                return observe_and_plan(planner, record, current, rates, recent, span_s), planner
            self._mirror = pickle.loads(state)
            if failed:
                raise PlannerFailed(f"the planner raised in its process:\n{failed}")
            return decision, self._mirror

    def start(self, planner: Any) -> None:
        """Start the child, holding `planner`, without waiting for it (its first decision does). Called from the
        main thread (the scheduler's `start`, on the event loop), the child is spawned with SIGINT ignored, so
        a Ctrl-C while it starts does not reach it; from another thread (a new child after one died) it ignores
        SIGINT only once `_child_init` runs. The process is spawned by the first `submit`, in this thread."""
        with self._lock:
            if self._pool is None and not self._closed:
                self._start(planner)

    def _start(self, planner: Any) -> None:
        main = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self._pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_child_init,
                                             initargs=(os.getpid(),))
            self.num_children += 1
            self._adopting = self._pool.submit(_adopt, pickle.dumps(planner))
            self._mirror = planner  # what the child holds once `_adopt` has run, before any decision it is sent
        finally:
            if main and handler is not None:  # None: a handler Python did not install, which it cannot restore
                signal.signal(signal.SIGINT, handler)

    def child_pid(self) -> int | None:
        """The child's process id (None when none runs)."""
        procs = list(getattr(self._pool, "_processes", None) or ())
        return procs[0] if procs else None

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            self._mirror = self._adopting = None

    def close(self) -> None:
        """Stop the child (it holds nothing the caller's mirror does not); a decision under way finishes first,
        and any later one is made on the caller's thread."""
        self._closed = True
        with self._lock:
            self._shutdown()
