"""The exhaustive search over fixed deployments (`oserve.evaluation.ceiling`)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.evaluation.ceiling import (FixedDeploymentPolicy, deployment_multisets, fixed_deployment_outcomes,
                                      mean_class_rates)
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
