"""The paper's flow network for the assignment problem, as an inspectable networkx graph. Pure.

    source --lambda_j--> w_j --e_kj--> i_kj --(gain M_k / n_kj)--> c_k^in --M_k--> c_k^out --> sink

One request/s of type j sent to replica k enters c_k^in as M_k / n[k][j] units of replica capacity, and
replica k has M_k units; M_k normalises the n[k][j] to whole-number consumptions (their least common
multiple, see `normalisation`). The edges i_kj -> c_k^in carry that factor as their `gain` attribute.
Where every gain is 1 (a replica whose n[k][j] are all equal) the network is an ordinary max-flow
network and `max_flow_value` (preflow-push) solves the assignment; otherwise it is a generalised flow,
which `assignment.assign` solves exactly as a linear program.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import networkx as nx
from networkx.algorithms.flow import preflow_push

from oserve.errors import ConfigError
from oserve.scheduler.assignment import Assignment, _as_inputs

SOURCE = "source"
SINK = "sink"
MAX_DENOMINATOR = 1000
"""Capacities are rationalised to at most this denominator before taking their LCM."""
MAX_LCM_BLOWUP = 1e6
"""An LCM larger than this times the largest capacity falls back to the largest capacity."""


def workload_node(type_name: str) -> str:
    return f"w:{type_name}"


def pair_node(replica_id: str, type_name: str) -> str:
    return f"i:{replica_id}:{type_name}"


def replica_in_node(replica_id: str) -> str:
    return f"c_in:{replica_id}"


def replica_out_node(replica_id: str) -> str:
    return f"c_out:{replica_id}"


def normalisation(capacities: Sequence[float]) -> float:
    """M_k for one replica: the LCM of its positive n[k][j], as rationals. Pure.

    Equal capacities give that value itself (all gains 1). Integers give their LCM; other values are
    rationalised (denominator <= 1000) and get lcm(numerators) / gcd(denominators). Where that is huge
    (or there is nothing to normalise) the largest capacity is used: any positive M_k gives the same
    constraint, the LCM only makes the consumptions whole numbers.
    """
    values = [float(v) for v in capacities if v > 0.0]
    if not values:
        return 1.0
    if all(v == values[0] for v in values):
        return values[0]
    fracs = [Fraction(v).limit_denominator(MAX_DENOMINATOR) for v in values]
    if any(f <= 0 for f in fracs):
        return max(values)
    num = 1
    den = 0
    for f in fracs:
        num = num * f.numerator // math.gcd(num, f.numerator)
        den = math.gcd(den, f.denominator)
    lcm = num / den
    if not math.isfinite(lcm) or lcm > MAX_LCM_BLOWUP * max(values):
        return max(values)
    return lcm


def flow_network(rates: Sequence[float], capacity: Sequence[Sequence[float]],
                 caps: Sequence[Sequence[float]] | None = None, *,
                 replica_ids: Sequence[str] | None = None,
                 type_names: Sequence[str] | None = None) -> nx.DiGraph:
    """The paper's network for rates lambda_j, capacities n[k][j] and caps e[k][j]. Pure.

    Edges carry `capacity` (absent: unbounded, as networkx reads it); i_kj -> c_k^in edges carry `gain`
    (capacity units per request/s); nodes carry `kind` and, for replicas, `normalisation` (M_k).
    Pairs with n[k][j] == 0 or lambda_j == 0 get no i_kj node.
    """
    lam, n, e = _as_inputs(rates, capacity, caps)
    num_k, num_j = n.shape
    rids = tuple(replica_ids) if replica_ids is not None else tuple(f"r{k}" for k in range(num_k))
    names = tuple(type_names) if type_names is not None else tuple(f"t{j}" for j in range(num_j))
    if len(rids) != num_k or len(names) != num_j:
        raise ConfigError("flow_network: labels do not match the capacity matrix")
    g = nx.DiGraph(name="oserve-assignment")
    g.add_node(SOURCE, kind="source")
    g.add_node(SINK, kind="sink")
    for j, name in enumerate(names):
        g.add_node(workload_node(name), kind="workload", type_name=name)
        g.add_edge(SOURCE, workload_node(name), capacity=float(lam[j]))
    for k, rid in enumerate(rids):
        m_k = normalisation(n[k])
        c_in, c_out = replica_in_node(rid), replica_out_node(rid)
        g.add_node(c_in, kind="replica_in", replica_id=rid, normalisation=m_k)
        g.add_node(c_out, kind="replica_out", replica_id=rid)
        g.add_edge(c_in, c_out, capacity=m_k)
        g.add_edge(c_out, SINK)
        for j, name in enumerate(names):
            if n[k, j] <= 0.0 or lam[j] <= 0.0:
                continue
            node = pair_node(rid, name)
            g.add_node(node, kind="pair", replica_id=rid, type_name=name)
            attrs = {} if math.isinf(e[k, j]) else {"capacity": float(e[k, j])}
            g.add_edge(workload_node(name), node, **attrs)
            g.add_edge(node, c_in, gain=m_k / float(n[k, j]))
    return g


def unit_gains(graph: nx.DiGraph, rel_tol: float = 1e-12) -> bool:
    """Whether every gain is 1, so that a plain max-flow solves the network."""
    return all(abs(d.get("gain", 1.0) - 1.0) <= rel_tol for _, _, d in graph.edges(data=True))


def max_flow_value(graph: nx.DiGraph) -> float:
    """Max-flow value by preflow-push, ignoring gains; the assignment optimum only if `unit_gains`."""
    return float(preflow_push(graph, SOURCE, SINK).graph["flow_value"])


def with_flow(graph: nx.DiGraph, assignment: Assignment) -> nx.DiGraph:
    """A copy of `graph` whose edges carry the `flow` an assignment sends (in each edge's units). Pure.

    Flow into c_k^in is in capacity units (request/s times gain), so it is conserved at every node
    once the gains are applied, and c_k^in -> c_k^out carries M_k times the replica's utilisation.
    """
    out = graph.copy()
    for _, _, d in out.edges(data=True):
        d["flow"] = 0.0
    for j, name in enumerate(assignment.type_names):
        w = workload_node(name)
        if w in out:
            out.edges[SOURCE, w]["flow"] = assignment.served_by_type_rps[j]
    for k, rid in enumerate(assignment.replica_ids):
        c_in, c_out = replica_in_node(rid), replica_out_node(rid)
        units = 0.0
        for j, name in enumerate(assignment.type_names):
            x = assignment.rates_rps[k][j]
            node = pair_node(rid, name)
            if node not in out:
                continue
            out.edges[workload_node(name), node]["flow"] = x
            out.edges[node, c_in]["flow"] = x * out.edges[node, c_in]["gain"]
            units += x * out.edges[node, c_in]["gain"]
        out.edges[c_in, c_out]["flow"] = units
        out.edges[c_out, SINK]["flow"] = units
    return out


def saturated_replicas(graph_with_flow: nx.DiGraph, rel_tol: float = 1e-6) -> tuple[str, ...]:
    """Replica ids whose c_k^in -> c_k^out edge is full: the bottlenecks the paper's search grows."""
    out = []
    for u, v, d in graph_with_flow.edges(data=True):
        if graph_with_flow.nodes[u].get("kind") == "replica_in" and d.get("flow", 0.0) >= d["capacity"] * (1 - rel_tol):
            out.append(graph_with_flow.nodes[u]["replica_id"])
    return tuple(out)
