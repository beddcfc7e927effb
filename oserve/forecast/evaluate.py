"""Evaluate forecasters on a per-type series: chronological split, rolling one-step forecasts, RRMSE.

Pure core: time is read only through the `timer` the caller hands in (e.g. `time.perf_counter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster
from oserve.forecast.metrics import (RollingResult, chronological_split, noise_floor_report,
                                     rolling_forecast, rrmse_report)

@dataclass(frozen=True, slots=True)
class ForecasterScore:
    rolling: RollingResult
    report: dict[str, object]  # rrmse_report: overall, pooled, per_type
    train_s: float  # NaN without a timer
    latency_ms_mean: float  # NaN without a timer
    latency_ms_p99: float


@dataclass(frozen=True, slots=True)
class ForecastEvaluation:
    series: np.ndarray
    n_train: int
    scores: dict[str, ForecasterScore]
    noise_floor: dict[str, object] = field(default_factory=dict)  # noise_floor_report of the test spans


def evaluate(series: np.ndarray, forecasters: dict[str, Forecaster], *, train_fraction: float = 0.9,
             timer: Callable[[], float] | None = None) -> ForecastEvaluation:
    """Fit each forecaster on the first `train_fraction` of the spans, forecast the rest one step at a
    time with the true history, and score them. Mutates the forecasters (they end fitted)."""
    series = np.asarray(series, dtype=np.float64)
    if series.ndim != 2:
        raise ConfigError(f"evaluate needs a (num_spans, k) series; got shape {series.shape}")
    n_train = chronological_split(len(series), train_fraction)
    scores: dict[str, ForecasterScore] = {}
    for name, fc in forecasters.items():
        t0 = timer() if timer else float("nan")
        fc.fit(series[:n_train])
        train_s = (timer() - t0) if timer else float("nan")
        rolling = rolling_forecast(fc, series, n_train, timer=timer, fit=False)
        lat = np.array(rolling.latency_s) * 1e3
        scores[name] = ForecasterScore(
            rolling=rolling, report=rrmse_report(rolling.predicted, rolling.actual), train_s=train_s,
            latency_ms_mean=float(lat.mean()) if lat.size else float("nan"),
            latency_ms_p99=float(np.quantile(lat, 0.99)) if lat.size else float("nan"))
    return ForecastEvaluation(series=series, n_train=n_train, scores=scores,
                      noise_floor=noise_floor_report(series[n_train:]))


def fit_lookback(n_train: int, lookback_spans: int = 50, min_windows: int = 16) -> int:
    """The LSTM lookback to use for a training split of n_train spans: `lookback_spans`, or n_train // 2
    when the split is too short to leave `min_windows` training windows. Pure."""
    if n_train >= lookback_spans + min_windows:
        return lookback_spans
    return max(1, n_train // 2)
