"""The LSTM forecaster: learns a clean periodic series, retrains without blocking, ships for azure-conv."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oserve.errors import ConfigError
from oserve.forecast import (ForecastNotReady, LastValue, LSTMForecaster, MovingAverage, load_forecaster,
                             rolling_forecast, rrmse)
from oserve.forecast.bundled import BUNDLED_FORECASTERS, load_bundled_forecaster


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def periodic(num_spans: int, period: int = 24, k: int = 2) -> np.ndarray:
    t = np.arange(num_spans)[:, None]
    return 100 + 60 * np.sin(2 * np.pi * t / period + np.array([[0.0, 1.5]])[:, :k]) + 20 * np.arange(k)


def test_learns_a_clean_periodic_series():
    series = periodic(400)
    fc = LSTMForecaster(2, lookback_spans=24, hidden_size=16, epochs=60, learning_rate=1e-2, seed=0)
    result = rolling_forecast(fc, series, 360)
    err = rrmse(result.predicted, result.actual)
    lv = rrmse(rolling_forecast(LastValue(2), series, 360).predicted, result.actual)
    assert err < 0.05, f"RRMSE {err:.4f} on a clean sine"
    assert err < 0.5 * lv  # and much better than repeating the last span (lv is about 0.15 here)


def test_untrained_until_enough_history_then_retrain_when_asked():
    fc = LSTMForecaster(1, lookback_spans=4, hidden_size=4, epochs=2)
    assert fc.min_train_spans == 20
    for i in range(19):
        fc.learn_one(np.array([float(i % 5)]))
        assert not fc.needs_retrain()
        with pytest.raises(ForecastNotReady, match="needs 20 spans"):
            fc.forecast()
    fc.learn_one(np.array([1.0]))
    assert fc.needs_retrain()
    with pytest.raises(ConfigError):
        LSTMForecaster(1, lookback_spans=4).prepare_retrain()  # no history: says so, no IndexError
    fc.retrain()
    assert fc.ready and not fc.needs_retrain()
    assert fc.forecast().shape == (1,)


def test_retraining_on_a_snapshot_does_not_block_forecasts():
    series = periodic(120)
    fc = LSTMForecaster(2, lookback_spans=10, hidden_size=8, epochs=3, retrain_every_spans=5,
                        finetune_epochs=2).fit(series[:100])
    old = fc.trained
    for row in series[100:105]:
        fc.learn_one(row)
    assert fc.needs_retrain()
    job = fc.prepare_retrain()  # snapshot taken here; training can run on another thread
    before = fc.forecast()
    for row in series[105:110]:  # the live side goes on learning and forecasting with the old network
        fc.learn_one(row)
        assert fc.trained is old
        assert np.all(fc.forecast() >= 0)
    assert len(job.history) == 105 and job.init_state is not None  # fine-tunes the current weights
    trained = job.run()
    assert fc.trained is old  # run() touched nothing
    fc.install(trained)
    assert fc.trained is trained and trained.trained_at_spans == 105
    assert fc.forecast().shape == (2,) and before.shape == (2,)
    assert fc.needs_retrain()  # 5 spans learned since the snapshot


def test_rolling_forecast_retrains_when_due():
    series = periodic(90)
    fc = LSTMForecaster(2, lookback_spans=10, hidden_size=4, epochs=2, retrain_every_spans=10, finetune_epochs=1)
    rolling_forecast(fc, series, 60)
    assert fc.trained.trained_at_spans == 90


def test_save_load_identical_forecasts(tmp_path):
    series = periodic(80)
    fc = LSTMForecaster(2, lookback_spans=10, hidden_size=8, epochs=3, season_spans=24).fit(series[:70])
    fc.save(tmp_path / "m.json")
    back = load_forecaster(tmp_path / "m.json")
    assert isinstance(back, LSTMForecaster)
    for row in series[70:]:
        assert np.array_equal(back.forecast(), fc.forecast())
        back.learn_one(row)
        fc.learn_one(row)
    with pytest.raises(ConfigError, match="cannot be loaded as MovingAverage"):
        MovingAverage.load(tmp_path / "m.json")


def test_rejects_bad_hyperparameters():
    with pytest.raises(ConfigError, match="lookback_spans"):
        LSTMForecaster(2, lookback_spans=0)
    with pytest.raises(ConfigError, match="validation_fraction"):
        LSTMForecaster(2, validation_fraction=1.5)
    with pytest.raises(ConfigError, match="k"):
        LSTMForecaster(0)


def test_bundled_azure_conv_model_loads_and_forecasts_fast():
    import time

    assert "azure-conv" in BUNDLED_FORECASTERS
    fc = load_bundled_forecaster("azure-conv")
    assert isinstance(fc, LSTMForecaster) and fc.ready
    assert fc.meta["trace"] == "azure-conv" and fc.meta["span_s"] == 10.0
    assert fc.meta["types"] == ["SISO", "SILO", "LISO", "LILO"]
    f = fc.forecast()
    assert f.shape == (4,) and np.all(f >= 0) and f.sum() > 0
    t0 = time.perf_counter()
    for _ in range(10):
        fc.forecast()
    assert (time.perf_counter() - t0) / 10 < 0.010
    with pytest.raises(ConfigError, match="azure-conv"):
        load_bundled_forecaster("nope")
