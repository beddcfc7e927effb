"""The exhaustive search over fixed deployments (`oserve.evaluation.ceiling`)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.evaluation.ceiling import (FixedDeploymentPolicy, best_schedule, deployment_multisets,
                                      fixed_deployment_outcomes, switching_ceiling, window_slices,
                                      mean_class_rates)
from oserve.errors import ConfigError
from oserve.evaluation.scenarios import build_scenario
from oserve.planner.candidates import assign_even, weights_for
from oserve.planner.prior import fit_prior
from oserve.scheduler.packing import place
from oserve.sim.kernel import simulate
from oserve.specs import ReplicaShape, cluster_for_gpus, model_preset

SHAPES = [ReplicaShape(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)]


def _reference(shapes: list[ReplicaShape], num_gpus: int, max_replicas: int) -> Counter:
    """Every vector of replica counts per shape (brute force over all counts), as multisets."""
    found: Counter = Counter()
    for counts in itertools.product(range(max_replicas + 1), repeat=len(shapes)):
        if 1 <= sum(counts) <= max_replicas and sum(c * s.num_gpus for c, s in zip(counts, shapes)) == num_gpus:
            found[tuple(sorted((s.tp, s.pp, c) for s, c in zip(shapes, counts) if c))] += 1
    return found


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5, unique=True), st.integers(1, 16),
       st.integers(1, 4))
def test_multisets_are_exactly_the_brute_force_ones(shapes, num_gpus, max_replicas) -> None:
    got = deployment_multisets(shapes, num_gpus, max_replicas)
    for combo in got:
        assert sum(s.num_gpus for s in combo) == num_gpus and 1 <= len(combo) <= max_replicas
    as_counts = Counter(tuple(sorted((s.tp, s.pp, c) for s, c in Counter(combo).items())) for combo in got)
    assert as_counts == _reference(shapes, num_gpus, max_replicas)  # each once, none missing


def test_every_fixed_deployment_is_simulated_and_ranked() -> None:
    model = model_preset("llama2-70b")
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S1", model, cluster, minutes=1, history_minutes=2)
    prior = fit_prior(scenario.history, model, cluster, duration_s=scenario.history_s)
    outcomes = fixed_deployment_outcomes(model, cluster, scenario.window, prior, max_replicas=2)
    keys = [o.key() for o in outcomes]
    assert keys == sorted(keys)
    expected = {tuple(sorted(map(str, c))) for c in
                deployment_multisets(prior.table.shapes(8), 8, 2)}
    assert {tuple(sorted(map(str, o.shapes))) for o in outcomes} == expected  # every one packs on one node
    assert all(np.isfinite(o.p99_e2e_s) and o.p99_e2e_s > 0 for o in outcomes)
    # the best one, simulated again on its own, gives the same figure (deterministic)
    best = outcomes[0]
    dep = place(list(best.shapes), cluster)
    n = prior.table.matrix(dep.shapes())
    weights = weights_for(assign_even(mean_class_rates(prior, scenario.window), n), n)
    res = simulate(model, cluster.gpu, cluster, scenario.window, FixedDeploymentPolicy(prior, dep, weights))
    assert res.percentile("e2e", 99) == best.p99_e2e_s and int(res.dropped.sum()) == best.dropped


def _sorted_p99(values: np.ndarray) -> float:
    """The reference percentile, by sorting: linear interpolation between order statistics; with any unfinished
    (inf) request, the 'higher' order statistic."""
    v = np.sort(np.asarray(values, dtype=float))
    pos = 0.99 * (len(v) - 1)
    lo, hi = int(np.floor(pos)), int(np.ceil(pos))
    if np.isinf(v).any():
        return float(v[hi])
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


latency = st.one_of(st.floats(0.01, 100.0), st.just(float("inf")))


@st.composite
def slice_latencies(draw):
    """latencies[deployment][slice]: each slice the same requests (the same count) under every deployment."""
    num_deps, num_slices = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 40)) for _ in range(num_slices)]
    return [[np.array(draw(st.lists(latency, min_size=n, max_size=n))) for n in sizes] for _ in range(num_deps)]


@settings(max_examples=80, deadline=None)
@given(slice_latencies())
def test_the_best_schedule_is_the_brute_force_one(latencies) -> None:
    num_deps, num_slices = len(latencies), len(latencies[0])
    values = {c: _sorted_p99(np.concatenate([latencies[d][s] for s, d in enumerate(c)]))
              for c in itertools.product(range(num_deps), repeat=num_slices)}
    choice, p99 = best_schedule(latencies)
    assert p99 == pytest.approx(min(values.values()), rel=1e-12) or p99 == min(values.values()) == np.inf
    assert p99 == pytest.approx(values[choice], rel=1e-12) or p99 == values[choice] == np.inf


@settings(max_examples=80, deadline=None)
@given(slice_latencies())
def test_the_local_search_is_never_worse_than_one_deployment_throughout(latencies) -> None:
    num_deps, num_slices = len(latencies), len(latencies[0])
    exhaustive = best_schedule(latencies)[1]
    choice, p99 = best_schedule(latencies, max_exhaustive=0)
    assert len(choice) == num_slices and all(0 <= d < num_deps for d in choice)
    assert p99 >= exhaustive or p99 == pytest.approx(exhaustive, rel=1e-12)
    for d in range(num_deps):  # every constant schedule is a start: the search only improves on it
        constant = _sorted_p99(np.concatenate(latencies[d]))
        assert p99 <= constant or p99 == pytest.approx(constant, rel=1e-12)


def test_a_deployment_faster_on_every_request_is_chosen_for_every_slice() -> None:
    rng = np.random.default_rng(3)
    slow = [rng.uniform(1, 50, size=n) for n in (30, 5, 60)]
    fast = [x * 0.5 for x in slow]
    assert best_schedule([slow, fast])[0] == (1, 1, 1)
    assert best_schedule([slow, fast], max_exhaustive=0)[0] == (1, 1, 1)
    with pytest.raises(ConfigError):
        best_schedule([slow, fast[:2]])


def test_the_switching_ceiling_simulates_every_deployment_on_every_slice() -> None:
    model = model_preset("llama2-70b")
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("T1", model, cluster, minutes=1.5, history_minutes=2)
    prior = fit_prior(scenario.history, model, cluster, duration_s=scenario.history_s)
    sc = switching_ceiling(model, cluster, scenario.window, prior, 30.0, max_replicas=1)
    slices = [p for p in window_slices(scenario.window, 30.0) if len(p)]
    assert sum(len(p) for p in slices) == len(scenario.window) and len(slices) == 3
    assert len(sc.labels) == len(slices) and set(sc.labels) <= set(sc.deployment_labels)
    assert len(sc.deployment_labels) == len(sc.slice_p99_e2e_s) >= 2
    assert 0 < sc.p99_e2e_s <= sc.constant_p99_e2e_s and sc.gain >= 1.0
    # a slice's figure is that slice simulated alone with the deployment, routed for the slice's own rates
    label = sc.labels[1]
    shapes = [ReplicaShape(*map(int, part.replace("TP", "").split("xPP"))) if "xPP" in part else
              ReplicaShape(int(part.replace("TP", ""))) for part in label.split(" + ")]
    dep = place(shapes, cluster)
    n = prior.table.matrix(dep.shapes())
    weights = weights_for(assign_even(mean_class_rates(prior, slices[1]), n), n)
    res = simulate(model, cluster.gpu, cluster, slices[1], FixedDeploymentPolicy(prior, dep, weights))
    assert res.percentile("e2e", 99) == sc.slice_p99_e2e_s[sc.deployment_labels.index(label)][1]
