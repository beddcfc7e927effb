"""Per-class request rates for the next span, from any forecaster of span counts. Pure (no clock).

The simulator's policies drive forecasters through this adapter: feed each span's counts as it closes
(`observe`), ask for the next span's rates (`rates_rps`). The live forecaster stage uses
`oserve.forecast.gate.GatedForecaster`, which has the same two verbs and trains its LSTM off the loop.
Until the forecaster is ready, the last observed span's rates stand in (and `source` says so).
"""

from __future__ import annotations

import numpy as np

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster, ForecastNotReady


class RateForecaster:
    """A forecaster of span counts, answering in requests per second (see the module docstring)."""

    def __init__(self, forecaster: Forecaster, span_s: float) -> None:
        if not span_s > 0:
            raise ConfigError(f"RateForecaster: span_s must be positive, got {span_s}")
        self.forecaster = forecaster
        self.span_s = float(span_s)
        self._last: np.ndarray | None = None

    @property
    def k(self) -> int:
        return self.forecaster.k

    def observe(self, counts: np.ndarray) -> None:
        """One more span has closed with these per-class counts; retrains a model that asks for it."""
        row = np.asarray(counts, dtype=float)
        self.forecaster.learn_one(row)
        self._last = row
        if self.forecaster.needs_retrain():
            self.forecaster.retrain()

    @property
    def source(self) -> str:
        """Which forecaster produces `rates_rps` now: its kind, or 'last_span' while it warms up. Pure."""
        return self.forecaster.kind if self.forecaster.ready else "last_span"

    def rates_rps(self) -> np.ndarray:
        """Forecast per-class rates of the next span, finite and >= 0. Pure.

        Raises:
            ForecastNotReady: no span observed yet.
        """
        if self.forecaster.ready:
            counts = self.forecaster.forecast()
        elif self._last is not None:
            counts = self._last
        else:
            raise ForecastNotReady("no span observed yet")
        return np.maximum(np.nan_to_num(np.asarray(counts, dtype=float), nan=0.0, posinf=0.0), 0.0) / self.span_s
