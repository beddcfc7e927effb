"""ServeGen traces (`oserve.servegen`): counts, arrivals, lengths, clients, errors, the inverse-CDF sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA
from hypothesis import given
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.servegen import (default_start_s, load_servegen, percentile_inverse_cdf, servegen_requests,
                             servegen_trace, slice_mean_rps)
from oserve.workload_types import fit_types

TRACES = SHARED_DATA / "traces"
COLS = ("client_id,window_start_s,field,n_support,mean,min,p1,p5,p10,p20,p25,p30,p40,p50,p60,p70,p75,p80,p90,"
        "p95,p99,p99.9,max")
LEVELS = (0, 1, 5, 10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 95, 99, 99.9, 100)


def _quantiles(lo: int, hi: int) -> str:
    return ",".join(str(int(round(lo + (hi - lo) * (p / 100) ** 2))) for p in LEVELS)


def _write(tmp: Path) -> Path:
    """Three clients over 12 hours: 0 (Gamma, short prompts, long answers), 1 (Weibull, long prompts, short
    answers), 2 (no length rows: drawn from the pool); window 40 has no request at all."""
    rows = ["client_id,timestamp_s,rate_rps,iat_cv,iat_dist,iat_shape,iat_scale"]
    for c, base, dist, shape in ((0, 30, "Gamma", 0.5), (1, 12, "Weibull", 0.4), (2, 7, "Gamma", 2.0)):
        for w in range(72):
            n = 0 if w == 40 else base * (1 + (w + c) % 3)
            rows.append(f"{c},{w * 600},{n / 600},1.0,{dist if n else ''},{shape if n else 0},{1.0 if n else 0}")
    trace = tmp / "servegen_tiny.csv"
    trace.write_text("\n".join(rows) + "\n")
    lines = [COLS]
    for w in (0, 21600):
        lines.append(f"0,{w},input_tokens,9,1,{_quantiles(5, 80)}")
        lines.append(f"0,{w},output_tokens,9,1,{_quantiles(300, 3000)}")
        lines.append(f"1,{w},input_tokens,9,1,{_quantiles(2000, 9000 + w // 10)}")
        lines.append(f"1,{w},output_tokens,9,1,{_quantiles(2, 40)}")
        lines.append(f"2,{w},input_tokens,0,,{','.join([''] * 18)}")
        lines.append(f"2,{w},output_tokens,0,,{','.join([''] * 18)}")
    (tmp / "servegen_tiny_lengths.csv").write_text("\n".join(lines) + "\n")
    return trace


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_servegen(_write(tmp_path_factory.mktemp("sg")))


def test_counts_match_the_trace_per_client_window(tiny):
    r = servegen_requests(tiny, start_s=1800.0, minutes=60.0, rng=np.random.default_rng(1))
    got = np.zeros_like(tiny.count)
    np.add.at(got, (np.searchsorted(tiny.client_ids, r.client_id), r.span_index), 1)
    assert np.array_equal(got[:, 3:9], tiny.count[:, 3:9])
    assert got[:, :3].sum() == 0 and got[:, 9:].sum() == 0


def test_arrivals_sorted_inside_their_windows_and_the_slice(tiny):
    r = servegen_requests(tiny, start_s=1500.0, minutes=25.0, rng=np.random.default_rng(2))
    assert np.all(np.diff(r.arrival_s) >= 0)
    assert np.all(r.arrival_s >= 600.0 * r.span_index) and np.all(r.arrival_s < 600.0 * (r.span_index + 1))
    assert r.arrival_s.min() >= 1500.0 and r.arrival_s.max() < 3000.0


def test_lengths_within_each_clients_range_and_pool_for_uncovered(tiny):
    r = servegen_requests(tiny, start_s=0.0, minutes=120.0, rng=np.random.default_rng(3))
    c0, c1, c2 = (r.client_id == c for c in (0, 1, 2))
    assert r.input_tokens[c0].min() >= 5 and r.input_tokens[c0].max() <= 80
    assert r.output_tokens[c0].min() >= 300 and r.output_tokens[c0].max() <= 3000
    assert r.input_tokens[c1].min() >= 2000 and r.input_tokens[c1].max() <= 9000
    assert r.output_tokens[c1].min() >= 2 and r.output_tokens[c1].max() <= 40
    # client 2 draws whole requests from client 0 or client 1 (never a mix of the two)
    short = r.input_tokens[c2] <= 80
    assert short.any() and (~short).any()
    assert np.all(r.output_tokens[c2][short] >= 300) and np.all(r.output_tokens[c2][~short] <= 40)


def test_a_slice_is_a_trace_with_its_clients_deterministic_for_a_seed(tiny):
    w = servegen_trace(tiny, start_s=0.0, minutes=60.0, rng=np.random.default_rng(4))
    w2 = servegen_trace(tiny, start_s=0.0, minutes=60.0, rng=np.random.default_rng(4))
    for a, b in ((w.arrival_s, w2.arrival_s), (w.input_tokens, w2.input_tokens),
                 (w.output_tokens, w2.output_tokens), (w.client_ids, w2.client_ids)):
        assert np.array_equal(a, b)
    assert set(np.unique(w.client_ids)) <= set(tiny.client_ids.tolist())
    assert w.arrival_s.min() >= 0.0 and w.arrival_s.max() < 3600.0 and (w.max_tokens == 0).all()
    w3 = servegen_trace(tiny, start_s=0.0, minutes=60.0, rng=np.random.default_rng(5))
    assert not np.array_equal(w.arrival_s, w3.arrival_s)


def test_fractional_rate_scale_rounds_each_count_stochastically(tiny):
    s = 0.37
    r = servegen_requests(tiny, start_s=0.0, minutes=360.0, rate_scale=s, rng=np.random.default_rng(6))
    got = np.zeros_like(tiny.count)
    np.add.at(got, (np.searchsorted(tiny.client_ids, r.client_id), r.span_index), 1)
    want = tiny.count[:, :36] * s
    assert np.all((got[:, :36] == np.floor(want)) | (got[:, :36] == np.ceil(want)))
    assert abs(got.sum() - want.sum()) < 4 * np.sqrt(want.size)
    assert slice_mean_rps(tiny, 0.0, 360.0) == pytest.approx(tiny.count[:, :36].sum() / 21600.0)


def test_clear_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="servegen-m-large"):
        load_servegen("servegen-m-tiny")
    with pytest.raises(ConfigError, match="not found"):
        load_servegen(tmp_path / "servegen_nothing.csv")
    with pytest.raises(ConfigError, match="not found"):
        load_servegen("servegen-m-mid", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="no request"):
        servegen_requests(tiny, start_s=40 * 600.0, minutes=10.0, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="ends after"):
        servegen_requests(tiny, start_s=0.0, minutes=13 * 60.0, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="rate_scale"):
        servegen_requests(tiny, start_s=0.0, minutes=10.0, rate_scale=0.0, rng=np.random.default_rng(0))
    bad = tmp_path / "servegen_bad.csv"
    bad.write_text("a,b\n1,2\n")
    (tmp_path / "servegen_bad_lengths.csv").write_text(COLS + "\n")
    with pytest.raises(ConfigError, match="servegen_bad"):
        load_servegen(bad)


@given(st.lists(st.integers(0, 100_000), min_size=18, max_size=18),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_inverse_cdf_within_range_and_monotone(raw, u1, u2):
    q = np.sort(np.array(raw, dtype=float))
    lo, hi = sorted((u1, u2))
    a, b = percentile_inverse_cdf(q, np.array([lo, hi]))
    assert q[0] <= a <= b <= q[-1]
    assert percentile_inverse_cdf(q, np.array([0.0]))[0] == q[0]
    assert percentile_inverse_cdf(q, np.array([1.0]))[0] == q[-1]


@pytest.mark.skipif(not (TRACES / "servegen_m-large.csv").is_file(), reason="ServeGen traces not in ../shared/data")
def test_real_m_large_default_slice():
    data = load_servegen("servegen-m-large")
    start = default_start_s(data)
    assert start == default_start_s(data) and start % 600 == 0
    t0 = int(start // 600)
    # bit-exact per client-window counts at rate_scale 1 over one 10-minute window
    r = servegen_requests(data, start_s=start, minutes=10.0, rng=np.random.default_rng(0))
    got = np.bincount(np.searchsorted(data.client_ids, r.client_id), minlength=len(data.client_ids))
    assert np.array_equal(got, data.count[:, t0])
    w = servegen_trace(data, start_s=start, minutes=60.0, rng=np.random.default_rng(0),
                       rate_scale=20.0 / slice_mean_rps(data, start, 60.0))
    assert len(w) == pytest.approx(20.0 * 3600, rel=0.02)
    types = fit_types(w.input_tokens, w.output_tokens)
    kind = types.classify(w.input_tokens, w.output_tokens)
    mix = np.array([np.bincount(kind[(w.arrival_s // 600) == j], minlength=4) for j in range(6)], float)
    mix /= mix.sum(axis=1, keepdims=True)
    assert (mix.max(axis=0) - mix.min(axis=0)).max() > 0.2  # the mix shifts within the hour
