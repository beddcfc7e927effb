"""Every forecaster by name: the one registry the bench, the simulator and the live stage build from. Pure.

Kinds map to the module and class that implement them; the LSTM's module (torch) is imported only
when it is asked for. Each class keeps its own small test settings (`_unit_test_params`), which the
contract suite runs, River-style.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from oserve.errors import ConfigError, UnknownNameError
from oserve.forecast.base import Forecaster

# kind -> (module, class)
FORECASTERS: dict[str, tuple[str, str]] = {
    "lstm": ("oserve.forecast.lstm", "LSTMForecaster"),
    "last_value": ("oserve.forecast.baselines", "LastValue"),
    "moving_average": ("oserve.forecast.baselines", "MovingAverage"),
    "seasonal_naive": ("oserve.forecast.baselines", "SeasonalNaive"),
    "holt_winters": ("oserve.forecast.baselines", "HoltWinters"),
}
FORECASTER_NAMES: tuple[str, ...] = tuple(FORECASTERS)
ALIASES: dict[str, str] = {"lv": "last_value", "ma": "moving_average", "sn": "seasonal_naive",
                           "hw": "holt_winters", "naive": "last_value"}


def resolve_name(name: str) -> str:
    """The registered kind of a name or alias (raises `UnknownNameError`). Pure."""
    kind = ALIASES.get(name.strip(), name.strip())
    if kind not in FORECASTERS:
        raise UnknownNameError("forecaster", name, [*FORECASTER_NAMES, *(f"{a}={b}" for a, b in ALIASES.items())])
    return kind


def forecaster_class(name: str) -> type[Forecaster]:
    """The class of a forecaster kind (imports its module)."""
    module, cls = FORECASTERS[resolve_name(name)]
    return getattr(importlib.import_module(module), cls)


def make_forecaster(name: str, k: int, *, seed: int = 0, season_spans: int | None = None,
                    naive_season_spans: int | None = None, lookback_spans: int = 50,
                    moving_average_spans: int = 10) -> Forecaster:
    """A fresh forecaster of kind `name` for k types, with the bench's settings.

    `season_spans`: spans per day where the series has a daily cycle (LSTM time of day, Holt-Winters'
    season, seasonal naive); `naive_season_spans` overrides the seasonal naive's season (a series with
    no known season still gets one, so the baseline exists).
    """
    kind = resolve_name(name)
    settings: dict[str, Any] = {
        "lstm": {"lookback_spans": lookback_spans, "season_spans": season_spans},
        "moving_average": {"window_spans": moving_average_spans},
        "seasonal_naive": {"season_spans": naive_season_spans or season_spans or 1},
        "holt_winters": {"season_spans": season_spans or 0},
    }.get(kind, {})
    return forecaster_class(kind)(k, seed=seed, **settings)


def make_forecasters(k: int, names: tuple[str, ...] | list[str] = FORECASTER_NAMES, **settings: Any
                     ) -> dict[str, Forecaster]:
    """The named forecasters (keyed by kind), each as `make_forecaster` builds it."""
    return {resolve_name(n): make_forecaster(n, k, **settings) for n in names}


def load_forecaster(path: str | os.PathLike[str]) -> Forecaster:
    """Read a forecaster of any kind written by `Forecaster.save`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read forecaster file {str(path)!r}: {exc}") from None
    return forecaster_from_dict(data, f"forecaster file {str(path)!r}")


def forecaster_from_dict(data: Any, what: str = "forecaster data") -> Forecaster:
    """Rebuild a forecaster of any kind from `Forecaster.to_dict` output (`what` names it in errors). Pure."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in FORECASTERS:
        raise ConfigError(f"{what} has kind {kind!r}; known kinds: {', '.join(sorted(FORECASTERS))}")
    return forecaster_class(kind).from_dict(data)
