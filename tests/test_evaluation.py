"""The evaluation is honest by construction: no decision sees the future, everything is fitted on the
history, every policy gets the same router class, serving fewer is never faster, the bound is a bound."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA
from oserve.evaluation.bounds import isolated_latency_bound
from oserve.evaluation.compare import EvalConfig, compare, prepare, run_policy, speedup
from oserve.evaluation.registry import POLICIES, policy_spec
from oserve.evaluation.scenarios import build_scenario, mean_mix, minute_loads, true_types
from oserve.planner.config import PlannerConfig
from oserve.planner.twin import TwinConfig
from oserve.specs import GPUS, cluster_for_gpus, model_preset
from oserve.traces import Trace

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")
QUICK = EvalConfig(planner=PlannerConfig(twin=TwinConfig(initial_horizon_s=120.0, horizon_s=90.0, warmup_s=30.0,
                                                         max_num_requests=3000), neighbour_steps=1),
                   static_candidates=2, bound=False)


@pytest.fixture(scope="module")
def small():
    """A shifting mix on 8 GPUs: 6 minutes after 3 of history."""
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("T4", LLAMA, cluster, minutes=6, history_minutes=3, seed=1)
    return cluster, scenario, prepare(LLAMA, cluster, scenario, QUICK)


def _perturb_after(trace: Trace, t: float, seed: int) -> Trace:
    """The same requests before t; after it, other lengths, and some requests gone or added."""
    rng = np.random.default_rng(seed)
    late = trace.arrival_s >= t
    keep = ~late | (rng.random(len(trace)) < 0.7)
    idx = np.nonzero(keep)[0]
    out = trace.take(idx)
    inp, outp = out.input_tokens.copy(), out.output_tokens.copy()
    after = out.arrival_s >= t
    inp[after] = rng.integers(10, 3000, after.sum())
    outp[after] = rng.integers(1, 1500, after.sum())
    extra = int(rng.integers(0, 200))
    arrival = np.concatenate([out.arrival_s, t + rng.random(extra) * (trace.duration_s - t + 1.0)])
    inp = np.concatenate([inp, rng.integers(10, 3000, extra)])
    outp = np.concatenate([outp, rng.integers(1, 1500, extra)])
    order = np.argsort(arrival, kind="stable")
    return Trace(arrival[order], inp[order], outp[order], name="perturbed")


def _decisions_before(result, t: float) -> list:
    return [(s["span_index"], s["deployment"], s["forecast_rps"], s["label"], s["switch_s"])
            for s in result.spans if s["start_s"] + result.arrival_s.min() <= t]


@pytest.mark.parametrize("name", ["oserve", "vllm-reload", "dynamo"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.3, 0.8), seed=st.integers(0, 1000))
def test_changing_the_trace_after_t_changes_no_decision_before_t(small, cut, seed, name) -> None:
    """Reference: the same policy on the trace, and on a copy that differs only after time t (lengths
    changed, requests dropped and added). Every decision made up to t, every class given at arrival
    before t, and every latency of a request finished before t are identical."""
    cluster, scenario, prepared = small
    setup = prepared.setup
    t = float(scenario.window.arrival_s.min() + cut * scenario.window.duration_s)
    changed = _perturb_after(scenario.window, t, seed)
    a = run_policy(setup, name, QUICK.sim)[0]
    b = run_policy(replace(setup, window=changed), name, QUICK.sim)[0]
    assert _decisions_before(a, t) == _decisions_before(b, t) and len(_decisions_before(a, t)) >= 2
    early_a, early_b = a.arrival_s < t, b.arrival_s < t
    assert np.array_equal(a.routed_class[early_a], b.routed_class[early_b])
    done_a = early_a & (a.finish_s <= t)
    done_b = early_b & (b.finish_s <= t)
    assert np.array_equal(a.e2e_s[done_a], b.e2e_s[done_b]) and done_a.any()


def test_everything_a_policy_knows_is_fitted_on_the_history(small) -> None:
    """The prior depends on the history alone: two windows after the same history give one prior."""
    cluster, scenario, prepared = small
    other = replace(scenario, window=_perturb_after(scenario.window, 0.0, 3))
    again = prepare(LLAMA, cluster, other, QUICK)
    p, q = prepared.setup.prior, again.setup.prior
    assert p.types == q.types and p.lengths == q.lengths and np.array_equal(p.counts, q.counts)
    assert prepared.setup.static == again.setup.static and prepared.static_tried == again.static_tried


def test_the_static_deployment_is_the_best_on_the_history(small) -> None:
    cluster, scenario, prepared = small
    tried = prepared.static_tried
    assert len(tried) == QUICK.static_candidates
    assert str(prepared.setup.static.replicas[0].shape) == min(tried, key=tried.get)


def test_every_policy_classifies_once_and_routes_by_the_same_rule(small) -> None:
    cluster, scenario, prepared = small
    for name in POLICIES:
        res, accuracy = run_policy(prepared.setup, name, QUICK.sim)
        assert res.finished.sum() + res.dropped.sum() + res.refused.sum() == len(scenario.window)
        assert (res.routed_class[res.admitted] >= 0).all()
        assert np.array_equal(res.generated_tokens[res.finished], res.output_tokens[res.finished])
        if name in ("oserve", "vllm-reload", "perfect-forecast"):
            assert 0.5 < accuracy <= 1.0  # classes estimated at arrival, right most of the time
        else:
            assert np.isnan(accuracy) and (res.routed_class[res.admitted] == 0).all()
    assert policy_spec("perfect-forecast").reference and not policy_spec("oserve").reference


def test_serving_fewer_is_never_faster(small) -> None:
    cluster, scenario, prepared = small
    res = run_policy(prepared.setup, "vllm-static", QUICK.sim)[0]
    fewer = replace(res, dropped=res.dropped.copy(), e2e_s=res.e2e_s.copy())
    slow = np.nonzero(res.finished)[0][np.argsort(res.e2e_s[res.finished])[-3:]]
    fewer.dropped[slow] = True  # the three slowest never finish: the percentile would drop without the rule
    fewer.e2e_s[slow] = np.inf
    assert speedup(fewer, res) <= 1.0 and speedup(res, fewer) >= 1.0
    assert speedup(res, res) == 1.0


def test_the_bound_is_below_every_request_of_every_policy(small) -> None:
    cluster, scenario, prepared = small
    bound = isolated_latency_bound(LLAMA, cluster, prepared.setup.prior.table, scenario.window)
    for name in ("oserve", "vllm-static", "dynamo"):
        res = run_policy(prepared.setup, name, QUICK.sim)[0]
        adm = res.admitted
        assert len(bound) == adm.sum()
        assert np.all(res.e2e_s[adm] >= bound * (1 - 1e-9))
        assert res.percentile("e2e", 99) >= float(np.percentile(bound, 99))


def test_dynamo_scales_the_replica_count_with_the_load(small) -> None:
    cluster, scenario, prepared = small
    quiet = replace(prepared.setup, window=scenario.window.take(np.arange(0, len(scenario.window), 8)))
    counts = [len(s["deployment"]) for s in run_policy(quiet, "dynamo", QUICK.sim)[0].spans]
    busy = [len(s["deployment"]) for s in run_policy(prepared.setup, "dynamo", QUICK.sim)[0].spans]
    assert min(counts) < min(busy) and min(counts) >= 1  # its first count comes from the history
    shapes = {d[1] for s in run_policy(prepared.setup, "dynamo", QUICK.sim)[0].spans for d in s["deployment"]}
    assert shapes == {str(prepared.setup.static.replicas[0].shape)}  # the worker's parallelism is fixed


def _timeless(result) -> dict:
    return {k: v for k, v in result.summary().items() if not k.startswith("decide")}


def test_comparisons_are_deterministic_and_oserve_does_not_depend_on_its_company() -> None:
    """The same comparison twice gives the same results; and OServe asked for alone is the same policy as
    beside vllm-static: it is seeded with the static candidates' runs on the history and holds its trial
    against static's choice either way (before, alone it was neither seeded nor trialled)."""
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S2", LLAMA, cluster, minutes=2, history_minutes=2)
    runs = [compare(LLAMA, cluster, scenario, ("oserve", "vllm-static"), QUICK) for _ in range(2)]
    for name in ("oserve", "vllm-static"):
        assert _timeless(runs[0].results[name]) == _timeless(runs[1].results[name])
    alone = compare(LLAMA, cluster, scenario, ("oserve",), QUICK)
    assert alone.static_tried == runs[0].static_tried and len(alone.static_tried) == QUICK.static_candidates
    assert _timeless(alone.results["oserve"]) == _timeless(runs[0].results["oserve"])
    assert alone.results["oserve"].policy_notes["trial"] == runs[0].results["oserve"].policy_notes["trial"]
    assert np.array_equal(alone.results["oserve"].e2e_s, runs[0].results["oserve"].e2e_s, equal_nan=True)


def test_build_scenario_scales_to_the_requested_load():
    cluster = cluster_for_gpus(16)
    low = build_scenario("azure-conv", LLAMA, cluster, load=0.4, minutes=10)
    high = build_scenario("azure-conv", LLAMA, cluster, load=0.8, minutes=10)
    assert len(high.window) == pytest.approx(2 * len(low.window), rel=0.05)
    assert len(high.history) == pytest.approx(2 * len(low.history), rel=0.05)
    assert high.window.arrival_s.min() >= 0 and high.history.arrival_s.max() < high.history_s
    s1 = build_scenario("S1", LLAMA, cluster, minutes=5)
    s5 = build_scenario("S5", LLAMA, cluster, minutes=5)
    assert s5.cv > s1.cv


def test_quiet_busy_runs_each_phase_at_its_own_load_and_its_history_has_seen_the_peak():
    """Reference: each phase's rate from the capacity table, as `static_capacity_rps` ranks it."""
    from oserve.capacity import CapacityTable, LatencyTarget
    from oserve.evaluation.scenarios import QUIET_BUSY_MIXES, QUIET_BUSY_PHASES
    from oserve.planner.candidates import static_capacity_rps

    cluster = cluster_for_gpus(8)
    sc = build_scenario("quiet-busy", LLAMA, cluster, load=0.8, minutes=9, history_minutes=4)
    table = CapacityTable(LLAMA, cluster.gpu, sc.types, LatencyTarget(), gpus_per_node=cluster.gpus_per_node)
    kinds = true_types(sc.window, sc.types)
    for i, (phase, fraction) in enumerate(QUIET_BUSY_PHASES):  # 3-minute phases
        shares = np.array([QUIET_BUSY_MIXES[phase].get(name, 0.0) for name in sc.types.names])
        rate = fraction * 0.8 * static_capacity_rps(table, cluster, shares / shares.sum())[0][0]
        inside = (sc.window.arrival_s >= 180.0 * i) & (sc.window.arrival_s < 180.0 * (i + 1))
        assert inside.sum() == pytest.approx(rate * 180.0, rel=0.1)  # Poisson: a few hundred to a thousand
        mix = np.bincount(kinds[inside], minlength=sc.types.k) / inside.sum()
        assert np.abs(mix - shares / shares.sum()).max() < 0.08
    busy = (sc.window.arrival_s >= 180.0) & (sc.window.arrival_s < 360.0)
    assert busy.sum() > 1.8 * (sc.window.arrival_s < 180.0).sum()
    # the history: a quiet phase, then a busy one
    early = sc.history.arrival_s < 120.0
    assert sc.history.arrival_s.max() < sc.history_s and (~early).sum() > 1.8 * early.sum()


def test_compositions_draw_history_and_window_from_disjoint_requests():
    from oserve.evaluation.scenarios import POOL_SPLIT_S
    from oserve.traces import load_trace

    cluster = cluster_for_gpus(8)
    sc = build_scenario("S3", LLAMA, cluster, minutes=3)
    pool = load_trace("azure-conv")
    early = {(a, b) for a, b in zip(pool.input_tokens[pool.arrival_s < POOL_SPLIT_S],
                                    pool.output_tokens[pool.arrival_s < POOL_SPLIT_S])}
    late = {(a, b) for a, b in zip(pool.input_tokens[pool.arrival_s >= POOL_SPLIT_S],
                                   pool.output_tokens[pool.arrival_s >= POOL_SPLIT_S])}
    hist = set(zip(sc.history.input_tokens, sc.history.output_tokens))
    win = set(zip(sc.window.input_tokens, sc.window.output_tokens))
    assert hist <= early and win <= late


def test_traces_are_scaled_by_their_busy_minutes_not_their_mean():
    """A trace's 90th-percentile minute lands at the requested load (the mean lies below it)."""
    from oserve.capacity import CapacityTable

    cluster = cluster_for_gpus(16)
    sc = build_scenario("azure-code", LLAMA, cluster, load=0.8, minutes=30)
    table = CapacityTable(LLAMA, H100, sc.types)
    loads = minute_loads(sc.window, sc.types, table, cluster)
    assert float(np.quantile(loads[:-1], 0.9)) == pytest.approx(0.8, rel=0.1)
    assert loads.mean() < 0.7


@pytest.mark.skipif(not (SHARED_DATA / "traces" / "servegen_m-mid.csv").is_file(),
                    reason="ServeGen traces not in ../shared/data")
def test_servegen_scenario_reaches_the_load_shifts_its_mix_and_has_a_history():
    from oserve.capacity import CapacityTable

    cluster = cluster_for_gpus(16)
    sc = build_scenario("servegen-m-mid", LLAMA, cluster, load=0.6, minutes=30)
    assert sc.name == "servegen-m-mid" and len(sc.window) > 1000 and len(sc.history) > 100
    assert (sc.window.client_ids >= 0).all()  # who sent each request: the estimator's tag
    table = CapacityTable(LLAMA, H100, sc.types)
    loads = minute_loads(sc.window, sc.types, table, cluster)
    assert float(np.quantile(loads[:-1], 0.9)) == pytest.approx(0.6, rel=0.1)
    kind = true_types(sc.window, sc.types)
    ten = (sc.window.arrival_s // 600).astype(int)
    shares = np.array([np.bincount(kind[ten == t], minlength=4) / max((ten == t).sum(), 1)
                       for t in range(ten.max() + 1)])
    assert np.abs(np.diff(shares, axis=0)).max() > 0.05  # the mix moves between windows
    assert abs(mean_mix(sc.window, sc.types).sum() - 1.0) < 1e-9


def test_tuning_searches_one_threshold_at_a_time_and_keeps_the_best() -> None:
    from oserve.evaluation.tuning import tune

    cluster = cluster_for_gpus(8)
    grid = {"switch_gain": (0.05, 0.3), "neighbour_min_gain": (QUICK.planner.neighbour_min_gain,)}
    result = tune(LLAMA, cluster, ("S2",), minutes=2, grid=grid, base=QUICK.planner,
                  config=replace(QUICK, history_trial=False))  # a trial per grid point is not what this tests
    tried = {tuple(sorted(t["thresholds"].items())) for t in result.trials}
    assert len(tried) == len(result.trials) == 3  # the start, then each value of each threshold once
    best = max(result.trials, key=lambda t: t["objective"])
    assert result.objective == best["objective"] and result.best == best["thresholds"]
    for t in result.trials:
        speedups = list(t["speedups"].values())
        assert t["objective"] == pytest.approx(float(np.exp(np.mean(np.log(speedups)))))
