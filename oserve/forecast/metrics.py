"""Forecast accuracy: relative RMSE, the Poisson noise floor, and rolling one-step evaluation.

Pure core. The evaluation reads no clock: latency is measured only if the caller hands in a timer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster


def rrmse(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Relative RMSE: RMSE over all entries divided by the mean of `actual`. Pure.

    NaN entries of `actual` (not observed) are left out. NaN when the mean of `actual` is 0 or nothing
    is left.
    """
    p = np.asarray(predicted, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if p.shape != a.shape:
        raise ConfigError(f"rrmse: predicted {p.shape} and actual {a.shape} differ in shape")
    ok = ~np.isnan(a)
    if not ok.any():
        return float("nan")
    mean = float(a[ok].mean())
    if mean <= 0:
        return float("nan")
    return float(np.sqrt(np.mean((p[ok] - a[ok]) ** 2)) / mean)


def observed_rows(actual: np.ndarray) -> np.ndarray:
    """Mask of the spans whose counts are observed (no NaN in the row). Pure."""
    return ~np.isnan(np.asarray(actual, dtype=np.float64)).any(axis=1)


def rrmse_report(predicted: np.ndarray, actual: np.ndarray) -> dict[str, object]:
    """RRMSE of a (num_spans, k) forecast: `overall` on the total over types, `pooled` over every
    (span, type) entry, and `per_type`. Spans with any NaN in `actual` are left out. Pure."""
    p = np.asarray(predicted, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    keep = observed_rows(a)
    p, a = p[keep], a[keep]
    return {"overall": rrmse(p.sum(axis=1), a.sum(axis=1)), "pooled": rrmse(p, a),
            "per_type": [rrmse(p[:, j], a[:, j]) for j in range(a.shape[1])]}


def poisson_noise_floor(actual: np.ndarray) -> float:
    """RRMSE a forecaster knowing the true rate would still get from Poisson sampling alone. Pure.

    A Poisson count N with rate lam has E[(N - lam)^2] = lam, so the floor's RMSE is sqrt(mean lam),
    estimated by sqrt(mean of the actual counts); divided by that mean it is 1 / sqrt(mean count).
    Works on a 1-D series (the total) or on any array (pooled). NaN entries are left out.
    """
    a = np.asarray(actual, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0 or a.mean() <= 0:
        return float("nan")
    return float(1.0 / np.sqrt(a.mean()))


def noise_floor_report(actual: np.ndarray) -> dict[str, object]:
    """Poisson noise floor of a (num_spans, k) test set, with the same keys as `rrmse_report`. Pure."""
    a = np.asarray(actual, dtype=np.float64)
    a = a[observed_rows(a)]
    return {"overall": poisson_noise_floor(a.sum(axis=1)), "pooled": poisson_noise_floor(a),
            "per_type": [poisson_noise_floor(a[:, j]) for j in range(a.shape[1])]}


def chronological_split(num_spans: int, train_fraction: float = 0.9) -> int:
    """Number of training spans of a chronological split: round(num_spans * train_fraction). Pure."""
    if not (0 < train_fraction < 1):
        raise ConfigError(f"train_fraction must be in (0, 1); got {train_fraction!r}")
    n_train = int(round(num_spans * train_fraction))
    if n_train < 1 or n_train >= num_spans:
        raise ConfigError(f"a {train_fraction:.0%} split of {num_spans} spans leaves no train or no test spans")
    return n_train


@dataclass(frozen=True, slots=True)
class RollingResult:
    """One-step-ahead forecasts over a test range, with the true counts they are scored against."""

    predicted: np.ndarray  # (num_test, k)
    actual: np.ndarray  # (num_test, k), NaN where not observed
    latency_s: tuple[float, ...]  # per forecast call; empty if no timer was given


def rolling_forecast(forecaster: Forecaster, series: np.ndarray, n_train: int, *,
                     timer: Callable[[], float] | None = None, fit: bool = True) -> RollingResult:
    """Fit on `series[:n_train]` (unless `fit` is False: already fitted on it), then for each later span
    forecast it and learn its true counts.

    The forecaster sees the true history at every step (one-step-ahead, rolling); after each span it
    is retrained inline when `needs_retrain()` says so, as a live driver would. `timer`, if given
    (e.g. `time.perf_counter`), times each `forecast()` call. Mutates `forecaster` (fits and learns).
    """
    series = np.asarray(series, dtype=np.float64)
    if fit:
        forecaster.fit(series[:n_train])
    predicted = np.empty((len(series) - n_train, series.shape[1]))
    latency: list[float] = []
    for i, t in enumerate(range(n_train, len(series))):
        if timer is not None:
            t0 = timer()
            predicted[i] = forecaster.forecast()
            latency.append(timer() - t0)
        else:
            predicted[i] = forecaster.forecast()
        forecaster.learn_one(series[t])
        if forecaster.needs_retrain():
            forecaster.retrain()
    return RollingResult(predicted=predicted, actual=series[n_train:].copy(), latency_s=tuple(latency))
