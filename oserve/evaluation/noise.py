"""How much of a P99 ratio is noise: a paired block bootstrap over the window's minutes. Pure.

Two policies on one scenario serve the same requests (the same window, in arrival order), so their P99
ratio has one source of noise the simulator cannot remove: the window is one draw of the workload, and a
tail percentile of a few minutes of bursts moves with which bursts it holds. The bootstrap resamples the
window's minutes (blocks of `block_s` seconds by arrival, drawn with replacement, as many as there are),
takes the same requests on both sides (paired), and recomputes both P99s on each resample. Blocks, not
single requests: latencies within a minute are correlated (a burst queues many requests at once), and
resampling requests one by one would treat them as independent and understate the noise.

Assumptions, stated: minutes are exchangeable (no long trend that resampling would break up), and a
request's latency belongs to the minute it arrived in (a queue that spans two minutes is split between
them). The interval is the percentile interval of the resampled ratios; with a few dozen minutes it is
a measure of spread, not a calibrated confidence interval.

A ratio is `other / reference` (`latency_ratio`: > 1, the reference is faster). Latencies are the
admitted requests', inf for one that never finished (`oserve.sim.kernel.latency_percentile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from oserve.errors import ConfigError
from oserve.sim.kernel import latency_percentile


@dataclass(frozen=True, slots=True)
class RatioInterval:
    """A P99 ratio (`other / reference`) and its spread under the block bootstrap."""

    ratio: float
    """On the whole window."""
    low: float
    high: float
    """The (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled ratios."""
    level: float
    num_blocks: int
    resamples: int

    @property
    def worse_beyond_noise(self) -> bool:
        """The whole interval is below 1: the reference is slower than the other on all but at most
        (1 - level) / 2 of the resamples."""
        return self.high < 1.0

    @property
    def better_beyond_noise(self) -> bool:
        """The whole interval is above 1: the reference is faster than the other on all but at most
        (1 - level) / 2 of the resamples."""
        return self.low > 1.0

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "level": self.level,
                "num_blocks": self.num_blocks, "resamples": self.resamples,
                "worse_beyond_noise": self.worse_beyond_noise, "better_beyond_noise": self.better_beyond_noise}


def latency_ratio(reference: float, other: float) -> float:
    """`other / reference` for two latency percentiles where inf is "too few finished": both inf a tie, an
    infinite reference 0, an infinite other inf. Pure."""
    if math.isinf(reference):
        return 1.0 if math.isinf(other) else 0.0
    if math.isinf(other):
        return math.inf
    return other / reference


def blocks_of(arrival_s: np.ndarray, block_s: float) -> list[np.ndarray]:
    """Indices of the requests of each block of `block_s` seconds from the first arrival (empty blocks
    left out), in arrival order within a block."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    if not len(arrival_s):
        return []
    which = ((arrival_s - arrival_s.min()) // block_s).astype(np.int64)
    order = np.argsort(which, kind="stable")
    bounds = np.flatnonzero(np.diff(which[order])) + 1
    return np.split(order, bounds)


def draws(num_blocks: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, num_blocks) block numbers, drawn with replacement: the resamples `p99_ratio_interval`
    takes for this seed."""
    return np.random.default_rng(seed).integers(0, num_blocks, size=(resamples, num_blocks))


def p99_ratio_interval(arrival_s: np.ndarray, reference_s: np.ndarray, other_s: np.ndarray, *,
                       block_s: float = 60.0, resamples: int = 400, level: float = 0.9, q: float = 99.0,
                       seed: int = 0) -> RatioInterval:
    """The P99 ratio of `other_s` over `reference_s` (latencies of the same requests, arriving at
    `arrival_s`) and its block-bootstrap interval (see the module docstring)."""
    arrival_s, reference_s, other_s = (np.asarray(a, dtype=float) for a in (arrival_s, reference_s, other_s))
    if not (len(arrival_s) == len(reference_s) == len(other_s)) or not len(arrival_s):
        raise ConfigError(f"p99_ratio_interval: arrivals and both latencies must be of one non-zero length, got "
                          f"{len(arrival_s)}, {len(reference_s)}, {len(other_s)}")
    if not block_s > 0 or resamples < 1 or not 0 < level < 1 or not 0 < q < 100:
        raise ConfigError(f"p99_ratio_interval: block_s > 0, resamples >= 1, 0 < level < 1 and 0 < q < 100, got "
                          f"{block_s}, {resamples}, {level}, {q}")
    blocks = blocks_of(arrival_s, block_s)
    picks = draws(len(blocks), resamples, seed)
    ratios = np.empty(resamples)
    for i, row in enumerate(picks):
        idx = np.concatenate([blocks[b] for b in row])
        ratios[i] = latency_ratio(latency_percentile(reference_s[idx], q), latency_percentile(other_s[idx], q))
    # an infinite ratio (the other side finished too few) ranks as the latencies' unfinished do
    low, high = (latency_percentile(ratios, 100 * p) for p in ((1 - level) / 2, (1 + level) / 2))
    whole = latency_ratio(latency_percentile(reference_s, q), latency_percentile(other_s, q))
    return RatioInterval(ratio=whole, low=low, high=high, level=level, num_blocks=len(blocks), resamples=resamples)
