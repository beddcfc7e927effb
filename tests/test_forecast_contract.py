"""Every forecaster passes the one contract suite (`oserve.forecast.checks`, River's yield_checks style)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from oserve.forecast.checks import yield_checks
from oserve.forecast.registry import FORECASTER_NAMES, forecaster_class


def _maker(cls, params):
    return lambda k: cls(k, **params)


# every registered forecaster, with each of its own small test settings
FORECASTERS = {f"{kind}-{i}": _maker(forecaster_class(kind), params)
               for kind in FORECASTER_NAMES for i, params in enumerate(forecaster_class(kind)._unit_test_params())}

CASES = [(name, check) for name, make in FORECASTERS.items() for check in yield_checks(make)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("name", "check"), CASES, ids=[f"{n}-{c.__name__}" for n, c in CASES])
def test_contract(name, check, tmp_path):
    check(FORECASTERS[name], tmp_path)


counts = arrays(np.float64, st.tuples(st.integers(1, 40), st.just(2)),
                elements=st.one_of(st.just(0.0), st.integers(0, 10_000).map(float),
                                   st.floats(0, 1e6, allow_nan=False, allow_infinity=False)))


@pytest.mark.parametrize("name", [n for n in FORECASTERS if not n.startswith("lstm")])
@settings(max_examples=25, deadline=None)
@given(h=counts)
def test_baseline_forecasts_never_negative(name, h):
    fc = FORECASTERS[name](2).fit(h)
    if fc.ready:
        f = fc.forecast()
        assert f.shape == (2,) and np.all(np.isfinite(f)) and np.all(f >= 0)


@settings(max_examples=6, deadline=None)
@given(h=arrays(np.float64, st.tuples(st.integers(10, 30), st.just(2)),
                elements=st.one_of(st.just(0.0), st.floats(0, 1e5, allow_nan=False, allow_infinity=False))))
def test_lstm_forecasts_never_negative(h):
    from oserve.forecast import LSTMForecaster

    fc = LSTMForecaster(2, lookback_spans=4, hidden_size=4, epochs=2, min_train_spans=6).fit(h)
    f = fc.forecast()
    assert f.shape == (2,) and np.all(np.isfinite(f)) and np.all(f >= 0)
    fc.learn_one(np.zeros(2))
    assert np.all(fc.forecast() >= 0)
