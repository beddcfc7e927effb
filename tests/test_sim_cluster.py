"""Cluster simulator and policies: conservation through switches, determinism, routing, placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA

from oserve.capacity import CapacityTable
from oserve.sim.cluster import Decision, SimConfig, SmoothRouter, simulate
from oserve.sim.evaluate import build_scenario, compare
from oserve.sim.policies import OServePolicy, PlanningContext, StaticPolicy, homogeneous_deployment, stabilize
from oserve.sim.workloads import from_trace, scale_volume, sequence
from oserve.specs import GPUS, Deployment, Replica, ReplicaShape, cluster_for_gpus, model_preset
from oserve.workload import fit_types, load_trace

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")


@pytest.fixture(scope="module")
def conv():
    trace = load_trace("azure-conv").slice_time(0.0, 600.0)
    types = fit_types(trace.input_tokens, trace.output_tokens)
    return trace, types, CapacityTable(LLAMA, H100, types)


class Scripted:
    """A policy that switches between two given deployments every span (to exercise switching)."""

    name = "scripted"

    def __init__(self, decisions):
        self.decisions = decisions

    def decide(self, view):
        return self.decisions[view.span_index % len(self.decisions)]

    def route(self, req, replicas):
        return None


def _even(dep: Deployment, k: int = 4):
    return tuple((1.0,) * len(dep.replicas) for _ in range(k))


def test_every_request_finishes_once_through_switches(conv):
    trace, types, _ = conv
    cluster = cluster_for_gpus(16)
    a = Deployment(tuple(Replica(f"a{i}", ReplicaShape(4), tuple(range(4 * i, 4 * i + 4))) for i in range(4)))
    b = Deployment(tuple(Replica(f"b{i}", ReplicaShape(8), tuple(range(8 * i, 8 * i + 8))) for i in range(2)))
    policy = Scripted([Decision(a, _even(a), 5.0), Decision(b, _even(b), 5.0)])
    w = scale_volume(from_trace(trace, types), 4.0, np.random.default_rng(1))
    res = simulate(LLAMA, H100, cluster, w.arrival_s, w.input_tokens, w.output_tokens, w.type_index, 4, policy,
                   SimConfig(span_s=60.0, migrate_min_context_tokens=256))
    assert not res.dropped.any()
    assert np.all(res.e2e_s > 0) and np.all(res.ttft_s <= res.e2e_s)
    assert sum(s["switched"] for s in res.spans) >= 9
    assert res.num_migrations > 0  # long contexts moved with their KV


def test_policy_comparison_is_deterministic(conv):
    trace, types, table = conv
    cluster = cluster_for_gpus(16)
    w = scale_volume(from_trace(trace.slice_time(0, 300), types), 3.0, np.random.default_rng(2))
    runs = [compare(LLAMA, H100, cluster, w, CapacityTable(LLAMA, H100, types), ("oserve", "vllm-static"))
            for _ in range(2)]
    for name in ("oserve", "vllm-static"):
        s1, s2 = runs[0].results[name].summary(), runs[1].results[name].summary()
        assert s1 == s2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oserve_switches_when_the_mix_shifts(conv, seed):
    """A short-output mix, then a long-output one at the capacity of LLaMA-30B's best deployment for
    it: the short-output plan cannot serve the second phase, and the planner (capacity model, no twin,
    free switching) moves to another deployment; nothing is lost on the way."""
    from oserve.sim.evaluate import static_capacity_rps
    from oserve.sim.workloads import Workload, composition

    _, types, _ = conv
    model = model_preset("llama-30b")
    table = CapacityTable(model, H100, types)
    pool = from_trace(load_trace("azure-conv"), types)
    cluster = cluster_for_gpus(16)
    rng = np.random.default_rng(seed)
    parts = []
    for i, phase in enumerate(({"SISO": 90.0, "LISO": 10.0}, {"LILO": 90.0, "SILO": 10.0})):
        mix = np.zeros(4)
        for name, pct in phase.items():
            mix[types.index(name)] = pct / 100.0
        rate = 1.0 * static_capacity_rps(table, cluster, mix)[0][0]
        parts.append(composition(phase, pool, types, rate, 240.0, rng, start_s=i * 240.0))
    w = Workload("short-then-long", *(np.concatenate([getattr(p, f) for p in parts])
                                      for f in ("arrival_s", "input_tokens", "output_tokens", "type_index")))
    ctx = PlanningContext(model, cluster, table, initial_rps=w.first_span_rps(60.0, 4))
    res = simulate(model, H100, cluster, w.arrival_s, w.input_tokens, w.output_tokens, w.type_index, 4,
                   OServePolicy(ctx, oracle=True, twin=None))
    assert not res.dropped.any()
    labels = [s["label"] for s in res.spans]
    assert labels[0] == "initial" and "switch" in labels[4:], labels
    first, later = res.spans[0]["deployment"], res.spans[-1]["deployment"]
    assert sorted(d[1] for d in first) != sorted(d[1] for d in later)


@given(weights=st.lists(st.integers(0, 7), min_size=1, max_size=6).filter(lambda w: sum(w) > 0))
def test_smooth_router_is_exactly_proportional_over_a_cycle(weights):
    router = SmoothRouter((tuple(float(w) for w in weights),), [1.0] * len(weights))
    accepting = np.ones(len(weights), dtype=bool)
    total = sum(weights)
    picks = [router.pick(0, accepting) for _ in range(total * 3)]
    counts = np.bincount(picks, minlength=len(weights))
    assert counts.tolist() == [3 * w for w in weights]


def test_router_skips_replicas_not_accepting():
    router = SmoothRouter(((1.0, 1.0, 1.0),), [1.0, 1.0, 1.0])
    accepting = np.array([True, False, True])
    assert {router.pick(0, accepting) for _ in range(10)} == {0, 2}


def test_stabilize_keeps_shared_replicas_in_place(conv):
    _, _, table = conv
    cluster = cluster_for_gpus(16)
    ctx = PlanningContext(LLAMA, cluster, table)
    old = homogeneous_deployment(ctx, ReplicaShape(4))
    new = Deployment((Replica("x0", ReplicaShape(8), tuple(range(8))), Replica("x1", ReplicaShape(4), (8, 9, 10, 11)),
                      Replica("x2", ReplicaShape(4), (12, 13, 14, 15))))
    out = stabilize(old, new, cluster)
    kept = {(r.shape, r.gpu_ids) for r in old.replicas} & {(r.shape, r.gpu_ids) for r in out.replicas}
    assert len(kept) == 2  # two TP4 replicas stay where they were
    assert sorted(g for r in out.replicas for g in r.gpu_ids) == list(range(16))
    for r in out.replicas:
        assert not r.placement_problems(cluster)


def test_static_policy_never_switches(conv):
    trace, types, table = conv
    cluster = cluster_for_gpus(16)
    ctx = PlanningContext(LLAMA, cluster, table, initial_rps=np.ones(4))
    w = from_trace(trace.slice_time(0, 300), types)
    res = simulate(LLAMA, H100, cluster, w.arrival_s, w.input_tokens, w.output_tokens, w.type_index, 4,
                   StaticPolicy(ctx, homogeneous_deployment(ctx, ReplicaShape(4))))
    assert sum(s["switched"] for s in res.spans) == 1  # the initial deployment only


def test_build_scenario_scales_to_the_requested_load():
    cluster = cluster_for_gpus(16)
    low = build_scenario("azure-conv", LLAMA, H100, cluster, load=0.4, minutes=10)
    high = build_scenario("azure-conv", LLAMA, H100, cluster, load=0.8, minutes=10)
    assert len(high.workload) == pytest.approx(2 * len(low.workload), rel=0.05)
    s1 = build_scenario("S1", LLAMA, H100, cluster, minutes=5)
    s5 = build_scenario("S5", LLAMA, H100, cluster, minutes=5)
    assert s5.cv > s1.cv


def test_traces_are_scaled_by_their_busy_minutes_not_their_mean():
    """A trace's 90th-percentile minute lands at the requested load (the mean lies below it)."""
    from oserve.sim.evaluate import minute_loads

    cluster = cluster_for_gpus(16)
    sc = build_scenario("azure-code", LLAMA, H100, cluster, load=0.8, minutes=30)
    loads = minute_loads(sc.workload, sc.table, cluster)
    assert float(np.quantile(loads[:-1], 0.9)) == pytest.approx(0.8, rel=0.1)
    assert loads.mean() < 0.7


@pytest.mark.skipif(not (SHARED_DATA / "traces" / "servegen_m-mid.csv").is_file(),
                    reason="ServeGen traces not in ../shared/data")
def test_servegen_scenario_reaches_the_load_and_shifts_its_mix():
    from oserve.sim.evaluate import minute_loads

    cluster = cluster_for_gpus(16)
    sc = build_scenario("servegen-m-mid", LLAMA, H100, cluster, load=0.6, minutes=30)
    assert sc.name == "servegen-m-mid" and len(sc.workload) > 1000
    loads = minute_loads(sc.workload, sc.table, cluster)
    assert float(np.quantile(loads[:-1], 0.9)) == pytest.approx(0.6, rel=0.1)
    w = sc.workload
    ten = ((w.arrival_s - w.arrival_s.min()) // 600).astype(int)
    shares = np.array([np.bincount(w.type_index[ten == t], minlength=4) / max((ten == t).sum(), 1)
                       for t in range(ten.max() + 1)])
    assert np.abs(np.diff(shares, axis=0)).max() > 0.05  # the mix moves between windows


def test_static_candidates_are_every_near_best_homogeneous_deployment(conv):
    from oserve.sim.evaluate import EvalConfig, compare, static_capacity_rps, mean_mix

    trace, types, table = conv
    cluster = cluster_for_gpus(16)
    w = from_trace(trace.slice_time(0, 120), types)
    ranked = static_capacity_rps(table, cluster, mean_mix(w, 4))
    near = [s for c, s in ranked if c >= 0.95 * ranked[0][0]]
    c = compare(LLAMA, H100, cluster, w, table, policies=("vllm-static",),
                config=EvalConfig(static_candidates=99, static_min_capacity_frac=0.95))
    assert list(c.static_tried) == [str(s) for s in near]
    best = min(c.static_tried.values())
    assert c.results["vllm-static"].percentile("e2e", 99) == best


def test_a_prompt_larger_than_any_kv_cache_is_dropped_with_a_reason(conv):
    _, _, table = conv
    cluster = cluster_for_gpus(8)
    ctx = PlanningContext(LLAMA, cluster, table, initial_rps=np.ones(4))
    dep = homogeneous_deployment(ctx, ReplicaShape(2))
    arrival = np.array([0.0, 0.5, 1.0])
    inp = np.array([100, 10_000_000, 200])
    res = simulate(LLAMA, H100, cluster, arrival, inp, np.array([10, 10, 10]), np.zeros(3, dtype=int), 4,
                   StaticPolicy(ctx, dep))
    assert res.dropped.tolist() == [False, True, False]
    assert res.summary()["drop_reasons"] == {"rejected": 1}


def test_switch_rule_weighs_gain_against_cost():
    from oserve.sim.policies import _should_switch

    # demand 20 rps, 15 served now, 20 after: gain 25% of demand; cost: 10 rps lost for 8 s of a 60 s span
    assert _should_switch(15.0, 1.0, 20.0, 0.9, lost_capacity_rps=10.0, switch_s=8.0, span_s=60.0, demand=20.0)
    # the same gain does not pay for a 60 s reload of 20 rps of capacity
    assert not _should_switch(15.0, 1.0, 20.0, 0.9, lost_capacity_rps=20.0, switch_s=60.0, span_s=60.0, demand=20.0)
    # both serve everything: only a clear headroom gain switches
    assert _should_switch(20.0, 0.9, 20.0, 0.6, lost_capacity_rps=5.0, switch_s=8.0, span_s=60.0, demand=20.0)
    assert not _should_switch(20.0, 0.9, 20.0, 0.88, lost_capacity_rps=5.0, switch_s=8.0, span_s=60.0, demand=20.0)
    assert not _should_switch(0.0, 0.0, 0.0, 0.0, lost_capacity_rps=0.0, switch_s=0.0, span_s=60.0, demand=0.0)


@given(n=st.lists(st.floats(0.1, 50.0), min_size=4, max_size=4),
       rates=st.lists(st.floats(0.0, 30.0), min_size=4, max_size=4).filter(lambda r: sum(r) > 0.1))
def test_mix_capacity_is_the_harmonic_rate(n, rates):
    from oserve.sim.policies import mix_capacity_rps

    p = np.array(rates) / sum(rates)
    cap = mix_capacity_rps(np.array(n), np.array(rates))
    # serving `cap` requests/s of this mix uses the replica exactly once over
    assert float(np.sum(cap * p / np.array(n))) == pytest.approx(1.0)
    assert min(n[j] for j in range(4) if p[j] > 0) <= cap * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.floats(0.5, 30.0), min_size=3, max_size=3), min_size=1, max_size=3),
       copies=st.lists(st.integers(1, 3), min_size=3, max_size=3),
       rates=st.lists(st.floats(0.0, 40.0), min_size=3, max_size=3))
def test_even_assignment_is_exact_and_treats_identical_replicas_alike(rows, copies, rates):
    """Reference: the per-replica LP. The grouped solve serves exactly as much, meets C1-C3, and gives
    identical replicas identical rows."""
    from oserve.scheduler import assign, violations
    from oserve.sim.policies import assign_even

    n = np.array([row for row, c in zip(rows, copies) for _ in range(c)])
    even = assign_even(np.array(rates), n)
    ref = assign(np.array(rates), n)
    assert even.served_rps == pytest.approx(ref.served_rps, rel=1e-6, abs=1e-9)
    assert violations(even, rel_tol=1e-7) == []
    x = np.array(even.rates_rps)
    for i in range(len(n)):
        for k in range(len(n)):
            if np.array_equal(n[i], n[k]):
                assert np.allclose(x[i], x[k])
