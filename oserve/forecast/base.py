"""The forecaster interface: per-type request counts of the next span from the spans seen so far.

Pure core: no asyncio, no NATS, no clock; the only files touched are the ones handed to `save`/`load`.

Every forecaster (the LSTM and the baselines) has the same five verbs, so the simulator and the live
forecaster stage drive the same objects unchanged:

- `fit(history)`: start over from a history, shape (num_spans, k), oldest first; returns self.
- `learn_one(counts)`: one more span has closed with these counts, shape (k,).
- `forecast()`: counts expected in the next span, shape (k,), float64, finite, >= 0. Pure: it never
  changes the forecaster. Before warm-up it raises `ForecastNotReady` (check `ready` to avoid it).
- `save(path)` / `load(path)`: a JSON file (config, fitted parameters and the history the state needs);
  a loaded forecaster forecasts exactly what the saved one did.

Counts are request counts (ints, or floats for expected counts). A NaN entry means "not observed"
(a collection gap, not a span without arrivals): it is filled with that type's last observed count
(0 before any), so the state stays well defined; a span with no arrivals is a row of zeros.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from oserve.errors import ConfigError, OServeError

FORMAT_VERSION = 1


class ForecastNotReady(OServeError):
    """The forecaster has not seen enough spans (or has not been trained) to forecast yet."""


class Forecaster(ABC):
    """Base class of the per-type span-count forecasters (see the module doc for the contract).

    Subclasses set `kind`, implement `_reset`, `_learn`, `_forecast`, `_ready`, `_get_state` and
    `_set_state`, and keep their hyperparameters as attributes under their constructor names, listed
    in `_params`.
    """

    kind: ClassVar[str] = ""
    _params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, k: int, seed: int = 0) -> None:
        if not (isinstance(k, (int, np.integer)) and k >= 1):
            raise ConfigError(f"{type(self).__name__}: k (number of types) must be an int >= 1; got {k!r}")
        self.k = int(k)
        self.seed = int(seed)
        self._last = np.zeros(self.k)  # last observed count per type (NaN fill)
        self._num_spans = 0  # spans learned (fit history + learn_one calls)
        # free-form description saved with the forecaster (trace, span, type names, ...); never read here
        self.meta: dict[str, Any] = {}

    # -------------------------------------------------------------------------------- public verbs

    @property
    def ready(self) -> bool:
        """Whether `forecast()` returns a forecast (rather than raising ForecastNotReady). Pure."""
        return self._ready()

    @property
    def num_spans(self) -> int:
        """Spans learned so far (the rows of `fit` plus the `learn_one` calls). Pure."""
        return self._num_spans

    def fit(self, history: np.ndarray) -> Forecaster:
        """Forget everything and learn from `history`, shape (num_spans, k), oldest first; returns self."""
        rows = self._check_history(history)
        self._last = np.zeros(self.k)
        self._num_spans = 0
        self._reset()
        filled = np.empty_like(rows)
        for i, row in enumerate(rows):
            filled[i] = self._fill(row)
        self._fit_filled(filled)
        self._num_spans = len(filled)
        return self

    def learn_one(self, counts: np.ndarray) -> None:
        """Learn the counts of the span that just closed, shape (k,); NaN entries mean not observed."""
        row = self._fill(self._check_row(counts))
        self._learn(row)
        self._num_spans += 1

    def forecast(self) -> np.ndarray:
        """Expected counts of the next span per type, shape (k,), >= 0. Pure.

        Raises ForecastNotReady before warm-up.
        """
        if not self._ready():
            raise ForecastNotReady(f"{self.kind}: not ready after {self._num_spans} spans "
                                   f"({self._not_ready_reason()})")
        out = np.asarray(self._forecast(), dtype=np.float64).reshape(self.k)
        return np.maximum(np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0), 0.0)

    def needs_retrain(self) -> bool:
        """Whether the driver should call `retrain()` now (only trained models ever say so). Pure."""
        return False

    def retrain(self) -> object:
        """Retrain on the history seen so far (a no-op for models that learn in `learn_one`)."""
        return None

    def params(self) -> dict[str, Any]:
        """Hyperparameters under their constructor names (k and seed included). Pure."""
        return {"k": self.k, "seed": self.seed, **{p: getattr(self, p) for p in self._params}}

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this forecaster, as JSON-compatible data. Pure."""
        return {"format": FORMAT_VERSION, "kind": self.kind, "params": _jsonable(self.params()),
                "num_spans": self._num_spans, "last": self._last.tolist(), "meta": _jsonable(self.meta),
                "state": self._get_state()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Forecaster:
        """Rebuild a forecaster of this class written by `to_dict` (`oserve.forecast.registry.load_forecaster`
        reads any kind)."""
        if data.get("format") != FORMAT_VERSION:
            raise ConfigError(f"forecaster file format {data.get('format')!r} is not supported "
                              f"(expected {FORMAT_VERSION})")
        kind = data.get("kind")
        if not cls.kind or kind != cls.kind:
            raise ConfigError(f"forecaster kind {kind!r} cannot be loaded as {cls.__name__}")
        obj = cls(**data["params"])
        obj._num_spans = int(data["num_spans"])
        obj._last = np.array(data["last"], dtype=np.float64)
        obj.meta = dict(data.get("meta", {}))
        obj._set_state(data["state"])
        return obj

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the forecaster to a JSON file at `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Forecaster:
        """Read a forecaster of this class written by `save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read forecaster file {str(path)!r}: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def _unit_test_params(cls) -> list[dict[str, Any]]:
        """Settings the contract suite (`oserve.forecast.checks`) runs this forecaster with: small ones,
        so the whole suite stays fast on two cores (River's `_unit_test_params`)."""
        return [{}]

    def clone(self) -> Forecaster:
        """A fresh, unfitted forecaster with the same hyperparameters. Pure."""
        return type(self)(**self.params())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    # -------------------------------------------------------------------------------- for subclasses

    def _fit_filled(self, rows: np.ndarray) -> None:
        """Learn a whole (NaN-filled) history after `_reset`; default: `_learn` row by row."""
        for row in rows:
            self._learn(row)

    @abstractmethod
    def _reset(self) -> None: ...

    @abstractmethod
    def _learn(self, row: np.ndarray) -> None: ...

    @abstractmethod
    def _forecast(self) -> np.ndarray: ...

    @abstractmethod
    def _ready(self) -> bool: ...

    def _not_ready_reason(self) -> str:
        return "needs more spans"

    @abstractmethod
    def _get_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def _set_state(self, state: dict[str, Any]) -> None: ...

    # -------------------------------------------------------------------------------- validation

    def _check_row(self, counts: np.ndarray) -> np.ndarray:
        row = np.asarray(counts, dtype=np.float64)
        if row.shape != (self.k,):
            raise ConfigError(f"{self.kind}: learn_one needs counts of shape ({self.k},); got {row.shape}")
        if np.any(row < 0) or np.any(np.isinf(row)):
            raise ConfigError(f"{self.kind}: counts must be finite and >= 0 (NaN = not observed); "
                              f"got {row.tolist()}")
        return row

    def _check_history(self, history: np.ndarray) -> np.ndarray:
        rows = np.asarray(history, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self.k:
            raise ConfigError(f"{self.kind}: fit needs a history of shape (num_spans, {self.k}); "
                              f"got {rows.shape}")
        if np.any(rows < 0) or np.any(np.isinf(rows)):
            raise ConfigError(f"{self.kind}: history counts must be finite and >= 0 (NaN = not observed)")
        return rows

    def _fill(self, row: np.ndarray) -> np.ndarray:
        """Replace NaN (not observed) by the type's last observed count; remember the observed ones."""
        missing = np.isnan(row)
        out = np.where(missing, self._last, row)
        self._last = out.copy()
        return out


def _jsonable(value: Any) -> Any:
    """Plain JSON types for numpy scalars and tuples. Pure."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"cannot save a non-finite parameter {value!r}")
    return value
