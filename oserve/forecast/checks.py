"""The contract every forecaster meets, as checks in River's `yield_checks` style.

`yield_checks(make)` yields check functions; each takes `make` (a function k -> fresh forecaster) and a
folder it may write to, and raises AssertionError when the forecaster breaks the contract. The tests
run every check on every forecaster; a new forecaster runs the same suite unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from oserve.errors import ConfigError
from oserve.forecast.registry import load_forecaster
from oserve.forecast.base import Forecaster, ForecastNotReady

Make = Callable[[int], Forecaster]
Check = Callable[[Make, Path], None]

K = 3
HISTORY_SPANS = 60
LATENCY_LIMIT_S = 0.010


def history(num_spans: int = HISTORY_SPANS, k: int = K, seed: int = 0) -> np.ndarray:
    """A small noisy periodic count series, shape (num_spans, k). Pure."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_spans)[:, None]
    rate = 20 + 10 * np.sin(2 * np.pi * t / 12 + np.arange(k)[None, :]) + 5 * np.arange(k)[None, :]
    return rng.poisson(rate).astype(np.float64)


def _valid(f: np.ndarray, k: int) -> None:
    assert isinstance(f, np.ndarray) and f.shape == (k,) and f.dtype == np.float64, f
    assert np.all(np.isfinite(f)) and np.all(f >= 0), f


def check_not_ready_before_data(make: Make, tmp: Path) -> None:
    fc = make(K)
    assert not fc.ready
    try:
        fc.forecast()
    except ForecastNotReady:
        pass
    else:
        raise AssertionError("forecast() before any data must raise ForecastNotReady")


def check_ready_after_fit(make: Make, tmp: Path) -> None:
    fc = make(K).fit(history())
    assert fc.ready and fc.num_spans == HISTORY_SPANS
    _valid(fc.forecast(), K)


def check_forecast_is_pure(make: Make, tmp: Path) -> None:
    fc = make(K).fit(history())
    before = fc.to_dict()
    a, b = fc.forecast(), fc.forecast()
    assert np.array_equal(a, b)
    assert fc.to_dict() == before, "forecast() changed the forecaster's state"


def check_learn_one_keeps_forecasts_valid(make: Make, tmp: Path) -> None:
    h = history(HISTORY_SPANS + 20)
    fc = make(K).fit(h[:HISTORY_SPANS])
    for row in h[HISTORY_SPANS:]:
        fc.learn_one(row)
        _valid(fc.forecast(), K)
    assert fc.num_spans == HISTORY_SPANS + 20


def check_spans_without_arrivals(make: Make, tmp: Path) -> None:
    h = history()
    h[10:25] = 0.0
    fc = make(K).fit(h)
    for _ in range(15):
        fc.learn_one(np.zeros(K))
        _valid(fc.forecast(), K)
    fc2 = make(K).fit(np.zeros((HISTORY_SPANS, K)))  # a history with no arrivals at all
    _valid(fc2.forecast(), K)


def check_type_appearing_late(make: Make, tmp: Path) -> None:
    h = history(HISTORY_SPANS + 40)
    h[:HISTORY_SPANS, K - 1] = 0.0  # the last type is absent from the whole training history
    fc = make(K).fit(h[:HISTORY_SPANS])
    _valid(fc.forecast(), K)
    for row in h[HISTORY_SPANS:]:
        fc.learn_one(row)
        _valid(fc.forecast(), K)
    assert fc.forecast()[K - 1] > 0, "a type that has appeared must get a positive forecast"


def check_unobserved_span(make: Make, tmp: Path) -> None:
    h = history()
    h[20:23] = np.nan  # a collection gap in the history
    fc = make(K).fit(h)
    fc.learn_one(np.full(K, np.nan))
    _valid(fc.forecast(), K)


def check_rejects_bad_input(make: Make, tmp: Path) -> None:
    fc = make(K).fit(history())
    for bad in (np.zeros(K + 1), np.full(K, -1.0), np.full(K, np.inf)):
        try:
            fc.learn_one(bad)
        except ConfigError:
            continue
        raise AssertionError(f"learn_one({bad!r}) must raise ConfigError")
    try:
        make(K).fit(np.zeros((5, K + 1)))
    except ConfigError:
        pass
    else:
        raise AssertionError("fit with the wrong number of types must raise ConfigError")


def check_save_load_roundtrip(make: Make, tmp: Path) -> None:
    h = history(HISTORY_SPANS + 10)
    fc = make(K).fit(h[:HISTORY_SPANS])
    fc.meta = {"trace": "test"}
    path = tmp / f"{fc.kind}.json"
    fc.save(path)
    back = load_forecaster(path)
    assert type(back) is type(fc) and back.params() == fc.params() and back.meta == fc.meta
    assert np.array_equal(back.forecast(), fc.forecast())
    for row in h[HISTORY_SPANS:]:
        fc.learn_one(row)
        back.learn_one(row)
        assert np.array_equal(back.forecast(), fc.forecast())
    assert type(fc).load(path).num_spans == HISTORY_SPANS


def check_deterministic_for_seed(make: Make, tmp: Path) -> None:
    h = history()
    assert np.array_equal(make(K).fit(h).forecast(), make(K).fit(h).forecast())


def check_clone_is_fresh(make: Make, tmp: Path) -> None:
    fc = make(K).fit(history())
    twin = fc.clone()
    assert twin.params() == fc.params() and not twin.ready and twin.num_spans == 0


def check_forecast_latency(make: Make, tmp: Path) -> None:
    fc = make(K).fit(history())
    fc.forecast()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fc.forecast()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    assert median < LATENCY_LIMIT_S, f"forecast() takes {median * 1e3:.2f} ms (limit {LATENCY_LIMIT_S * 1e3:g})"


def check_params_under_their_names(make: Make, tmp: Path) -> None:
    fc = make(K)
    params = fc.params()
    assert params["k"] == K and "seed" in params
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in params.values())
    again = type(fc)(**params)
    assert again.params() == params


def yield_checks(make: Make) -> Iterator[Check]:
    """Every contract check, in a fixed order (River's `utils.estimator_checks.yield_checks` style)."""
    del make  # every check applies to every forecaster
    yield check_not_ready_before_data
    yield check_ready_after_fit
    yield check_forecast_is_pure
    yield check_learn_one_keeps_forecasts_valid
    yield check_spans_without_arrivals
    yield check_type_appearing_late
    yield check_unobserved_span
    yield check_rejects_bad_input
    yield check_save_load_roundtrip
    yield check_deterministic_for_seed
    yield check_clone_is_fresh
    yield check_forecast_latency
    yield check_params_under_their_names
