"""Baseline forecasters: last value, moving average, seasonal naive, Holt-Winters (River).

Pure core: no clock, no I/O beyond `save`/`load`. Each works per type, independently.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

import numpy as np
from river import time_series

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster


def _check_int(owner: str, name: str, value: Any, minimum: int) -> int:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum):
        raise ConfigError(f"{owner}: {name} must be an int >= {minimum}; got {value!r}")
    return int(value)


class LastValue(Forecaster):
    """The next span repeats the last one (the random-walk forecast). Ready after one span."""

    kind = "last_value"

    def __init__(self, k: int, seed: int = 0) -> None:
        super().__init__(k, seed)
        self._reset()

    def _reset(self) -> None:
        self._value: np.ndarray | None = None

    def _learn(self, row: np.ndarray) -> None:
        self._value = row.copy()

    def _ready(self) -> bool:
        return self._value is not None

    def _forecast(self) -> np.ndarray:
        assert self._value is not None
        return self._value.copy()

    def _get_state(self) -> dict[str, Any]:
        return {"value": None if self._value is None else self._value.tolist()}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._value = None if state["value"] is None else np.array(state["value"], dtype=np.float64)


class MovingAverage(Forecaster):
    """Mean of the last `window_spans` spans (fewer while warming up). Ready after one span."""

    kind = "moving_average"
    _params = ("window_spans",)

    @classmethod
    def _unit_test_params(cls) -> list[dict[str, Any]]:
        return [{"window_spans": 5}]

    def __init__(self, k: int, seed: int = 0, window_spans: int = 10) -> None:
        super().__init__(k, seed)
        self.window_spans = _check_int("MovingAverage", "window_spans", window_spans, 1)
        self._reset()

    def _reset(self) -> None:
        self._window: deque[np.ndarray] = deque(maxlen=self.window_spans)

    def _learn(self, row: np.ndarray) -> None:
        self._window.append(row.copy())

    def _ready(self) -> bool:
        return len(self._window) > 0

    def _forecast(self) -> np.ndarray:
        return np.mean(np.array(self._window), axis=0)

    def _get_state(self) -> dict[str, Any]:
        return {"window": [r.tolist() for r in self._window]}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._reset()
        for r in state["window"]:
            self._window.append(np.array(r, dtype=np.float64))


class SeasonalNaive(Forecaster):
    """The next span repeats the span one season earlier. Ready after `season_spans` spans."""

    kind = "seasonal_naive"
    _params = ("season_spans",)

    @classmethod
    def _unit_test_params(cls) -> list[dict[str, Any]]:
        return [{"season_spans": 12}]

    def __init__(self, k: int, seed: int = 0, season_spans: int = 144) -> None:
        super().__init__(k, seed)
        self.season_spans = _check_int("SeasonalNaive", "season_spans", season_spans, 1)
        self._reset()

    def _reset(self) -> None:
        self._season: deque[np.ndarray] = deque(maxlen=self.season_spans)

    def _learn(self, row: np.ndarray) -> None:
        self._season.append(row.copy())

    def _ready(self) -> bool:
        return len(self._season) == self.season_spans

    def _not_ready_reason(self) -> str:
        return f"needs one season of {self.season_spans} spans, has {len(self._season)}"

    def _forecast(self) -> np.ndarray:
        return self._season[0].copy()

    def _get_state(self) -> dict[str, Any]:
        return {"season": [r.tolist() for r in self._season]}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._reset()
        for r in state["season"]:
            self._season.append(np.array(r, dtype=np.float64))


# smoothing grids searched by HoltWinters.fit when a parameter is left as None
ALPHA_GRID: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
BETA_GRID: tuple[float, ...] = (0.001, 0.05)  # River needs beta > 0 when there is a season
GAMMA_GRID: tuple[float, ...] = (0.0, 0.1, 0.3)
BETA_GRID_NO_SEASON: tuple[float, ...] = (0.0, 0.05)  # 0: no trend (simple exponential smoothing)
# River starts its season as value / mean, which divides by zero on a season without arrivals; the model
# is additive, so it is fed count + OFFSET and OFFSET is taken off its forecasts
OFFSET = 1.0


class HoltWinters(Forecaster):
    """Additive Holt-Winters per type, River's `time_series.HoltWinters`, smoothing tuned in `fit`.

    `alpha`, `beta`, `gamma` fixed to numbers are used as given; left as None, `fit` picks each type's
    values from ALPHA_GRID x BETA_GRID x GAMMA_GRID (BETA_GRID_NO_SEASON without a season) by the one-step squared error over the history
    (before `fit`, `learn_one` uses alpha 0.5, beta 0.05, gamma 0.1). `season_spans` 0 means no season
    (Holt's linear trend). Ready once River's model is initialised (max(2, season_spans) spans).
    """

    kind = "holt_winters"
    _params = ("season_spans", "alpha", "beta", "gamma")

    @classmethod
    def _unit_test_params(cls) -> list[dict[str, Any]]:
        return [{}, {"season_spans": 12}]

    def __init__(self, k: int, seed: int = 0, season_spans: int = 0, alpha: float | None = None,
                 beta: float | None = None, gamma: float | None = None) -> None:
        super().__init__(k, seed)
        self.season_spans = _check_int("HoltWinters", "season_spans", season_spans, 0)
        for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
            if v is not None and not (isinstance(v, (int, float)) and 0 <= v <= 1 and math.isfinite(v)):
                raise ConfigError(f"HoltWinters: {name} must be None (tuned) or in [0, 1]; got {v!r}")
        if self.season_spans and beta is not None and beta == 0:
            raise ConfigError("HoltWinters: beta must be > 0 with a season (River needs a trend then)")
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self._chosen: list[tuple[float, float | None, float | None]] = [self._default()] * self.k
        self._reset()

    def _default(self) -> tuple[float, float | None, float | None]:
        a = 0.5 if self.alpha is None else float(self.alpha)
        b = 0.05 if self.beta is None else float(self.beta)
        g = (0.1 if self.gamma is None else float(self.gamma)) if self.season_spans else None
        return a, b, g

    def _make(self, a: float, b: float | None, g: float | None) -> time_series.HoltWinters:
        if self.season_spans:
            return time_series.HoltWinters(alpha=a, beta=b, gamma=g, seasonality=self.season_spans)
        return time_series.HoltWinters(alpha=a, beta=b or None)

    def _reset(self) -> None:
        self._models = [self._make(*p) for p in self._chosen]

    def _fit_filled(self, rows: np.ndarray) -> None:
        grid_a = ALPHA_GRID if self.alpha is None else (float(self.alpha),)
        grid_b = ((BETA_GRID if self.season_spans else BETA_GRID_NO_SEASON) if self.beta is None
                  else (float(self.beta),))
        grid_g = ((GAMMA_GRID if self.gamma is None else (float(self.gamma),)) if self.season_spans
                  else (None,))
        combos = list(itertools.product(grid_a, grid_b, grid_g))
        chosen = []
        for j in range(self.k):
            y = (rows[:, j] + OFFSET).tolist()
            if len(combos) == 1:
                chosen.append(combos[0])
                continue
            errors = [self._sse(self._make(*c), y) for c in combos]
            chosen.append(combos[int(np.argmin(errors))])  # first of equal errors wins
        self._chosen = chosen
        self._reset()
        for row in rows:
            self._learn(row)

    @staticmethod
    def _sse(model: time_series.HoltWinters, y: list[float]) -> float:
        sse = 0.0
        for v in y:
            if model._initialized:
                f = model.forecast(1)[0]
                sse += (max(f - OFFSET, 0.0) - (v - OFFSET)) ** 2
            model.learn_one(v)
        return sse if math.isfinite(sse) else math.inf

    def _learn(self, row: np.ndarray) -> None:
        for m, v in zip(self._models, row.tolist()):
            m.learn_one(v + OFFSET)

    def _ready(self) -> bool:
        return all(m._initialized for m in self._models)

    def _not_ready_reason(self) -> str:
        return f"River's Holt-Winters starts after {max(2, self.season_spans)} spans"

    def _forecast(self) -> np.ndarray:
        return np.array([m.forecast(1)[0] - OFFSET for m in self._models])

    def _get_state(self) -> dict[str, Any]:
        models = []
        for m in self._models:
            models.append({"level": list(m.level), "trend": None if m.trend is None else list(m.trend),
                           "season": None if m.season is None else list(m.season),
                           "first_values": list(m._first_values), "initialized": m._initialized})
        return {"chosen": [list(c) for c in self._chosen], "models": models}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._chosen = [(float(a), None if b is None else float(b), None if g is None else float(g))
                        for a, b, g in state["chosen"]]
        self._reset()
        for m, s in zip(self._models, state["models"]):
            m.level.extend(s["level"])
            if m.trend is not None:
                m.trend.extend(s["trend"])
            if m.season is not None:
                m.season.extend(s["season"])
            m._first_values = list(s["first_values"])
            m._initialized = bool(s["initialized"])
