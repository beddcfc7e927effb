"""Performance model: calibration reproduces its shipped coefficients, held-out accuracy, physics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import SHARED_DATA
from oserve import calibration as cal
from oserve.data import data_path
from oserve.perfmodel import (COEFFICIENTS_FILE, Batch, PerfModel, collective_seconds, gemm_seconds,
                              shipped_coefficients)
from oserve.specs import GPUS, MODELS, ReplicaShape, model_preset, valid_shapes

H100 = GPUS["h100-80gb"]
DATA_DIR = data_path(COEFFICIENTS_FILE).parent


@pytest.fixture(scope="module")
def compact():
    return cal.read_compact(DATA_DIR)


def _close(a, b, rel: float, path: str = "") -> list[str]:
    """Where two JSON-like trees differ: numbers beyond `rel` relative difference, anything else unequal."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [m for k in a for m in _close(a[k], b[k], rel, f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _close(x, y, rel, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=rel, abs_tol=1e-15) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_shipped_coefficients_are_the_fit_of_the_shipped_points(compact):
    """The shipped file is what `oserve calibrate` fits. Within 1e-5 relative: the solver's last digits
    move between SciPy/NumPy patch releases (1e-7 seen), a wrong or stale fit moves them by far more
    (a fit with eff_bw bounded at 1 differs from the shipped one by 30% in eff_bw)."""
    refit = json.loads(json.dumps(cal.fit_all(*compact, H100.peak_flops, H100.hbm_bytes_per_s)))
    assert _close(refit, shipped_coefficients(), rel=1e-5) == []


@given(st.integers(1, 64), st.sampled_from([(8192, 8192), (8192, 28672), (28672, 8192), (4096, 11008)]))
def test_a_gemm_whose_weights_miss_l2_never_beats_hbm(m, kn):
    """eff_bw > 1 stands for L2-resident shards in the profiler's repeated runs (see `fit_gemm`); a GEMM
    whose weights exceed the 50 MiB L2 still streams them no faster than HBM."""
    g = shipped_coefficients()["gemm"]
    assert 0 < g["eff_flops"] <= 1
    k, n = kn
    weight_bytes = 2 * k * n
    assert weight_bytes > 50 * 2**20
    assert weight_bytes / gemm_seconds(g, m, k, n, H100.peak_flops, H100.hbm_bytes_per_s) <= H100.hbm_bytes_per_s


@pytest.mark.skipif(not (SHARED_DATA / "profiling").exists(), reason="../shared/data/profiling not present")
def test_shipped_points_are_exactly_the_measured_medians(compact):
    layers, colls = cal.extract_profiles(SHARED_DATA / "profiling")
    assert (layers, colls) == compact


def test_held_out_accuracy_meets_target(compact):
    s = cal.score(*compact, H100.peak_flops, H100.hbm_bytes_per_s)
    assert s["layers"]["mape"] <= 0.10
    assert s["layers"]["points"] == 3132
    assert all(m["mape"] <= 0.10 for m in s["layers"]["per_model"].values())
    assert s["collectives"]["mape"] <= 0.15


def test_gemm_roofline_limits():
    g = shipped_coefficients()["gemm"]
    k, n = 8192, 57344
    big = gemm_seconds(g, 1 << 16, k, n, H100.peak_flops, H100.hbm_bytes_per_s)
    achieved = 2 * (1 << 16) * k * n / big
    assert 0.5 * H100.peak_flops < achieved <= H100.peak_flops  # compute-bound: a plausible fraction of peak
    small = gemm_seconds(g, 1, k, n, H100.peak_flops, H100.hbm_bytes_per_s)
    assert 2 * k * n / small <= H100.hbm_bytes_per_s  # memory-bound: never faster than HBM allows


def test_collective_curve_is_monotone_and_extrapolates():
    curve = shipped_coefficients()["collectives"]["all_reduce_8"]
    sizes = np.geomspace(1, 1 << 30, 200)
    t = collective_seconds(curve, sizes)
    assert np.all(np.diff(t) >= 0) and np.all(t > 0)


models = st.sampled_from(sorted(MODELS))


def _shapes(name):
    return valid_shapes(MODELS[name], H100, 8, 16)


@given(name=models, data=st.data(), tokens=st.integers(1, 8192), extra=st.integers(1, 4096))
def test_more_tokens_never_faster(name, data, tokens, extra):
    shape = data.draw(st.sampled_from(_shapes(name)))
    timer = PerfModel(MODELS[name], H100).timer(shape)
    a = timer.iteration_seconds(Batch.of([(tokens, 0)]))
    b = timer.iteration_seconds(Batch.of([(tokens + extra, 0)]))
    assert b >= a > 0
    seqs = min(tokens, 512)
    d1 = timer.iteration_seconds(Batch.of(decode_contexts=[100] * seqs))
    d2 = timer.iteration_seconds(Batch.of(decode_contexts=[100] * seqs + [100] * min(extra, 256)))
    d3 = timer.iteration_seconds(Batch.of(decode_contexts=[100 + extra] * seqs))
    assert d2 >= d1 and d3 >= d1


@given(name=models, seqs=st.integers(1, 256), ctx=st.integers(1, 2048))
def test_more_pp_stages_never_slower_bottleneck(name, seqs, ctx):
    pm = PerfModel(MODELS[name], H100)
    shapes = _shapes(name)
    batch = Batch.of(decode_contexts=[ctx] * seqs)
    for s in shapes:
        deeper = ReplicaShape(s.tp, s.pp * 2)
        if deeper in shapes and deeper.num_gpus <= 8:
            assert pm.timer(deeper).bottleneck_seconds(batch) <= pm.timer(s).bottleneck_seconds(batch) * 1.0001


def test_batch_of_matches_manual_sums():
    b = Batch.of([(100, 0), (50, 200)], [10, 20, 30])
    assert b.num_tokens == 153 and b.num_decode_seqs == 3 and b.decode_context_tokens == 60
    assert b.prefill_pairs == pytest.approx(100 * 50.5 + 50 * (200 + 25.5))
    assert b.num_logit_rows == 5 and b.prefill_cached_tokens == 200


def test_plausible_llama70b_times():
    """Cross-check against first principles: prefill near compute roofline, decode near weight streaming."""
    m = model_preset("llama2-70b")
    t = PerfModel(m, H100).timer(ReplicaShape(4))
    prefill = t.iteration_seconds(Batch.of([(4096, 0)]))
    ideal = 2 * m.num_params * 4096 / (4 * H100.peak_flops)
    assert ideal < prefill < 3 * ideal
    decode = t.iteration_seconds(Batch.of(decode_contexts=[1]))
    stream = m.weight_bytes / 4 / H100.hbm_bytes_per_s
    assert stream < decode < 4 * stream
    assert math.isfinite(prefill) and math.isfinite(decode)


def test_a100_is_slower_than_h100():
    m = model_preset("llama2-70b")
    batch = Batch.of([(2048, 0)], [500] * 32)
    h = PerfModel(m, H100).iteration_seconds(ReplicaShape(4), batch)
    a = PerfModel(m, GPUS["a100-80gb"]).iteration_seconds(ReplicaShape(4), batch)
    assert a > h


@given(name=models, data=st.data(), chunk=st.integers(0, 8192), cached=st.integers(0, 4096),
       contexts=st.lists(st.integers(1, 4096), max_size=64))
def test_vectorised_bottleneck_matches_scalar(name, data, chunk, cached, contexts):
    shape = data.draw(st.sampled_from(_shapes(name)))
    timer = PerfModel(MODELS[name], H100).timer(shape)
    b = Batch.of([(chunk, cached)] if chunk else [], contexts)
    v = timer.bottleneck_seconds_many(np.array([b.num_tokens]), np.array([b.prefill_pairs]),
                                      np.array([b.decode_context_tokens + b.prefill_cached_tokens + b.num_tokens]),
                                      np.array([b.num_logit_rows]))[0]
    assert v == pytest.approx(timer.bottleneck_seconds(b), rel=1e-12, abs=1e-15)


@given(st.integers(1, 8192), st.integers(0, 200), st.integers(0, 3000), st.integers(0, 200_000),
       st.sampled_from([ReplicaShape(1, 2), ReplicaShape(2, 3), ReplicaShape(4, 2), ReplicaShape(8, 2),
                        ReplicaShape(1, 1)]))
def test_the_pipelined_step_is_the_max_of_latency_and_pp_bottlenecks(tokens, dec, cached, ctx, shape):
    """Reference: the two public quantities it fuses, computed separately."""
    timer = PerfModel(model_preset("llama2-70b"), H100).timer(shape)
    b = Batch(tokens + dec, tokens * (cached + (tokens + 1) / 2), cached, dec, ctx, 1 + dec)
    expected = max(timer.iteration_seconds(b), shape.pp * timer.bottleneck_seconds(b))
    assert timer.pipelined_step_seconds(b) == pytest.approx(expected, rel=1e-12)
