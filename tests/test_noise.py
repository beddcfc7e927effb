"""The paired block bootstrap of a P99 ratio (`oserve.evaluation.noise`): its invariants, and a bit-for-bit
check against a plain reference that groups requests by minute in a loop and takes each percentile by the
textbook formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.evaluation.noise import blocks_of, draws, p99_ratio_interval


@st.composite
def windows(draw, finite: bool = True):
    n = draw(st.integers(1, 120))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, draw(st.floats(1.0, 900.0)), n))
    ref = rng.gamma(2.0, draw(st.floats(0.1, 20.0)), n)
    other = rng.gamma(2.0, draw(st.floats(0.1, 20.0)), n)
    if not finite:
        ref[rng.random(n) < 0.05] = math.inf
        other[rng.random(n) < 0.05] = math.inf
    return arrival, ref, other


def _textbook_percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def _reference(arrival, ref, other, *, block_s, resamples, seed, level, q=99.0):
    """The same bootstrap, written plainly: requests grouped by minute in a loop, the same draws."""
    t0 = min(arrival)
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(arrival):
        groups.setdefault(int((t - t0) // block_s), []).append(i)
    blocks = [groups[k] for k in sorted(groups)]
    ratios = []
    for row in draws(len(blocks), resamples, seed):
        idx = [i for b in row for i in blocks[b]]
        ratios.append(_textbook_percentile([other[i] for i in idx], q) / _textbook_percentile([ref[i] for i in idx], q))
    ratios.sort()
    lo_rank, hi_rank = (1 - level) / 2 * (len(ratios) - 1), (1 + level) / 2 * (len(ratios) - 1)

    def at(rank):
        a = math.floor(rank)
        b = min(a + 1, len(ratios) - 1)
        return ratios[a] + (ratios[b] - ratios[a]) * (rank - a)
    whole = _textbook_percentile(list(other), q) / _textbook_percentile(list(ref), q)
    return whole, at(lo_rank), at(hi_rank), len(blocks)


@given(windows(), st.floats(5.0, 120.0), st.integers(0, 1000))
def test_matches_the_plain_reference(window, block_s, seed):
    arrival, ref, other = window
    got = p99_ratio_interval(arrival, ref, other, block_s=block_s, resamples=60, seed=seed)
    whole, low, high, n = _reference(arrival, ref, other, block_s=block_s, resamples=60, seed=seed, level=0.9)
    assert got.num_blocks == n and got.resamples == 60
    assert got.ratio == pytest.approx(whole, rel=1e-12)
    assert got.low == pytest.approx(low, rel=1e-12) and got.high == pytest.approx(high, rel=1e-12)


@given(windows(finite=False), st.integers(0, 1000))
def test_a_policy_against_itself_is_exactly_one_on_every_resample(window, seed):
    arrival, ref, _ = window
    r = p99_ratio_interval(arrival, ref, ref.copy(), resamples=50, seed=seed)
    assert (r.ratio, r.low, r.high) == (1.0, 1.0, 1.0) and not r.worse_beyond_noise


@given(windows(), st.sampled_from([0.25, 0.5, 2.0, 4.0]), st.integers(0, 1000))
def test_scaling_one_side_scales_the_ratio_and_its_interval(window, c, seed):
    arrival, ref, other = window
    base = p99_ratio_interval(arrival, ref, other, resamples=50, seed=seed)
    scaled = p99_ratio_interval(arrival, ref, other * c, resamples=50, seed=seed)
    # a power of two: every step of the percentile and the ratio scales exactly
    assert (scaled.ratio, scaled.low, scaled.high) == (base.ratio * c, base.low * c, base.high * c)


@given(windows(finite=False), st.integers(0, 1000))
def test_one_block_has_no_spread_and_the_interval_is_ordered(window, seed):
    arrival, ref, other = window
    one = p99_ratio_interval(arrival, ref, other, block_s=1e9, resamples=20, seed=seed)
    assert one.num_blocks == 1 and one.low == one.high == one.ratio
    many = p99_ratio_interval(arrival, ref, other, block_s=10.0, resamples=40, seed=seed)
    assert many.low <= many.high


@given(windows(), st.floats(1.0, 200.0))
def test_blocks_partition_the_requests_in_arrival_order(window, block_s):
    arrival, _, _ = window
    blocks = blocks_of(arrival, block_s)
    assert sorted(np.concatenate(blocks).tolist()) == list(range(len(arrival)))
    firsts = [int((arrival[b[0]] - arrival.min()) // block_s) for b in blocks]
    assert firsts == sorted(set(firsts))  # one block per minute that has arrivals, in order
    assert all(len({int((arrival[i] - arrival.min()) // block_s) for i in b}) == 1 for b in blocks)


def test_an_unfinished_tail_on_one_side_is_worse_beyond_noise():
    rng = np.random.default_rng(1)
    arrival = np.sort(rng.uniform(0, 1800, 3000))
    ref = rng.gamma(2.0, 5.0, 3000)
    ref[rng.random(3000) < 0.05] = math.inf  # 5% never finished: its P99 is inf on every resample
    other = rng.gamma(2.0, 5.0, 3000)
    r = p99_ratio_interval(arrival, ref, other)
    assert r.ratio == 0.0 and r.worse_beyond_noise and not r.better_beyond_noise
    flipped = p99_ratio_interval(arrival, other, ref)  # the other way round: the unfinished side is the other
    assert flipped.ratio == math.inf and flipped.better_beyond_noise and not flipped.worse_beyond_noise


def test_bad_input_names_the_problem():
    with pytest.raises(ConfigError, match="one non-zero length"):
        p99_ratio_interval(np.zeros(3), np.ones(3), np.ones(2))
    with pytest.raises(ConfigError, match="block_s > 0"):
        p99_ratio_interval(np.zeros(3), np.ones(3), np.ones(3), block_s=0.0)
