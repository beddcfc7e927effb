"""Per-type series from ServeGen files, and the metrics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA
from oserve.errors import ConfigError, TraceError
from oserve.forecast import chronological_split, noise_floor_report, poisson_noise_floor, rrmse, rrmse_report
from oserve.forecast.servegen_series import servegen_series
from test_forecast_cli import _write_servegen

TRACES = SHARED_DATA / "traces"


def test_tiny_servegen_split(tmp_path):
    trace = _write_servegen(tmp_path)
    s = servegen_series(trace, tmp_path / "servegen_tiny_lengths.csv", k=1, fit_samples=1000)
    assert s.counts.shape == (72, 1) and s.gap_spans == 1
    assert np.isnan(s.counts[40]).all()
    expected = np.array([9 * (1 + w % 3) for w in range(72)], dtype=float)
    ok = ~np.isnan(s.counts[:, 0])
    assert np.allclose(s.counts[ok, 0], expected[ok])  # the split keeps the model's totals
    assert s.covered_share == pytest.approx(2 / 3)


def test_missing_files_raise(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        servegen_series(tmp_path / "a.csv", tmp_path / "b.csv")


@pytest.mark.skipif(not (TRACES / "servegen_m-mid.csv").is_file(), reason="ServeGen traces not in ../shared/data")
def test_real_servegen_series():
    large = servegen_series(TRACES / "servegen_m-large.csv", TRACES / "servegen_m-large_lengths.csv")
    assert large.counts.shape == (2016, 4) and large.gap_spans == 0
    assert large.counts.sum() == pytest.approx(236_892_826, rel=1e-9)
    assert large.types.names == ("SISO", "SILO", "LISO", "LILO")
    assert 0.6 < large.covered_share < 0.65  # 37.3 % of requests come from clients without lengths
    mid = servegen_series(TRACES / "servegen_m-mid.csv", TRACES / "servegen_m-mid_lengths.csv")
    assert mid.gap_spans == 102  # 84 empty windows and 18 near-empty ones at their edges
    assert np.nansum(mid.counts) < 2_165_253_970


def test_rrmse_and_report():
    actual = np.array([[10.0, 0.0], [20.0, 10.0], [np.nan, np.nan]])
    pred = np.array([[12.0, 0.0], [18.0, 10.0], [5.0, 5.0]])
    assert rrmse(actual, actual) == 0.0
    rep = rrmse_report(pred, actual)
    assert rep["overall"] == pytest.approx(2 / 20)  # totals 10 vs 12, 30 vs 28; mean 20
    assert rep["per_type"][1] == 0.0
    assert np.isnan(rrmse(np.zeros(3), np.zeros(3)))
    with pytest.raises(ConfigError):
        rrmse(np.zeros(2), np.zeros(3))


@settings(max_examples=10, deadline=None)
@given(rate=st.floats(5, 500), seed=st.integers(0, 1000))
def test_noise_floor_is_what_knowing_the_rate_scores(rate, seed):
    counts = np.random.default_rng(seed).poisson(rate, size=(4000, 1)).astype(float)
    floor = poisson_noise_floor(counts)
    assert floor == pytest.approx(1 / np.sqrt(counts.mean()))
    assert rrmse(np.full_like(counts, rate), counts) == pytest.approx(floor, rel=0.1)
    assert noise_floor_report(counts)["overall"] == pytest.approx(floor)


def test_chronological_split():
    assert chronological_split(350) == 315
    with pytest.raises(ConfigError):
        chronological_split(1)
    with pytest.raises(ConfigError):
        chronological_split(10, 1.0)
