"""Sets of half-open integer intervals, the arithmetic the switch planner runs on. Pure.

An `IntervalSet` is a tuple of sorted, disjoint, non-touching `(lo, hi)` pairs with `lo < hi`; the empty
set is `()`. Every function takes and returns that normal form, so sets compare with `==` and hash.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[int, int]
IntervalSet = tuple[Interval, ...]

EMPTY: IntervalSet = ()


def normalize(intervals: Iterable[Interval]) -> IntervalSet:
    """The normal form of any iterable of (lo, hi) pairs: empty ones dropped, overlaps and touches merged."""
    items = sorted((int(lo), int(hi)) for lo, hi in intervals if hi > lo)
    out: list[Interval] = []
    for lo, hi in items:
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def length(s: IntervalSet) -> int:
    """Integers the set covers."""
    return sum(hi - lo for lo, hi in s)


def union(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    if not a:
        return b
    if not b:
        return a
    return normalize(a + b)


def intersection(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def difference(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """Integers in `a` and not in `b`."""
    if not a or not b:
        return a
    out: list[Interval] = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            if cur >= hi:
                break
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return tuple(out)


def contains(outer: IntervalSet, inner: IntervalSet) -> bool:
    """Whether every integer of `inner` is in `outer`."""
    return not difference(inner, outer)


def offset_of(s: IntervalSet, index: int) -> int:
    """Position of integer `index` in the concatenation of the set's intervals (local storage offset).

    Raises:
        KeyError: `index` is not in the set.
    """
    pos = 0
    for lo, hi in s:
        if lo <= index < hi:
            return pos + index - lo
        pos += hi - lo
    raise KeyError(f"{index} not in {s}")
