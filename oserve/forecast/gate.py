"""A challenger forecaster (the LSTM) put in force only while it beats a baseline on recent spans. Pure.

No clock, no threads, no files. The live forecaster stage drives it; the simulator's OServe policy
forecasts by `oserve.forecast.rates.RateForecaster` (last value by default, `EvalConfig.forecaster`).

Every span, before learning the counts that just closed, both forecasters' forecasts for that span
(made before it closed) are scored against them; the scores of the last `window_spans` spans are kept.
The challenger is *in force* (its forecast is the one returned) once both forecasters have been scored
on at least `min_scored_spans` of those spans and, over exactly those spans, the challenger's relative
RMSE is below the baseline's by `margin_frac`; otherwise the baseline answers. Both are always
scored, so a challenger that falls behind is retired at the next span and one that catches up is put
back; comparing them only on the spans both forecast keeps a challenger that became ready late from
being judged on easier spans than the baseline.

Retraining is the caller's (a trained challenger's `needs_retrain` / `prepare_retrain` / `install`, see
`oserve.forecast.lstm`): `retrain_job()` hands out the snapshot to train on, `install()` swaps the
result in; the gate never trains inline, so a worker can train on a thread while forecasts go on.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster, ForecastNotReady


@dataclass(frozen=True, slots=True)
class GateConfig:
    """When the challenger's forecast is used."""

    window_spans: int = 10
    """Recent spans each forecaster is judged on (relative RMSE over all types of these spans)."""
    min_scored_spans: int = 3
    """The challenger must have forecast at least this many of them before it can be put in force."""
    margin_frac: float = 0.0
    """It must beat the baseline's relative RMSE by this fraction (0: any improvement)."""

    def __post_init__(self) -> None:
        if self.window_spans < 1 or not 1 <= self.min_scored_spans <= self.window_spans:
            raise ConfigError(f"GateConfig: need window_spans >= min_scored_spans >= 1, got {self.window_spans}, "
                              f"{self.min_scored_spans}")
        if not 0 <= self.margin_frac < 1:
            raise ConfigError(f"GateConfig.margin_frac must be in [0, 1), got {self.margin_frac}")


class GatedForecaster:
    """Per-class rates of the next span from a baseline, or from a challenger while it beats the baseline
    (see the module docstring). Same verbs as `oserve.forecast.rates.RateForecaster`."""

    def __init__(self, baseline: Forecaster, span_s: float, challenger: Forecaster | None = None,
                 config: GateConfig = GateConfig()) -> None:
        if not span_s > 0:
            raise ConfigError(f"GatedForecaster: span_s must be positive, got {span_s}")
        if challenger is not None and challenger.k != baseline.k:
            raise ConfigError(f"GatedForecaster: the challenger has {challenger.k} classes, the baseline {baseline.k}")
        self.baseline, self.challenger, self.config = baseline, challenger, config
        self.span_s = float(span_s)
        self._last: np.ndarray | None = None
        self._pending: dict[str, np.ndarray | None] = {}  # kind -> its forecast of the span now open
        # one entry per closed span: kind -> (squared error summed over classes, actual count summed) of
        # each forecaster that had forecast it
        self._spans: deque[dict[str, tuple[float, float]]] = deque(maxlen=config.window_spans)
        for f in self._members():  # a forecaster fitted before it is handed over forecasts the first span
            self._pending[f.kind] = f.forecast() if f.ready else None

    @property
    def k(self) -> int:
        return self.baseline.k

    def _members(self) -> list[Forecaster]:
        return [f for f in (self.baseline, self.challenger) if f is not None]

    def observe(self, counts: np.ndarray, *, learned_by: tuple[str, ...] = ()) -> None:
        """One more span has closed with these per-class counts: score the forecasts made for it, learn it,
        and forecast the next one (for scoring then). Forecasters whose kind is in `learned_by` learned
        this span already (a network saved after it, reloaded): they are neither scored nor taught it
        again, and only forecast the next span."""
        row = np.asarray(counts, dtype=float)
        if row.shape != (self.k,):
            raise ConfigError(f"GatedForecaster.observe: needs {self.k} counts, got shape {row.shape}")
        scored = {}
        for f in self._members():
            if f.kind not in learned_by:
                predicted = self._pending.get(f.kind)
                if predicted is not None:
                    scored[f.kind] = (float(np.sum((predicted - row) ** 2)), float(row.sum()))
                f.learn_one(row)
            self._pending[f.kind] = f.forecast() if f.ready else None
        self._spans.append(scored)
        self._last = row

    def _rrmse(self, kind: str, spans: list[dict[str, tuple[float, float]]]) -> float:
        """Relative RMSE (`oserve.forecast.metrics.rrmse`) of `kind` over `spans`, pooled over the classes."""
        if not spans:
            return math.nan
        sq = sum(sp[kind][0] for sp in spans)
        total = sum(sp[kind][1] for sp in spans)
        n = len(spans) * self.k
        return math.sqrt(sq / n) / (total / n) if total > 0 else math.nan

    def recent_rrmse(self) -> dict[str, float]:
        """Relative RMSE of each forecaster over the recent spans it forecast (NaN before any, or when
        nothing arrived in them). Pure."""
        return {f.kind: self._rrmse(f.kind, [sp for sp in self._spans if f.kind in sp]) for f in self._members()}

    def _head_to_head(self) -> tuple[int, float, float]:
        """(spans both forecast, the challenger's and the baseline's relative RMSE over them). Pure."""
        c, b = self.challenger, self.baseline
        assert c is not None
        both = [sp for sp in self._spans if c.kind in sp and b.kind in sp]
        return len(both), self._rrmse(c.kind, both), self._rrmse(b.kind, both)

    def _challenger_in_force(self) -> bool:
        c = self.challenger
        if c is None or not c.ready:
            return False
        n, ce, be = self._head_to_head()
        if n < self.config.min_scored_spans or math.isnan(ce):
            return False
        return math.isnan(be) or ce < be * (1.0 - self.config.margin_frac)

    @property
    def source(self) -> str:
        """The forecaster `rates_rps` answers with now: the challenger's kind, the baseline's, or 'last_span'
        while neither is ready. Pure."""
        if self._challenger_in_force():
            assert self.challenger is not None
            return self.challenger.kind
        return self.baseline.kind if self.baseline.ready else "last_span"

    def why_not_challenger(self) -> str:
        """Why the challenger is not in force ('' when it is). Pure."""
        c = self.challenger
        if c is None:
            return "no challenger"
        if self._challenger_in_force():
            return ""
        if not c.ready:
            return f"{c.kind} not trained yet"
        n, ce, be = self._head_to_head()
        if n < self.config.min_scored_spans:
            return f"{c.kind} scored on {n} of the {self.config.min_scored_spans} spans it needs"
        return (f"{c.kind} relative RMSE {ce:.3f} does not beat {self.baseline.kind}'s {be:.3f} over the last "
                f"{n} spans")

    def rates_rps(self) -> np.ndarray:
        """Forecast per-class rates of the next span, finite and >= 0. Pure.

        Raises:
            ForecastNotReady: no span observed yet.
        """
        source = self.source
        if source == "last_span":
            if self._last is None:
                raise ForecastNotReady("no span observed yet")
            counts = self._last
        else:
            counts = self._pending.get(source)
            if counts is None:  # installed or loaded since the last span: forecast now
                counts = (self.challenger if source == getattr(self.challenger, "kind", None) else self.baseline).forecast()
        return np.maximum(np.nan_to_num(np.asarray(counts, dtype=float), nan=0.0, posinf=0.0), 0.0) / self.span_s

    # --- retraining, by the caller -----------------------------------------------------------------

    def needs_retrain(self) -> bool:
        """Whether the challenger asks to be retrained now. Pure."""
        c = self.challenger
        return c is not None and hasattr(c, "prepare_retrain") and c.needs_retrain()

    def retrain_job(self):
        """The challenger's training snapshot when it asks to be retrained (None otherwise). Pure."""
        return self.challenger.prepare_retrain() if self.needs_retrain() else None  # type: ignore[union-attr]

    def install(self, trained) -> None:
        """Swap a trained network into the challenger. Its forecast of the span now open is made at once
        (before that span closes), so the new network is scored from that span on."""
        c = self.challenger
        assert c is not None and hasattr(c, "install")
        c.install(trained)
        self._pending[c.kind] = c.forecast() if c.ready else None
