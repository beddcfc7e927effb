"""Workload types: cluster requests into types, count types per span, measure how the mix varies. Pure.

No asyncio, no NATS, no clock reads; randomness comes in as a seed.

A request is a point (input tokens, output tokens). Types are k-means clusters of these points in log
space, `(log1p(input_tokens), log1p(output_tokens))`, named by position as the OServe paper does
(SISO, SILO, LISO, LILO: short/long input, short/long output) and kept stable across refits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from oserve.errors import ConfigError
from oserve.traces import Trace

NAMES_4: tuple[str, str, str, str] = ("SISO", "SILO", "LISO", "LILO")
# grid corner (input long?, output long?) of each name in NAMES_4, in the same order
_CORNERS_4 = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])

NUM_LENGTH_SAMPLES = 32  # representative lengths kept per type (quantiles of its members)

# The paper's Table 1: type mixes in percent of SILO / LILO / SISO / LISO.
COMPOSITIONS: dict[str, dict[str, float]] = {
    "S1": {"SILO": 26.3, "LILO": 26.2, "SISO": 27.3, "LISO": 20.2},
    "S2": {"SILO": 30.0, "LILO": 28.0, "SISO": 24.2, "LISO": 17.8},
    "S3": {"SILO": 18.8, "LILO": 18.9, "SISO": 35.5, "LISO": 26.8},
    "S4": {"SILO": 13.2, "LILO": 14.2, "SISO": 41.1, "LISO": 31.5},
    "S5": {"SILO": 8.2, "LILO": 8.2, "SISO": 47.1, "LISO": 36.6},
}
# The paper's Table 2: mixes one after another.
SEQUENCES: dict[str, tuple[str, ...]] = {
    "T1": ("S1", "S2", "S1"),
    "T2": ("S1", "S3", "S2"),
    "T3": ("S2", "S4", "S3"),
    "T4": ("S1", "S4", "S5"),
}

# --------------------------------------------------------------------------------------------------
# Workload types


@dataclass(frozen=True, slots=True)
class TypeStats:
    """Summary of one workload type's members in the data it was fitted on."""

    num_requests: int
    share: float  # fraction of the fitted requests in this type
    mean_input_tokens: float
    mean_output_tokens: float
    # NUM_LENGTH_SAMPLES quantiles of the members' lengths at levels (i + 0.5) / NUM_LENGTH_SAMPLES,
    # each an observed length; each carries weight 1 / NUM_LENGTH_SAMPLES
    input_samples_tokens: tuple[int, ...]
    output_samples_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WorkloadTypes:
    """Workload types: named centroids in (log1p input, log1p output) space with per-type statistics.

    Index j everywhere (centroids, stats, `classify` results, span counts) is the type `names[j]`.
    Only tuples inside, so it is hashable and can key caches.
    """

    names: tuple[str, ...]
    centroids_log: tuple[tuple[float, float], ...]  # (log1p(input_tokens), log1p(output_tokens))
    stats: tuple[TypeStats, ...]
    inertia: float  # sum over fitted requests of the squared log-space distance to their centroid
    _centroids: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _pairs: tuple[tuple[float, float], ...] = field(init=False, repr=False, compare=False, hash=False)
    """`_centroids` as Python floats (float64 whatever `centroids_log` held), for `classify_one`."""

    def __post_init__(self) -> None:
        k = len(self.names)
        if k < 1 or len(self.centroids_log) != k or len(self.stats) != k:
            raise ConfigError(f"WorkloadTypes needs as many centroids ({len(self.centroids_log)}) and "
                              f"stats ({len(self.stats)}) as names ({k}), at least one")
        if len(set(self.names)) != k:
            raise ConfigError(f"WorkloadTypes names must be unique: {self.names}")
        centroids = np.array(self.centroids_log, dtype=np.float64).reshape(k, 2)
        if not np.isfinite(centroids).all():
            raise ConfigError(f"WorkloadTypes centroids must be finite: {self.centroids_log}")
        centroids.setflags(write=False)
        object.__setattr__(self, "_centroids", centroids)
        object.__setattr__(self, "_pairs", tuple((float(a), float(b)) for a, b in centroids.tolist()))

    @property
    def k(self) -> int:
        """Number of types. Pure."""
        return len(self.names)

    @property
    def centroids_tokens(self) -> tuple[tuple[float, float], ...]:
        """Centroids back in tokens, (expm1 input, expm1 output): the geometric centre of each type. Pure."""
        return tuple((math.expm1(a), math.expm1(b)) for a, b in self.centroids_log)

    def index(self, name: str) -> int:
        """Index of the type called `name`. Pure."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError(f"no workload type {name!r}; types: {', '.join(self.names)}") from None

    def classify(self, input_tokens: np.ndarray | int, output_tokens: np.ndarray | int) -> np.ndarray:
        """Index of the nearest centroid (log space) of each request; vectorised, ties to the lower index. Pure."""
        x = np.asarray(input_tokens, dtype=np.float64)
        y = np.asarray(output_tokens, dtype=np.float64)
        if (x.size and x.min() < 0) or (y.size and y.min() < 0):
            raise ConfigError("classify: token counts must be >= 0")
        shape = np.broadcast_shapes(x.shape, y.shape)
        d = _sq_dist(np.log1p(np.broadcast_to(x, shape).ravel()),
                     np.log1p(np.broadcast_to(y, shape).ravel()), self._centroids)
        return np.argmin(d, axis=1).astype(np.int64).reshape(shape)

    def classify_one(self, input_tokens: int, output_tokens: int) -> int:
        """Index of the nearest centroid for one request: the same answer as `classify`, bit for bit (the same
        numpy log1p, then `_sq_dist`'s operations in Python floats), at a small fraction of its cost per call:
        the twin's correction asks it for every running request every simulated second. Pure."""
        if input_tokens < 0 or output_tokens < 0:
            raise ConfigError("classify: token counts must be >= 0")
        x, y = np.log1p(np.array((input_tokens, output_tokens), dtype=np.float64)).tolist()
        best, best_d = 0, math.inf
        for j, (cx, cy) in enumerate(self._pairs):
            dx, dy = x - cx, y - cy
            d = dx * dx + dy * dy
            if d < best_d:  # strict: a tie goes to the lower index, as argmin's does
                best, best_d = j, d
        return best

    def type_lengths(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Representative lengths of type j: (input samples, output samples, weights summing to 1). Pure.

        Sample i of each is the same quantile level of that marginal, so pairing them by index is a
        comonotone coupling (long prompts with long answers); within one type this is a close and,
        for KV-cache use, pessimistic stand-in for the joint distribution.
        """
        s = self.stats[j]
        n = len(s.input_samples_tokens)
        return (np.array(s.input_samples_tokens, dtype=np.int64),
                np.array(s.output_samples_tokens, dtype=np.int64),
                np.full(n, 1.0 / n))


def fit_types(input_tokens: np.ndarray, output_tokens: np.ndarray, k: int = 4, seed: int = 0,
              previous: WorkloadTypes | None = None, *, n_init: int = 16,
              max_iter: int = 300) -> WorkloadTypes:
    """Cluster requests into k workload types by k-means on (log1p input, log1p output). Pure.

    Without `previous`: k-means++ initialisation from `numpy.random.default_rng(seed)`, Lloyd
    iterations, `n_init` restarts, the lowest inertia kept. Deterministic for a seed and independent of
    the order of the requests (the points are deduplicated and sorted before anything random happens).
    Names: for k = 4 SISO, SILO, LISO, LILO, matched to the corners of the centroids' bounding box by
    the Hungarian method so each name is used once; otherwise T0..T{k-1} in (input, output) order.

    With `previous` (same k): one Lloyd run started from its centroids, and each new type takes the
    name of the old type it matches (Hungarian on centroid distance), so a refit never swaps names.
    The result lists types in `previous.names` order.
    """
    x_in = np.asarray(input_tokens)
    x_out = np.asarray(output_tokens)
    if x_in.ndim != 1 or x_in.shape != x_out.shape:
        raise ConfigError(f"fit_types needs two 1-D arrays of equal length; got shapes "
                          f"{x_in.shape} and {x_out.shape}")
    if k < 1:
        raise ConfigError(f"fit_types: k must be >= 1; got {k}")
    if n_init < 1 or max_iter < 1:
        raise ConfigError(f"fit_types: n_init and max_iter must be >= 1; got {n_init}, {max_iter}")
    if previous is not None and previous.k != k:
        raise ConfigError(f"fit_types: k={k} but previous has {previous.k} types "
                          f"({', '.join(previous.names)})")
    if len(x_in) and (x_in.min() < 0 or x_out.min() < 0):
        raise ConfigError("fit_types: token counts must be >= 0")
    pairs, counts = np.unique(np.column_stack([x_in, x_out]).astype(np.int64), axis=0, return_counts=True)
    if len(pairs) < k:
        raise ConfigError(f"fit_types: k={k} types need at least {k} distinct (input, output) pairs; "
                          f"got {len(pairs)} from {len(x_in)} requests")
    points = np.log1p(pairs.astype(np.float64))  # sorted, distinct: the order of the input is gone
    weights = counts.astype(np.float64)

    if previous is not None:
        centroids, inertia = _lloyd(points, weights, np.array(previous._centroids), max_iter)
        rows, cols = linear_sum_assignment(_sq_dist(centroids[:, 0], centroids[:, 1], previous._centroids))
        order = rows[np.argsort(cols)]  # order[j] = new cluster that takes previous.names[j]
        names = previous.names
    else:
        rng = np.random.default_rng(seed)
        centroids, inertia = None, math.inf
        for _ in range(n_init):
            c, c_inertia = _lloyd(points, weights, _kmeans_pp(points, weights, k, rng), max_iter)
            if c_inertia < inertia:  # strict: the first of equal runs wins
                centroids, inertia = c, c_inertia
        assert centroids is not None
        order, names = _positional_names(centroids)
    centroids = centroids[order]

    x_in = x_in.astype(np.int64)
    x_out = x_out.astype(np.int64)
    labels = np.argmin(_sq_dist(np.log1p(x_in.astype(np.float64)), np.log1p(x_out.astype(np.float64)),
                                centroids), axis=1)
    stats = tuple(_type_stats(x_in[labels == j], x_out[labels == j], len(x_in), centroids[j])
                  for j in range(k))
    return WorkloadTypes(names=tuple(names),
                         centroids_log=tuple((float(a), float(b)) for a, b in centroids),
                         stats=stats, inertia=float(inertia))


def _sq_dist(x: np.ndarray, y: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Squared distances (n, k) from points (x[i], y[i]) to centroids (k, 2). Pure.

    The single distance function used both to fit and to classify, so a fitted point's label is
    exactly its nearest centroid.
    """
    return (x[:, None] - centroids[None, :, 0]) ** 2 + (y[:, None] - centroids[None, :, 1]) ** 2


def _kmeans_pp(points: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on weighted distinct points: next centre drawn with prob. ~ weight * D^2. Pure."""
    n = len(points)
    centres = np.empty((k, 2))

    def draw(p: np.ndarray) -> int:
        cum = np.cumsum(p)
        return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), n - 1)

    centres[0] = points[draw(weights)]
    d2 = _sq_dist(points[:, 0], points[:, 1], centres[:1])[:, 0]
    for c in range(1, k):
        centres[c] = points[draw(weights * d2)]  # distinct points: d2 > 0 somewhere while c < n
        d2 = np.minimum(d2, _sq_dist(points[:, 0], points[:, 1], centres[c:c + 1])[:, 0])
    return centres


def _lloyd(points: np.ndarray, weights: np.ndarray, centroids: np.ndarray,
           max_iter: int) -> tuple[np.ndarray, float]:
    """Weighted Lloyd iterations until the assignment stops changing; returns (centroids, inertia). Pure.

    A cluster left empty is moved to the point that currently contributes most to the inertia.
    """
    k = len(centroids)
    centroids = centroids.astype(np.float64, copy=True)
    labels = None
    for _ in range(max_iter):
        d = _sq_dist(points[:, 0], points[:, 1], centroids)
        new_labels = np.argmin(d, axis=1)
        if labels is not None and np.array_equal(new_labels, labels):
            break
        labels = new_labels
        mass = np.bincount(labels, weights=weights, minlength=k)
        sum_x = np.bincount(labels, weights=weights * points[:, 0], minlength=k)
        sum_y = np.bincount(labels, weights=weights * points[:, 1], minlength=k)
        filled = mass > 0
        centroids[filled, 0] = sum_x[filled] / mass[filled]
        centroids[filled, 1] = sum_y[filled] / mass[filled]
        if not filled.all():
            cost = weights * d[np.arange(len(points)), labels]
            for j in np.flatnonzero(~filled):
                far = int(np.argmax(cost))
                centroids[j] = points[far]
                cost[far] = -1.0
            labels = None  # force another assignment round
    d = _sq_dist(points[:, 0], points[:, 1], centroids)
    inertia = float(np.sum(weights * d.min(axis=1)))
    return centroids, inertia


def _positional_names(centroids: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Order and names for fresh centroids: grid corners for k = 4, else (input, output) order. Pure."""
    k = len(centroids)
    if k == 4:
        lo = centroids.min(axis=0)
        span = centroids.max(axis=0) - lo
        unit = (centroids - lo) / np.where(span > 0, span, 1.0)  # each axis scaled to [0, 1]
        cost = ((unit[:, None, :] - _CORNERS_4[None, :, :]) ** 2).sum(axis=2)  # cluster x corner
        rows, cols = linear_sum_assignment(cost)
        return rows[np.argsort(cols)], NAMES_4
    order = np.lexsort((centroids[:, 1], centroids[:, 0]))
    return order, tuple(f"T{j}" for j in range(k))


def _type_stats(inp: np.ndarray, out: np.ndarray, total: int, centroid: np.ndarray) -> TypeStats:
    """Summary of one type's members (a type with no members gets its centroid as its lengths). Pure."""
    n = NUM_LENGTH_SAMPLES
    if len(inp) == 0:
        c_in, c_out = (max(0, round(math.expm1(v))) for v in centroid)
        return TypeStats(0, 0.0, float(c_in), float(c_out), (c_in,) * n, (c_out,) * n)
    levels = (np.arange(n) + 0.5) / n
    return TypeStats(
        num_requests=len(inp), share=len(inp) / total,
        mean_input_tokens=float(inp.mean()), mean_output_tokens=float(out.mean()),
        input_samples_tokens=tuple(int(v) for v in np.quantile(inp, levels, method="inverted_cdf")),
        output_samples_tokens=tuple(int(v) for v in np.quantile(out, levels, method="inverted_cdf")))


# --------------------------------------------------------------------------------------------------
# Type mix over time


def count_spans(arrival_s: np.ndarray, labels: np.ndarray, k: int, span_s: float = 60.0) -> np.ndarray:
    """Arrivals per span and type, shape (num_spans, k); spans [i*span_s, (i+1)*span_s) from t = 0. Pure.

    Only full spans up to the last arrival are counted: the last, partial span is dropped (it would
    read as a drop in traffic), unless it is the only one, in which case it holds every request.
    No arrivals gives shape (0, k).
    """
    if not (span_s > 0 and math.isfinite(span_s)):
        raise ConfigError(f"span_s must be a positive number of seconds; got {span_s!r}")
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if arrival_s.shape != labels.shape:
        raise ConfigError(f"arrival_s and labels differ in shape: {arrival_s.shape}, {labels.shape}")
    if len(arrival_s) == 0:
        return np.zeros((0, k), dtype=np.int64)
    if arrival_s.min() < 0:
        raise ConfigError("count_spans: arrivals must be >= 0")
    if labels.min() < 0 or labels.max() >= k:
        raise ConfigError(f"count_spans: labels must lie in [0, {k})")
    num_full = int(arrival_s.max() // span_s)  # spans that end at or before the last arrival
    if num_full == 0:  # the partial span is the only one: it holds every request
        return np.bincount(labels, minlength=k).reshape(1, k).astype(np.int64)
    span = (arrival_s // span_s).astype(np.int64)
    keep = span < num_full
    flat = np.bincount(span[keep] * k + labels[keep], minlength=num_full * k)
    return flat.reshape(num_full, k).astype(np.int64)


def span_counts(trace: Trace, types: WorkloadTypes, span_s: float = 60.0) -> np.ndarray:
    """Arrivals per span and type for a trace, shape (num_spans, types.k), classifying each request. Pure.

    Spans start at t = 0; the last, partial span is dropped unless it is the only one (see
    `count_spans`).
    """
    labels = types.classify(trace.input_tokens, trace.output_tokens)
    return count_spans(trace.arrival_s, labels, types.k, span_s)


def _proportions(counts: np.ndarray) -> np.ndarray:
    """Per-span type proportions of the spans with traffic, shape (num_busy_spans, k). Pure."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ConfigError(f"counts must be 2-D (spans x types); got shape {counts.shape}")
    totals = counts.sum(axis=1)
    busy = totals > 0
    return counts[busy] / totals[busy, None]


def mix_cv(counts: np.ndarray) -> np.ndarray:
    """Coefficient of variation (population std / mean) of each type's proportion across spans. Pure.

    Spans with no requests are skipped. A type that never appears (mean 0), or counts with no busy
    span, give NaN for that type.
    """
    p = _proportions(counts)
    k = np.asarray(counts).shape[1]
    if len(p) == 0:
        return np.full(k, np.nan)
    mean = p.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, p.std(axis=0) / mean, np.nan)


def mix_cv_noise(counts: np.ndarray) -> np.ndarray:
    """The CV `mix_cv` would show from sampling noise alone if the mix were constant (binomial). Pure.

    With overall share p of a type and n_t requests in busy span t, a constant mix gives each span's
    proportion a variance p(1-p)/n_t, so the CV is sqrt(mean_t p(1-p)/n_t) / p. An observed `mix_cv`
    well above this means the mix really changes.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ConfigError(f"counts must be 2-D (spans x types); got shape {counts.shape}")
    totals = counts.sum(axis=1)
    busy = totals > 0
    if not busy.any():
        return np.full(counts.shape[1], np.nan)
    p = counts[busy].sum(axis=0) / totals[busy].sum()
    inv_n = float(np.mean(1.0 / totals[busy]))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(p > 0, np.sqrt(p * (1 - p) * inv_n) / p, np.nan)
