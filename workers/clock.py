"""The clock every worker reads: seconds since a start point, running `speedup` times faster than wall time."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from oserve.errors import ConfigError


class Clock:
    """Clock time `now_s()` = start_s + (wall seconds since creation) * speedup.

    Waits are computed from the clock (`sleep_until`), never by polling it. A worker's liveness
    timers (heartbeats) are in wall seconds: they watch processes, not the workload.
    """

    def __init__(self, speedup: float = 1.0, start_s: float = 0.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not speedup > 0:
            raise ConfigError(f"Clock: speedup must be > 0, got {speedup}")
        self.speedup = float(speedup)
        self.start_s = float(start_s)
        self._monotonic = monotonic
        self._wall0 = monotonic()
        self.epoch_unix_s = time.time() - self.start_s / self.speedup
        """The Unix time (wall seconds) at which this clock read 0: wall = epoch_unix_s + now_s() / speedup.
        Bus messages carry it (`clock_epoch_unix_s`, `clock_speedup`) so consumers can map `at_s` to wall time."""

    @classmethod
    def from_epoch(cls, epoch_unix_s: float, speedup: float = 1.0) -> Clock:
        """A clock that read 0 at the Unix time `epoch_unix_s`: processes given the same epoch agree.

        The wall clock is read once, here; afterwards time comes from the monotonic clock.
        """
        clock = cls(speedup, (time.time() - epoch_unix_s) * speedup)
        clock.epoch_unix_s = float(epoch_unix_s)  # exactly the one given, so processes report the same
        return clock

    def stamp(self) -> dict[str, float]:
        """The clock fields of a bus message (`clock_epoch_unix_s`, `clock_speedup`), as keyword arguments."""
        return {"clock_epoch_unix_s": self.epoch_unix_s, "clock_speedup": self.speedup}

    def now_s(self) -> float:
        return self.start_s + (self._monotonic() - self._wall0) * self.speedup

    def wall_seconds_until(self, t_s: float) -> float:
        """Wall seconds until the clock reads `t_s` (0 when it is already past)."""
        return max(0.0, (t_s - self.now_s()) / self.speedup)

    def to_wall_s(self, clock_s: float) -> float:
        """A clock duration in wall seconds."""
        return clock_s / self.speedup

    async def sleep_until(self, t_s: float) -> None:
        await asyncio.sleep(self.wall_seconds_until(t_s))

    async def sleep(self, clock_s: float) -> None:
        await asyncio.sleep(max(0.0, clock_s) / self.speedup)
