"""Per-type arrival forecasting: one interface for the LSTM and the baselines, metrics, ServeGen series.

Pure core (no NATS or OpenTelemetry; no clock). See `oserve.forecast.base` for the contract. The LSTM
names (`LSTMForecaster`, `RetrainJob`, `TrainedLSTM`) are imported on first use, so the baselines and
metrics load without torch (torch itself imports the standard library's asyncio, via unittest.mock).
"""

from typing import Any

from oserve.forecast.base import Forecaster, ForecastNotReady
from oserve.forecast.baselines import HoltWinters, LastValue, MovingAverage, SeasonalNaive
from oserve.forecast.registry import load_forecaster, make_forecaster
from oserve.forecast.metrics import (chronological_split, noise_floor_report, poisson_noise_floor,
                                     rolling_forecast, rrmse, rrmse_report)

_LSTM_NAMES = ("LSTMForecaster", "RetrainJob", "TrainedLSTM")

__all__ = [
    "Forecaster", "ForecastNotReady", "load_forecaster", "make_forecaster",
    "LastValue", "MovingAverage", "SeasonalNaive", "HoltWinters",
    *_LSTM_NAMES,
    "rrmse", "rrmse_report", "poisson_noise_floor", "noise_floor_report", "chronological_split",
    "rolling_forecast",
]


def __getattr__(name: str) -> Any:
    if name in _LSTM_NAMES:
        from oserve.forecast import lstm

        return getattr(lstm, name)
    raise AttributeError(f"module 'oserve.forecast' has no attribute {name!r}")
