"""Upper level of the scheduler: one contract for every deployment search, and the searches against each
other and against a brute force, on synthetic capacities."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError, InfeasibleError, UnknownNameError
from oserve.scheduler import SEARCHES, Plan, PlanningProblem, SearchConfig, assign, can_pack, place, search, \
    search_problem, violations
from oserve.scheduler.packing import node_patterns
from oserve.scheduler.problem import dominates
from oserve.specs import (ClusterSpec, Deployment, ReplicaShape, cluster_for_gpus, gpu_preset, model_preset,
                          shape_problems, valid_shapes)

LLAMA70 = model_preset("llama2-70b")
OPT30 = model_preset("opt-30b")
TYPES = ("SISO", "SILO", "LISO", "LILO")


def synthetic_capacity(seed: int):
    """n(shape, type) > 0: grows with the GPU count at a random per-type exponent, with per-shape noise
    so that neither the largest nor the smallest shapes always win."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(1.0, 20.0, len(TYPES))
    exponent = rng.uniform(0.6, 1.5, len(TYPES))
    table: dict = {}

    def rate(shape: ReplicaShape, j: int) -> float:
        key = (shape, j)
        if key not in table:
            noise = rng.uniform(0.7, 1.3)
            pp_cost = 1.0 / (1.0 + rng.uniform(0.0, 0.15) * (shape.pp - 1))
            table[key] = float(base[j] * shape.num_gpus ** exponent[j] * noise * pp_cost)
        return table[key]

    return rate


def rates_for(seed: int, gpus: int) -> tuple[float, ...]:
    rng = np.random.default_rng(seed + 1000)
    # From well under to well over what the cluster serves; some types absent.
    scale = rng.choice([0.3, 1.0, 3.0, 10.0])
    return tuple(float(v) for v in rng.uniform(0, 20, len(TYPES)) * (rng.uniform(size=len(TYPES)) > 0.15)
                 * scale * gpus / 8)


def problem_for(seed: int, gpus: int = 8, model=LLAMA70, shapes=None) -> PlanningProblem:
    return PlanningProblem.build(model, cluster_for_gpus(gpus), rates_for(seed, gpus), synthetic_capacity(seed),
                                 type_names=TYPES, shapes=shapes)


def assert_valid_plan(plan: Plan, problem: PlanningProblem, model=LLAMA70) -> None:
    cluster = problem.cluster
    dep = plan.deployment
    assert dep.num_gpus <= cluster.num_gpus
    used = [g for r in dep.replicas for g in r.gpu_ids]
    assert len(used) == len(set(used)), "a GPU is used twice"
    for r in dep.replicas:
        assert shape_problems(model, cluster.gpu, r.shape, cluster.gpus_per_node) == [], r.shape  # fits in memory
        assert r.placement_problems(cluster) == [], r
        for s in range(r.shape.pp):
            assert len({cluster.node_of(g) for g in r.stage_gpus(s)}) == 1  # TP group inside one node
    a = plan.assignment
    assert a.replica_ids == tuple(r.replica_id for r in dep.replicas)
    assert violations(a, rel_tol=1e-9) == []
    for r, row in zip(dep.replicas, a.capacity_rps):
        assert row == tuple(problem.capacity_rps[problem.shapes.index(r.shape)])
    assert plan.throughput_rps == pytest.approx(a.served_rps)
    assert plan.peak_utilisation == pytest.approx(a.peak_utilisation)
    assert plan.demand_rps == pytest.approx(sum(problem.demand_rps))
    assert plan.solve_s >= 0
    # The plan's assignment is as good as the per-replica LP on its deployment (independent of the
    # shape-aggregated evaluation the searches use).
    direct = assign(problem.demand_rps, a.capacity_rps, replica_ids=a.replica_ids, type_names=a.type_names)
    assert plan.throughput_rps == pytest.approx(direct.served_rps, rel=1e-6, abs=1e-9)
    if direct.served_rps > 0:
        assert plan.peak_utilisation == pytest.approx(direct.peak_utilisation, abs=1e-5)


def no_worse(a: Plan, b: Plan, rel: float = 1e-7) -> bool:
    """Whether a is at least as good as b: throughput, then peak utilisation on a tie."""
    scale = max(1.0, b.throughput_rps)
    if a.throughput_rps > b.throughput_rps + rel * scale:
        return True
    if a.throughput_rps < b.throughput_rps - rel * scale:
        return False
    return a.peak_utilisation <= b.peak_utilisation + 1e-6


# --- the contract every search keeps ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SEARCHES)
@settings(max_examples=6)
@given(seed=st.integers(0, 10_000))
def test_every_search_returns_a_valid_plan(name: str, seed: int) -> None:
    problem = problem_for(seed, 8)
    plan = search_problem(name, problem)
    assert plan.search == name
    assert_valid_plan(plan, problem)


@pytest.mark.parametrize("name", SEARCHES)
def test_every_search_on_two_nodes(name: str) -> None:
    problem = problem_for(7, 16)
    plan = search_problem(name, problem)
    assert_valid_plan(plan, problem)
    assert plan.deployment.replicas  # something is deployed


@pytest.mark.parametrize("name", SEARCHES)
def test_every_search_with_tp7_shapes(name: str) -> None:
    """OPT-30B allows TP7: stage sizes 1, 2, 4, 7, 8 are no divisibility chain, so packing is exact
    bin packing; a capacity favouring TP7 makes the searches use it."""
    def rate(shape: ReplicaShape, j: int) -> float:
        return (40.0 if shape.tp == 7 else 3.0) * shape.num_gpus * (1 + j)

    problem = PlanningProblem.build(OPT30, cluster_for_gpus(16), (50.0, 80.0, 30.0, 20.0), rate, type_names=TYPES)
    plan = search_problem(name, problem)
    assert_valid_plan(plan, problem, OPT30)
    assert sum(r.shape.tp == 7 for r in plan.deployment.replicas) == 2  # one TP7 per node


@pytest.mark.parametrize("name", SEARCHES)
def test_zero_demand_still_deploys(name: str) -> None:
    problem = PlanningProblem.build(LLAMA70, cluster_for_gpus(8), (0.0, 0.0, 0.0, 0.0), synthetic_capacity(1),
                                    type_names=TYPES)
    plan = search_problem(name, problem)
    assert plan.throughput_rps == 0.0 and plan.peak_utilisation == 0.0
    assert plan.deployment.num_gpus >= 7  # the cluster is filled: no valid shape fits what is left


@pytest.mark.parametrize("name", SEARCHES)
def test_same_input_same_plan(name: str) -> None:
    first = search_problem(name, problem_for(3, 8))
    second = search_problem(name, problem_for(3, 8))
    assert first.deployment == second.deployment
    assert first.assignment == second.assignment


# --- the searches against each other ------------------------------------------------------------------------------


@settings(max_examples=12)
@given(seed=st.integers(0, 10_000))
def test_exhaustive_is_at_least_every_other_search_and_milp_matches_it(seed: int) -> None:
    problem = problem_for(seed, 8)
    ex = search_problem("exhaustive", problem)
    milp = search_problem("milp", problem)
    paper = search_problem("paper", problem)
    assert no_worse(ex, milp) and no_worse(ex, paper)
    assert milp.throughput_rps >= 0.999 * ex.throughput_rps
    # In fact the MILP is exact, tie-break included.
    assert milp.throughput_rps == pytest.approx(ex.throughput_rps, rel=1e-6)
    assert no_worse(milp, ex, rel=1e-6)


def test_milp_matches_exhaustive_on_two_nodes() -> None:
    for seed in (11, 12):
        problem = problem_for(seed, 16)
        ex = search_problem("exhaustive", problem)
        milp = search_problem("milp", problem)
        assert milp.throughput_rps == pytest.approx(ex.throughput_rps, rel=1e-6)
        assert no_worse(milp, ex, rel=1e-6) and no_worse(ex, milp, rel=1e-6)


def brute_force(problem: PlanningProblem) -> tuple[float, float]:
    """Best (throughput, peak) over every multiset of shapes that packs, each assigned by the per-replica
    LP, with no pruning at all."""
    best = (-1.0, math.inf)
    shapes = problem.shapes
    g = problem.cluster.num_gpus

    def rec(i: int, left: int, chosen: list[int]) -> None:
        nonlocal best
        if i == len(shapes):
            if not chosen:
                return
            counts = np.bincount(chosen, minlength=len(shapes))
            if not problem.packs(counts):
                return
            a = assign(problem.demand_rps, [problem.capacity_rps[s] for s in chosen])
            t, p = a.served_rps, a.peak_utilisation
            if t > best[0] * (1 + 1e-9) + 1e-12 or (t >= best[0] * (1 - 1e-9) and p < best[1] - 1e-9):
                best = (t, p)
            return
        for c in range(left // shapes[i].num_gpus + 1):
            rec(i + 1, left - c * shapes[i].num_gpus, chosen + [i] * c)

    rec(0, g, [])
    return best


@settings(max_examples=4)
@given(seed=st.integers(0, 10_000))
def test_exhaustive_equals_brute_force(seed: int) -> None:
    """The exhaustive search's pruning (maximal multisets, dominated shapes, dual bounds) loses nothing."""
    shapes = tuple(s for s in valid_shapes(LLAMA70, gpu_preset("h100"), 8, 8) if s.pp <= 2)
    problem = problem_for(seed, 8, shapes=shapes)
    ex = search_problem("exhaustive", problem)
    t, p = brute_force(problem)
    assert ex.throughput_rps == pytest.approx(t, rel=1e-6, abs=1e-9)
    if t > 0:
        assert ex.peak_utilisation <= p + 1e-6


def test_mixed_demand_gets_a_heterogeneous_deployment() -> None:
    # Shape A is four times better at type 0, shape B four times better at type 1, each per GPU.
    def rate(shape: ReplicaShape, j: int) -> float:
        good = (shape == ReplicaShape(2, 1) and j == 0) or (shape == ReplicaShape(4, 1) and j == 1)
        return shape.num_gpus * (4.0 if good else 1.0)

    shapes = (ReplicaShape(2, 1), ReplicaShape(4, 1))
    problem = PlanningProblem.build(LLAMA70, cluster_for_gpus(16), (16.0, 32.0), rate, type_names=("a", "b"),
                                    shapes=shapes)
    for name in SEARCHES:
        plan = search_problem(name, problem)
        assert {r.shape for r in plan.deployment.replicas} == set(shapes), name
        assert plan.throughput_rps == pytest.approx(48.0)


def test_peak_utilisation_breaks_throughput_ties() -> None:
    # Light demand: every deployment serves it all; the searches must still spread it thinly.
    problem = problem_for(5, 8)
    light = PlanningProblem(problem.cluster, problem.shapes, problem.type_names, (0.5, 0.5, 0.5, 0.5),
                            problem.capacity_rps)
    plans = {name: search_problem(name, light) for name in SEARCHES}
    for plan in plans.values():
        assert plan.throughput_rps == pytest.approx(2.0)
    assert plans["milp"].peak_utilisation == pytest.approx(plans["exhaustive"].peak_utilisation, abs=1e-7)
    assert plans["exhaustive"].peak_utilisation <= plans["paper"].peak_utilisation + 1e-9


def test_paper_search_honours_its_iteration_budget() -> None:
    problem = problem_for(9, 16)
    one = search_problem("paper", problem, config=SearchConfig(paper_max_iterations=1))
    full = search_problem("paper", problem)
    assert_valid_plan(one, problem)
    assert no_worse(full, one)


def test_search_timer_is_used() -> None:
    ticks = iter([10.0, 12.5])
    plan = search("milp", LLAMA70, cluster_for_gpus(8), dict(zip(TYPES, (1.0, 2.0, 3.0, 4.0))),
                  synthetic_capacity(0), timer=lambda: next(ticks))
    assert plan.solve_s == 2.5


# --- inputs the searches refuse -----------------------------------------------------------------------------------


def test_bad_inputs() -> None:
    cap = synthetic_capacity(0)
    rates = dict(zip(TYPES, (1.0, 2.0, 3.0, 4.0)))
    with pytest.raises(UnknownNameError, match="unknown search 'greedy'"):
        search("greedy", LLAMA70, cluster_for_gpus(8), rates, cap)
    with pytest.raises(ConfigError, match="exhaustive search is limited to 16 GPUs"):
        search("exhaustive", LLAMA70, cluster_for_gpus(32), rates, cap)
    with pytest.raises(InfeasibleError, match="fits on no replica"):
        search("milp", LLAMA70, cluster_for_gpus(1), rates, cap)
    with pytest.raises(ConfigError, match="must be finite and >= 0"):
        search("milp", LLAMA70, cluster_for_gpus(8), {**rates, "SISO": -1.0}, cap)
    with pytest.raises(UnknownNameError, match="unknown workload type 'XX'"):
        search("milp", LLAMA70, cluster_for_gpus(8), {**rates, "XX": 1.0}, cap, type_names=TYPES)
    with pytest.raises(ConfigError, match="no rate given for workload type"):
        search("milp", LLAMA70, cluster_for_gpus(8), {"SISO": 1.0}, cap, type_names=TYPES)
    with pytest.raises(ConfigError, match="capacity must be > 0"):
        search("milp", LLAMA70, cluster_for_gpus(8), rates, lambda s, j: 0.0)
    with pytest.raises(ConfigError):
        SearchConfig(paper_patience=0)


def test_plan_empty() -> None:
    plan = Plan.empty()
    assert plan.deployment == Deployment.empty() and plan.throughput_rps == 0.0 and plan.served_frac == 1.0


# --- packing and placement ----------------------------------------------------------------------------------------


def brute_pack(items: list[int], num_nodes: int, size: int) -> bool:
    free = [size] * num_nodes

    def rec(i: int) -> bool:
        if i == len(items):
            return True
        tried = set()
        for b in range(num_nodes):
            if free[b] >= items[i] and free[b] not in tried:
                tried.add(free[b])
                free[b] -= items[i]
                if rec(i + 1):
                    return True
                free[b] += items[i]
        return False

    return rec(0)


@settings(max_examples=60)
@given(st.dictionaries(st.sampled_from([1, 2, 3, 4, 7, 8]), st.integers(0, 5), max_size=4), st.integers(1, 3))
def test_can_pack_is_exact(stages: dict[int, int], num_nodes: int) -> None:
    items = sorted((t for t, c in stages.items() for _ in range(c)), reverse=True)
    assert can_pack(stages, num_nodes, 8) == brute_pack(items, num_nodes, 8)


@settings(max_examples=40)
@given(st.lists(st.sampled_from([ReplicaShape(1, 1), ReplicaShape(2, 1), ReplicaShape(4, 1), ReplicaShape(7, 1),
                                 ReplicaShape(8, 1), ReplicaShape(1, 3), ReplicaShape(2, 2), ReplicaShape(7, 2),
                                 ReplicaShape(4, 3)]), max_size=8), st.integers(1, 3))
def test_place_keeps_tp_groups_inside_nodes(shapes: list[ReplicaShape], num_nodes: int) -> None:
    cluster = ClusterSpec("c", num_nodes, 8, gpu_preset("h100"), 400e9, 200e9)
    stages: dict[int, int] = {}
    for s in shapes:
        stages[s.tp] = stages.get(s.tp, 0) + s.pp
    if not can_pack(stages, num_nodes, 8):
        with pytest.raises(InfeasibleError):
            place(shapes, cluster)
        return
    dep = place(shapes, cluster)
    assert sorted(r.shape for r in dep.replicas) == sorted(shapes)
    assert [r.replica_id for r in dep.replicas] == [f"r{i}" for i in range(len(shapes))]
    for r in dep.replicas:
        assert r.placement_problems(cluster) == []


def test_node_patterns_are_maximal() -> None:
    patterns = node_patterns([1, 2, 4, 8], 8)
    assert (0, 0, 0, 1) in patterns and (0, 0, 2, 0) in patterns and (8, 0, 0, 0) in patterns
    for p in patterns:
        used = p[0] * 1 + p[1] * 2 + p[2] * 4 + p[3] * 8
        assert used == 8  # with a 1-GPU size, maximal means full
    assert node_patterns([7], 8) == ((1,),)


def test_dominance() -> None:
    small, big = ReplicaShape(2, 1), ReplicaShape(4, 1)
    assert dominates(small, np.array([3.0, 3.0]), big, np.array([6.0, 5.0]))  # two smalls carry one big
    assert not dominates(small, np.array([3.0, 2.0]), big, np.array([6.0, 5.0]))
    assert not dominates(ReplicaShape(4, 1), np.array([9.0]), ReplicaShape(2, 2), np.array([1.0]))  # 4 does not divide 2
    assert not dominates(big, np.array([100.0]), small, np.array([1.0]))  # more GPUs


# --- phase three: fewest replicas within a headroom slack -------------------------------------------------------


def brute_force_fewest(problem: PlanningProblem, floor_alpha: float) -> tuple[int, float] | None:
    """Fewest replicas over every multiset that packs and serves all demand with alpha >= floor_alpha
    (peak utilisation <= 1 / floor_alpha), by the per-replica LP, and the least peak utilisation among
    multisets of that many replicas; None when none does."""
    shapes = problem.shapes
    best: tuple[int, float] | None = None

    def rec(i: int, left: int, chosen: list[int]) -> None:
        nonlocal best
        if best is not None and len(chosen) > best[0]:
            return
        if i == len(shapes):
            if not chosen or not problem.packs(np.bincount(chosen, minlength=len(shapes))):
                return
            a = assign(problem.demand_rps, [problem.capacity_rps[s] for s in chosen])
            if a.served_rps >= sum(problem.demand_rps) * (1 - 1e-7) and a.peak_utilisation <= (1 + 1e-6) / floor_alpha:
                key = (len(chosen), a.peak_utilisation)
                if best is None or key < best:
                    best = key
            return
        for c in range(left // shapes[i].num_gpus + 1):
            rec(i + 1, left - c * shapes[i].num_gpus, chosen + [i] * c)

    rec(0, problem.cluster.num_gpus, [])
    return best


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000), slack=st.sampled_from([0.02, 0.1, 0.3]))
def test_fewer_replicas_phase_is_the_fewest_within_the_slack(seed: int, slack: float) -> None:
    """Phase three keeps alpha within the slack of the exact optimum and uses the fewest replicas that
    do, with the most headroom among those (checked against brute force); the completed plan is still
    valid and serves all demand."""
    from oserve.scheduler.problem import Evaluator
    from oserve.scheduler.search import _milp_counts

    shapes = tuple(s for s in valid_shapes(LLAMA70, gpu_preset("h100"), 8, 8) if s.pp <= 2)
    base = problem_for(seed, 8, shapes=shapes)
    exact = search_problem("milp", base)
    light = PlanningProblem(base.cluster, base.shapes, base.type_names,
                            tuple(r * 0.3 * exact.served_frac for r in base.demand_rps), base.capacity_rps)
    exact = search_problem("milp", light)
    if exact.served_frac < 1 - 1e-7 or exact.throughput_rps == 0:
        return
    alpha_star = 1.0 / exact.peak_utilisation
    config = SearchConfig(fewer_replicas_slack=slack)
    counts = _milp_counts(light, config, Evaluator(light))
    ev = light.evaluate(counts)
    assert ev.throughput_rps == pytest.approx(exact.throughput_rps, rel=1e-6)
    assert ev.peak_utilisation <= (1 + 1e-5) / (alpha_star * (1 - slack))
    fewest = brute_force_fewest(light, max(1.0, alpha_star * (1 - slack)))
    assert fewest is not None and int(counts.sum()) == fewest[0]
    assert ev.peak_utilisation <= fewest[1] + 1e-5  # the most headroom among the fewest
    plan = search_problem("milp", light, config=config)
    assert_valid_plan(plan, light)
    assert plan.served_frac == pytest.approx(1.0)


def test_fewer_replicas_slack_is_validated() -> None:
    with pytest.raises(ConfigError, match="fewer_replicas_slack"):
        SearchConfig(fewer_replicas_slack=1.0)
