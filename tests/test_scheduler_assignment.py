"""Lower level of the scheduler: the assignment meets C1-C3, is optimal, and matches the flow network."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from oserve.errors import ConfigError
from oserve.scheduler import Assignment, assign, flow_network, max_flow_value, normalisation, violations, with_flow
from oserve.scheduler.flownet import SINK, SOURCE, saturated_replicas, unit_gains


@st.composite
def instances(draw, max_replicas: int = 6, max_types: int = 4, with_caps: bool = True, zeros: bool = True):
    """(rates, n, caps or None): random rates, capacities (some 0), caps (some inf)."""
    num_k = draw(st.integers(1, max_replicas))
    num_j = draw(st.integers(1, max_types))
    rate = st.one_of(st.just(0.0), st.floats(0.01, 200.0)) if zeros else st.floats(0.01, 200.0)
    cap_n = st.one_of(st.just(0.0), st.floats(0.05, 80.0)) if zeros else st.floats(0.05, 80.0)
    lam = draw(st.lists(rate, min_size=num_j, max_size=num_j))
    n = draw(st.lists(st.lists(cap_n, min_size=num_j, max_size=num_j), min_size=num_k, max_size=num_k))
    caps = None
    if with_caps and draw(st.booleans()):
        caps = draw(st.lists(st.lists(st.one_of(st.just(math.inf), st.floats(0.0, 50.0)),
                                      min_size=num_j, max_size=num_j), min_size=num_k, max_size=num_k))
    return lam, n, caps


def dual_optimum(lam, n, caps) -> float:
    """Optimal value from the dual LP, solved independently:
    min sum_j lam_j pi_j + sum_kj e_kj rho_kj + sum_k mu_k  s.t.  pi_j + rho_kj + mu_k / n_kj >= 1 where the
    pair is usable (n_kj > 0), all >= 0. Strong duality makes it equal to the primal maximum."""
    lam = np.asarray(lam, float)
    n = np.asarray(n, float)
    e = np.full(n.shape, np.inf) if caps is None else np.asarray(caps, float)
    num_k, num_j = n.shape
    # variables: pi (J), rho (K*J, only for finite caps), mu (K)
    finite = np.isfinite(e)
    rho_index = {}
    for k in range(num_k):
        for j in range(num_j):
            if finite[k, j]:
                rho_index[k, j] = len(rho_index)
    num_v = num_j + len(rho_index) + num_k
    c = np.concatenate([lam, [e[k, j] for (k, j) in rho_index], np.ones(num_k)])
    rows, rhs = [], []
    for k in range(num_k):
        for j in range(num_j):
            if n[k, j] <= 0:
                continue
            row = np.zeros(num_v)
            row[j] = 1.0
            if (k, j) in rho_index:
                row[num_j + rho_index[k, j]] = 1.0
            row[num_j + len(rho_index) + k] = 1.0 / n[k, j]
            rows.append(-row)
            rhs.append(-1.0)
    if not rows:
        return 0.0
    res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=(0, None), method="highs-ipm")
    assert res.status == 0, res.message
    return float(res.fun)


def min_peak(lam, n, caps, throughput) -> float:
    """Least peak utilisation serving `throughput`, by bisection on u with feasibility LPs (a method
    independent of the assignment's own phase-two LP)."""
    lam = np.asarray(lam, float)
    n = np.asarray(n, float)
    e = np.full(n.shape, np.inf) if caps is None else np.asarray(caps, float)
    num_k, num_j = n.shape
    usable = (n > 0)
    bounds = [(0, e[k, j] if usable[k, j] else 0) for k in range(num_k) for j in range(num_j)]

    def best_at(u: float) -> float:
        a = []
        b = []
        for j in range(num_j):
            row = np.zeros(num_k * num_j)
            row[j::num_j] = 1
            a.append(row)
            b.append(lam[j])
        for k in range(num_k):
            row = np.zeros(num_k * num_j)
            row[k * num_j:(k + 1) * num_j] = np.where(usable[k], 1 / np.where(usable[k], n[k], 1), 0)
            a.append(row)
            b.append(u)
        res = linprog(-np.ones(num_k * num_j), A_ub=np.array(a), b_ub=np.array(b), bounds=bounds, method="highs")
        return -float(res.fun)

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if best_at(mid) >= throughput * (1 - 1e-9) - 1e-12:
            hi = mid
        else:
            lo = mid
    return hi


@settings(max_examples=60)
@given(instances())
def test_assignment_meets_c1_c3_exactly(inst) -> None:
    lam, n, caps = inst
    a = assign(lam, n, caps)
    assert violations(a, caps, rel_tol=1e-9) == []
    x = np.array(a.rates_rps)
    assert np.all(x >= 0)
    for j in range(len(lam)):
        assert x[:, j].sum() <= lam[j] * (1 + 1e-9)
    if caps is not None:
        assert np.all(x <= np.asarray(caps) * (1 + 1e-9) + 0.0)
    for k in range(len(n)):
        assert a.utilisation[k] <= 1 + 1e-9
        for j in range(len(lam)):
            if n[k][j] == 0:
                assert x[k, j] == 0


@settings(max_examples=40)
@given(instances())
def test_assignment_is_optimal_against_the_dual(inst) -> None:
    lam, n, caps = inst
    a = assign(lam, n, caps)
    best = dual_optimum(lam, n, caps)
    assert a.served_rps == pytest.approx(best, rel=1e-6, abs=1e-7)


@settings(max_examples=15)
@given(instances(max_replicas=4, max_types=3, with_caps=False, zeros=False))
def test_peak_utilisation_is_least_among_max_throughput(inst) -> None:
    lam, n, _ = inst
    a = assign(lam, n)
    # HiGHS solves each phase to ~1e-7 feasibility; on capacities 1000x apart (hypothesis found
    # n = [[0.0625, 64], [0.0547, 56]]) the two phases' errors add up to ~1e-6 of peak utilisation.
    assert a.peak_utilisation == pytest.approx(min_peak(lam, n, None, a.served_rps), abs=1e-5)


def test_all_served_spreads_load_evenly() -> None:
    # Two equal replicas, demand half their joint capacity: each at 50%, not one at 100%.
    a = assign([10.0], [[10.0], [10.0]])
    assert a.served_rps == pytest.approx(10.0)
    assert a.utilisation == pytest.approx((0.5, 0.5))
    assert np.ravel(a.fractions) == pytest.approx([0.5, 0.5])


def test_shared_capacity_is_consumed_per_type() -> None:
    # One replica: 10/s of type 0 alone or 2/s of type 1 alone. Serving 5/s of type 0 leaves half of it,
    # 1/s of type 1. A plain max-flow with one replica capacity could not express this.
    a = assign([5.0, 100.0], [[10.0, 2.0]])
    assert a.served_rps == pytest.approx(6.0)
    assert list(a.rates_rps[0]) == pytest.approx([5.0, 1.0])
    assert a.peak_utilisation == pytest.approx(1.0)


def test_caps_bind() -> None:
    a = assign([10.0], [[100.0], [100.0]], caps=[[3.0], [math.inf]], replica_ids=("a", "b"), type_names=("T",))
    assert a.rate("a", "T") <= 3.0 + 1e-12
    assert a.served_rps == pytest.approx(10.0)


def test_empty_and_degenerate() -> None:
    empty = Assignment.empty(("A", "B"), (1.0, 2.0))
    assert empty.served_rps == 0.0 and empty.peak_utilisation == 0.0 and empty.replica_ids == ()
    a = assign([0.0, 0.0], [[1.0, 2.0]])
    assert a.served_rps == 0.0 and a.utilisation == (0.0,)
    none = assign([1.0], np.zeros((0, 1)))
    assert none.served_rps == 0.0 and none.replica_ids == ()


@pytest.mark.parametrize("rates,n,caps", [
    ([-1.0], [[1.0]], None),
    ([math.nan], [[1.0]], None),
    ([1.0], [[-1.0]], None),
    ([1.0], [[math.inf]], None),
    ([1.0, 2.0], [[1.0]], None),
    ([1.0], [[1.0]], [[-1.0]]),
    ([1.0], [[1.0]], [[1.0, 2.0]]),
])
def test_bad_inputs(rates, n, caps) -> None:
    with pytest.raises(ConfigError):
        assign(rates, n, caps)


# --- the flow network --------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(st.data())
def test_lp_equals_preflow_push_when_each_replica_has_equal_capacities(data) -> None:
    num_k = data.draw(st.integers(1, 6))
    num_j = data.draw(st.integers(1, 4))
    per_replica = data.draw(st.lists(st.integers(1, 60), min_size=num_k, max_size=num_k))
    n = [[float(v)] * num_j for v in per_replica]
    lam = data.draw(st.lists(st.integers(0, 150).map(float), min_size=num_j, max_size=num_j))
    caps = None
    if data.draw(st.booleans()):
        caps = data.draw(st.lists(st.lists(st.one_of(st.just(math.inf), st.integers(0, 40).map(float)),
                                           min_size=num_j, max_size=num_j), min_size=num_k, max_size=num_k))
    g = flow_network(lam, n, caps)
    assert unit_gains(g)
    assert assign(lam, n, caps).served_rps == pytest.approx(max_flow_value(g), rel=1e-8, abs=1e-9)


def test_network_structure_matches_the_paper() -> None:
    g = flow_network([3.0, 4.0], [[2.0, 3.0], [6.0, 0.0]], caps=[[1.0, math.inf], [math.inf, math.inf]],
                     replica_ids=("r0", "r1"), type_names=("A", "B"))
    assert g.edges[SOURCE, "w:A"]["capacity"] == 3.0
    assert g.edges["w:A", "i:r0:A"]["capacity"] == 1.0
    assert "capacity" not in g.edges["w:B", "i:r0:B"]  # no cap: unbounded
    assert "i:r1:B" not in g  # n = 0: replica r1 cannot serve B
    assert g.nodes["c_in:r0"]["normalisation"] == 6.0  # lcm(2, 3)
    assert g.edges["c_in:r0", "c_out:r0"]["capacity"] == 6.0
    assert g.edges["i:r0:A", "c_in:r0"]["gain"] == 3.0  # one request/s of A uses 6/2 units
    assert g.edges["i:r0:B", "c_in:r0"]["gain"] == 2.0
    assert g.edges["i:r1:A", "c_in:r1"]["gain"] == 1.0
    assert nx.is_directed_acyclic_graph(g)


@pytest.mark.parametrize("values,expected", [
    ([4.0, 4.0], 4.0), ([2.0, 3.0], 6.0), ([0.5, 1.5], 1.5), ([2.5, 1.5], 7.5), ([4.0, 6.0, 0.0], 12.0),
    ([math.pi, 1.0], None),
])
def test_normalisation(values, expected) -> None:
    m = normalisation(values)
    if expected is not None:
        assert m == pytest.approx(expected)
    positive = [v for v in values if v > 0]
    assert m >= max(positive) - 1e-12


@settings(max_examples=30)
@given(instances(with_caps=True))
def test_flow_is_conserved_with_gains(inst) -> None:
    lam, n, caps = inst
    a = assign(lam, n, caps)
    g = with_flow(flow_network(lam, n, caps), a)
    for node in g.nodes:
        kind = g.nodes[node]["kind"]
        if kind in ("source", "sink"):
            continue
        inflow = sum(d["flow"] for _, _, d in g.in_edges(node, data=True))
        outflow = sum(d["flow"] for _, _, d in g.out_edges(node, data=True))
        if kind == "pair":  # the gain edge leaves in capacity units
            (_, _, d), = g.out_edges(node, data=True)
            outflow /= d["gain"]
        assert inflow == pytest.approx(outflow, rel=1e-9, abs=1e-9)
    for _, _, d in g.edges(data=True):
        if "capacity" in d:
            assert d["flow"] <= d["capacity"] * (1 + 1e-9) + 1e-12
    assert sum(d["flow"] for _, _, d in g.out_edges(SOURCE, data=True)) == pytest.approx(a.served_rps)
    sat = set(saturated_replicas(g))
    assert sat == {rid for rid, u in zip(a.replica_ids, a.utilisation) if u >= 1 - 1e-6}
    assert SINK in g
