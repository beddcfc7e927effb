"""The gate that puts the LSTM in force only while it beats last value on recent spans."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster, ForecastNotReady
from oserve.forecast.baselines import LastValue, MovingAverage
from oserve.forecast.gate import GateConfig, GatedForecaster
from oserve.forecast.metrics import rrmse

SPAN_S = 60.0
counts_st = st.lists(st.lists(st.integers(0, 200), min_size=3, max_size=3), min_size=1, max_size=30)


class _Oracle(Forecaster):
    """Forecasts a known series exactly (a challenger that must win), or a fixed wrong answer."""

    kind = "oracle"

    def __init__(self, k: int, seed: int = 0, series=None, wrong: float | None = None) -> None:
        super().__init__(k, seed)
        self.series = np.asarray(series, dtype=float)
        self.wrong = wrong
        self._reset()

    def _reset(self) -> None:
        self._n = 0

    def _learn(self, row: np.ndarray) -> None:
        self._n += 1

    def _ready(self) -> bool:
        return self._n > 0

    def _forecast(self) -> np.ndarray:
        if self.wrong is not None:
            return np.full(self.k, self.wrong)
        return self.series[min(self._n, len(self.series) - 1)]

    def _get_state(self):
        return {"n": self._n}

    def _set_state(self, state) -> None:
        self._n = state["n"]


@given(counts_st)
def test_without_a_challenger_it_is_last_value(rows) -> None:
    gate = GatedForecaster(LastValue(3), SPAN_S)
    for row in rows:
        gate.observe(np.array(row))
        assert gate.source == "last_value"
        np.testing.assert_allclose(gate.rates_rps(), np.array(row) / SPAN_S)
    assert gate.why_not_challenger() == "no challenger"


@given(counts_st, st.integers(1, 5), st.integers(1, 5))
def test_recent_error_is_the_rrmse_of_the_last_window_of_forecasts(rows, window, min_scored) -> None:
    """Reference: the relative RMSE recomputed from the forecasts each member made, over the window."""
    min_scored = min(min_scored, window)
    gate = GatedForecaster(LastValue(3), SPAN_S, challenger=MovingAverage(3, window_spans=3),
                           config=GateConfig(window_spans=window, min_scored_spans=min_scored))
    made: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"last_value": [], "moving_average": []}
    pending: dict[str, np.ndarray | None] = {"last_value": None, "moving_average": None}
    shadow = {"last_value": LastValue(3), "moving_average": MovingAverage(3, window_spans=3)}
    for row in rows:
        actual = np.array(row, dtype=float)
        before = gate.rates_rps() if pending["last_value"] is not None else None
        for kind, f in shadow.items():
            if pending[kind] is not None:
                made[kind].append((pending[kind], actual))
            f.learn_one(actual)
            pending[kind] = f.forecast()
        gate.observe(actual)
        errors = gate.recent_rrmse()
        for kind, pairs in made.items():
            recent = pairs[-window:]
            want = rrmse(np.array([p for p, _ in recent]), np.array([a for _, a in recent])) if recent else math.nan
            assert (math.isnan(want) and math.isnan(errors[kind])) or errors[kind] == pytest.approx(want), kind
        # the rule, against the reference errors
        scored = len(made["moving_average"][-window:])
        e_c, e_b = errors["moving_average"], errors["last_value"]
        wins = scored >= min_scored and not math.isnan(e_c) and (math.isnan(e_b) or e_c < e_b)
        assert gate.source == ("moving_average" if wins else "last_value")
        assert (gate.why_not_challenger() == "") == wins
        if before is not None:
            assert np.all(before >= 0)


@given(counts_st)
def test_forecasting_never_changes_the_gate(rows) -> None:
    gate = GatedForecaster(LastValue(3), SPAN_S, challenger=MovingAverage(3, window_spans=2))
    for row in rows:
        gate.observe(np.array(row))
        first = (gate.source, gate.rates_rps().tolist(), gate.recent_rrmse(), gate.why_not_challenger())
        second = (gate.source, gate.rates_rps().tolist(), gate.recent_rrmse(), gate.why_not_challenger())
        assert repr(first) == repr(second)  # repr: NaN errors compare equal


def test_a_perfect_challenger_takes_over_and_a_wrong_one_never_does() -> None:
    rng = np.random.default_rng(1)
    series = rng.poisson(50, size=(40, 3)).astype(float)
    good = GatedForecaster(LastValue(3), SPAN_S, challenger=_Oracle(3, series=series),
                           config=GateConfig(window_spans=5, min_scored_spans=3))
    bad = GatedForecaster(LastValue(3), SPAN_S, challenger=_Oracle(3, series=series, wrong=1e4))
    sources_good, sources_bad = [], []
    for row in series:
        good.observe(row)
        bad.observe(row)
        sources_good.append(good.source)
        sources_bad.append(bad.source)
    assert sources_good[:3] == ["last_value"] * 3  # scored on fewer than 3 spans
    assert set(sources_good[3:]) == {"oracle"}
    np.testing.assert_allclose(good.rates_rps(), series[-1] / SPAN_S)  # the oracle's forecast of the next span
    assert set(sources_bad) == {"last_value"}
    assert "does not beat" in bad.why_not_challenger()


class _Late(_Oracle):
    """Ready only after `after` spans, then always forecasting `wrong`."""

    def __init__(self, k: int, seed: int = 0, after: int = 5, wrong: float = 51.0) -> None:
        super().__init__(k, seed, series=[[0.0] * k], wrong=wrong)
        self.after = after

    def _ready(self) -> bool:
        return self._n >= self.after


def test_a_late_challenger_is_judged_only_on_the_spans_both_forecast() -> None:
    """Last value is terrible while the counts swing (before the challenger is ready) and exact once they
    settle; the challenger is close but never exact. Over the spans both forecast last value wins, so the
    challenger must never be put in force, though over each one's own window it would look better."""
    swing = [[0.0] * 2, [100.0] * 2] * 3  # 6 spans
    steady = [[50.0] * 2] * 8
    gate = GatedForecaster(LastValue(2), SPAN_S, challenger=_Late(2, after=7),
                           config=GateConfig(window_spans=10, min_scored_spans=3))
    for row in swing + steady:
        gate.observe(np.array(row))
        assert gate.source == "last_value"
    own = gate.recent_rrmse()
    assert own["oracle"] < own["last_value"]  # each over its own spans: the comparison the gate must not make
    assert "does not beat" in gate.why_not_challenger()


def test_a_span_the_challenger_learned_already_is_neither_taught_nor_scored_again() -> None:
    challenger = MovingAverage(2, window_spans=2)
    gate = GatedForecaster(LastValue(2), SPAN_S, challenger=challenger)
    gate.observe(np.array([10.0, 10.0]))
    gate.observe(np.array([20.0, 20.0]), learned_by=("moving_average",))
    assert challenger.num_spans == 1 and gate.baseline.num_spans == 2
    # last value was scored on the second span, the moving average was not
    assert [sorted(sp) for sp in gate._spans] == [[], ["last_value"]]
    gate.observe(np.array([30.0, 30.0]))  # both forecast this one, after the skipped span
    assert sorted(gate._spans[-1]) == ["last_value", "moving_average"]


def test_not_ready_and_bad_input_are_explicit() -> None:
    gate = GatedForecaster(LastValue(2), SPAN_S, challenger=MovingAverage(2))
    with pytest.raises(ForecastNotReady):
        gate.rates_rps()
    assert gate.source == "last_span"
    with pytest.raises(ConfigError, match="needs 2 counts"):
        gate.observe(np.zeros(3))
    with pytest.raises(ConfigError, match="challenger has 3 classes"):
        GatedForecaster(LastValue(2), SPAN_S, challenger=MovingAverage(3))
    with pytest.raises(ConfigError):
        GateConfig(window_spans=2, min_scored_spans=3)
    assert gate.retrain_job() is None  # a baseline never asks to be retrained


def test_the_lstm_is_trained_by_the_caller_and_judged_from_then_on() -> None:
    from oserve.forecast.lstm import LSTMForecaster

    t = np.arange(60)
    series = np.stack([40 + 30 * np.sin(t / 2.0), 20 + 0 * t], axis=1)
    lstm = LSTMForecaster(2, lookback_spans=4, min_train_spans=8, retrain_every_spans=5, epochs=5, hidden_size=4)
    gate = GatedForecaster(LastValue(2), SPAN_S, challenger=lstm)
    trainings = 0
    for row in series[:20]:
        gate.observe(row)
        job = gate.retrain_job()
        if job is not None:  # what the forecaster stage runs on a thread
            gate.install(job.run())
            trainings += 1
    assert trainings >= 2 and lstm.ready
    errors = gate.recent_rrmse()
    assert math.isfinite(errors["lstm"]) and math.isfinite(errors["last_value"])  # both scored since training
    assert not gate.needs_retrain()  # retrained when asked, nothing pending
