"""The digital twin that scores candidate deployments, and what the kernel shows policies of past spans."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.capacity import CapacityTable
from oserve.scheduler import assign
from oserve.sim.ceiling import deployment_multisets
from oserve.sim.cluster import Decision, SpanView, simulate
from oserve.sim.policies import (OServePolicy, PlanningContext, assign_even, homogeneous_deployment,
                                 least_loaded_among, weights_for)
from oserve.sim.twin import DigitalTwin, TwinConfig, local_search, neighbours
from oserve.sim.workloads import from_trace, scale_volume
from oserve.specs import GPUS, Deployment, ReplicaShape, cluster_for_gpus, model_preset
from oserve.workload import fit_types, load_trace

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")


@pytest.fixture(scope="module")
def conv():
    trace = load_trace("azure-conv")
    types = fit_types(trace.input_tokens, trace.output_tokens)
    return trace, types, CapacityTable(LLAMA, H100, types)


def _twin(types, cluster, **kw) -> DigitalTwin:
    return DigitalTwin(LLAMA, H100, cluster, types, TwinConfig(**kw))


def test_score_is_the_simulated_tail_of_the_synthetic_span(conv):
    """Reference: simulate the twin's own workload directly with the same routing; the score is the
    mean of the slowest 2% after the warm-up, bit for bit."""
    _, types, table = conv
    cluster = cluster_for_gpus(16)
    twin = _twin(types, cluster)
    rates = np.array([4.0, 3.0, 2.0, 5.0])
    dep = homogeneous_deployment(cluster, ReplicaShape(4))
    n = table.matrix(dep.shapes())
    weights = weights_for(assign(rates, n), n)
    arrival, inp, out, kind, warm = twin.workload(rates)

    class Fixed:
        name = "ref"

        def decide(self, view):
            return Decision(dep, weights, 0.0, (), "ref") if view.current is None else None

        def route(self, req, replicas):
            return least_loaded_among(replicas, weights[req.type_index])

    res = simulate(LLAMA, H100, cluster, arrival, inp, out, kind, 4, Fixed(), twin.config.sim)
    e2e = np.sort(res.e2e_s[res.arrival_s >= warm])
    assert twin.score(dep, weights, rates, least_loaded_among) == float(e2e[int(len(e2e) * 0.98):].mean())
    assert twin.score(dep, weights, rates, least_loaded_among) == twin.score(dep, weights, rates, least_loaded_among)


def test_a_smaller_deployment_scores_worse_under_load(conv):
    _, types, table = conv
    cluster = cluster_for_gpus(16)
    twin = _twin(types, cluster, horizon_s=120.0, warmup_s=40.0)
    rates = np.array([6.0, 4.0, 3.0, 6.0])
    full = homogeneous_deployment(cluster, ReplicaShape(4))
    half = Deployment(full.replicas[:2])
    scores = []
    for dep in (full, half):
        n = table.matrix(dep.shapes())
        scores.append(twin.score(dep, weights_for(assign(rates, n), n), rates, least_loaded_among))
    assert scores[1] > 1.5 * scores[0]


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=4, max_size=4),
       forecast=st.lists(st.integers(0, 40), min_size=4, max_size=4).filter(lambda f: sum(f) > 0),
       seed=st.integers(0, 100))
def test_replayed_pattern_keeps_times_and_meets_the_forecast(conv, counts, forecast, seed):
    _, types, _ = conv
    twin = _twin(types, cluster_for_gpus(8), seed=seed)
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([rng.random(c) * 60.0 for c in counts])
    kinds = np.concatenate([np.full(c, j) for j, c in enumerate(counts)])
    rates = np.array(forecast, dtype=float) / 60.0
    arrival, inp, out, kind, warm = twin.workload(rates, (offsets, kinds) if len(offsets) >= 10 else None, 60.0)
    assert np.all(np.diff(arrival) >= 0) and np.all(inp >= 1) and np.all(out >= 1)
    if len(offsets) < 10:
        return  # Poisson mode
    assert warm == 60.0
    for j in range(4):
        mine = np.sort(arrival[kind == j])
        assert len(mine) == 2 * forecast[j]  # the span played twice at the forecast's count
        assert np.all((mine >= 0) & (mine <= 120.0))
        if forecast[j] == counts[j]:  # the observed times exactly, then again one span later
            first = np.sort(offsets[kinds == j])
            assert np.allclose(mine, np.sort(np.concatenate([first, first + 60.0])))


def test_kernel_shows_each_span_its_predecessor_arrivals(conv):
    trace, types, table = conv
    cluster = cluster_for_gpus(8)
    w = scale_volume(from_trace(trace.slice_time(0, 240), types), 2.0, np.random.default_rng(0))
    seen = []

    class Recorder:
        name = "recorder"

        def decide(self, view):
            seen.append((view.span_index, view.last_arrivals, view.true_next_arrivals, view.observed_counts.copy()))
            dep = homogeneous_deployment(cluster, ReplicaShape(4))
            return Decision(dep, tuple((1.0,) * len(dep.replicas) for _ in range(4))) if view.current is None else None

        def route(self, req, replicas):
            return None

    simulate(LLAMA, H100, cluster, w.arrival_s, w.input_tokens, w.output_tokens, w.type_index, 4, Recorder())
    assert seen[0][1] is None
    for i, last, nxt, observed in seen[1:]:
        offsets, kinds = last
        assert np.array_equal(np.bincount(kinds, minlength=4), observed[-1])
        assert np.all((offsets >= 0) & (offsets < 60.0 + 1e-9))
    total = sum(len(n[0]) for _, _, n, _ in seen if n is not None)
    assert total == len(w)


def test_oserve_deploys_the_candidate_the_twin_scores_best(conv):
    trace, types, table = conv
    cluster = cluster_for_gpus(16)
    w = scale_volume(from_trace(trace.slice_time(0, 120), types), 3.0, np.random.default_rng(1))
    ctx = PlanningContext(LLAMA, cluster, table, initial_rps=w.first_span_rps(60.0, 4))
    policy = OServePolicy(ctx, neighbour_steps=0)  # the candidates alone (the neighbour search: below)
    rates = np.asarray(ctx.initial_rps, dtype=float)
    candidates = policy._candidates(rates, Deployment.empty())
    assert len(candidates) >= 3
    scores = []
    for dep in candidates:  # as the policy scores its first decision: even weights, the long span
        n = table.matrix(dep.shapes())
        scores.append(policy.twin.score(dep, weights_for(assign_even(rates, n), n), rates, least_loaded_among,
                                        long=True))
    res = simulate(LLAMA, H100, cluster, w.arrival_s, w.input_tokens, w.output_tokens, w.type_index, 4, policy)
    chosen = sorted(str(d[1]) for d in res.spans[0]["deployment"])
    assert chosen == sorted(str(s) for s in candidates[int(np.argmin(scores))].shapes())
    assert not res.dropped.any()


def test_twin_config_is_validated():
    from oserve.errors import ConfigError

    with pytest.raises(ConfigError, match="warmup_s"):
        TwinConfig(horizon_s=10.0, warmup_s=20.0)
    with pytest.raises(ConfigError, match="max_num_requests"):
        TwinConfig(max_num_requests=3)


SHAPES = sorted({ReplicaShape(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)})
multisets = st.lists(st.sampled_from(SHAPES[:10]), min_size=1, max_size=3).map(lambda x: tuple(sorted(x)))


def _one_move(a: tuple, b: tuple) -> bool:
    """Reference: b is a from one replace (same GPUs), split or merge, by multiset difference."""
    gone, new = Counter(a) - Counter(b), Counter(b) - Counter(a)
    out, came = list(gone.elements()), list(new.elements())
    if sum(s.num_gpus for s in out) != sum(s.num_gpus for s in came):
        return False
    return (len(out), len(came)) in ((1, 1), (1, 2), (2, 1))


@settings(max_examples=40, deadline=None)
@given(multisets, st.lists(st.sampled_from(SHAPES), min_size=1, max_size=8, unique=True))
def test_neighbours_are_exactly_the_deployments_one_move_away(start, valid) -> None:
    valid = sorted(set(valid) | set(start))
    got = neighbours(start, valid)
    total = sum(s.num_gpus for s in start)
    # reference: every multiset of the valid shapes on as many GPUs with one replica more at most, filtered
    reference = {tuple(sorted(c)) for c in deployment_multisets(valid, total, len(start) + 1)}
    assert got == {c for c in reference if c != start and _one_move(start, c)}
    for nb in got:
        assert list(nb) == sorted(nb) and start in neighbours(nb, valid)  # symmetric: a split undoes a merge


@settings(max_examples=40, deadline=None)
@given(multisets, st.integers(0, 2**31), st.sampled_from([0.0, 0.05]))
def test_local_search_stops_at_a_local_minimum_and_scores_each_deployment_once(start, seed, min_gain) -> None:
    calls: dict[tuple, int] = {}

    def score(ms: tuple) -> float | None:
        calls[ms] = calls.get(ms, 0) + 1
        h = hash((ms, seed)) % 1000
        return None if h < 100 else float(h)  # some deployments are not allowed

    start_score = 500.0
    reached, value = local_search(start, start_score, SHAPES, score, max_steps=50, min_gain=min_gain)
    assert max(calls.values(), default=1) == 1 and value <= start_score
    if reached != start:
        assert value == score(reached)
    # no neighbour is better enough (the start keeps the score it was given; it is never rescored)
    allowed = [start_score if nb == start else score(nb) for nb in neighbours(reached, SHAPES)]
    assert all(v is None or v >= value * (1 - min_gain) for v in allowed)


def test_first_deployment_search_beats_the_candidates_without_giving_up_headroom():
    """The S5-like short-heavy mix: the candidates' best is not the twin's best deployment one move away."""
    from oserve.sim.evaluate import build_scenario

    cluster = cluster_for_gpus(16)
    scenario = build_scenario("S5", LLAMA, H100, cluster, minutes=2)
    ctx = PlanningContext(LLAMA, cluster, scenario.table, initial_rps=scenario.workload.first_span_rps(60.0, 4))
    view = SpanView(0, 0.0, 60.0, np.zeros((0, 4)), None, None)
    quick = TwinConfig(initial_horizon_s=240.0)  # a shorter first span than the default 600 s, for speed
    plain = OServePolicy(ctx, twin=quick, neighbour_steps=0).decide(view)
    policy = OServePolicy(ctx, twin=quick)
    searched = policy.decide(view)
    rates = np.asarray(ctx.initial_rps, dtype=float)

    def score_and_util(dep):
        n = scenario.table.matrix(dep.shapes())
        a = assign_even(rates, n)
        return policy.twin.score(dep, weights_for(a, n), rates, least_loaded_among, long=True), a.peak_utilisation

    s_plain, u_plain = score_and_util(plain.deployment)
    s_searched, u_searched = score_and_util(searched.deployment)
    assert sorted(searched.deployment.shapes()) != sorted(plain.deployment.shapes())
    assert s_searched < 0.9 * s_plain and u_searched <= 1.05 * u_plain


def test_every_scoring_searches_neighbours_and_a_steady_mix_is_not_rescored(monkeypatch):
    """The neighbour search runs at the first decision and again whenever the candidates are rescored."""
    import oserve.sim.policies as policies
    from oserve.sim.evaluate import build_scenario

    calls = []
    real = policies.local_search
    monkeypatch.setattr(policies, "local_search", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S1", LLAMA, H100, cluster, minutes=1)
    w = scenario.workload
    ctx = PlanningContext(LLAMA, cluster, scenario.table, initial_rps=w.first_span_rps(60.0, 4))
    policy = OServePolicy(ctx, twin=TwinConfig(initial_horizon_s=120.0))
    first = policy.decide(SpanView(0, 0.0, 60.0, np.zeros((0, 4)), None, None))
    assert len(calls) == 1
    counts = np.asarray(ctx.initial_rps) * 60.0
    steady = SpanView(1, 60.0, 60.0, counts[None, :], None, first)
    assert policy.decide(steady).label == "reroute" and len(calls) == 1  # same mix: no rescoring
    shifted = counts[::-1].copy()  # the mix turned around: rescored, and searched again
    policy.decide(SpanView(2, 120.0, 60.0, np.stack([counts, shifted]), None, first))
    assert len(calls) == 2
