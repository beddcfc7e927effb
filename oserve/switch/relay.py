"""Relays: lines that reach one target GPU and are forwarded from it to others that want them. Pure.

Without relays every needed line is sent by a GPU that held it in the source deployment: when several
GPUs of a node want the same lines and no GPU of that node holds them, each pulls them across the network
on its own NIC. With a relay the lines cross once, to one of those GPUs, which forwards them over NVLink
from the copy it just received. Relays run only through target GPUs that want those same lines, so a
relay needs no buffer beyond its own target shard.

Topology (`topology`): a networkx graph with a node per GPU, an NVSwitch per node and one network fabric.
Every edge is one port of one GPU (GPU -> NVSwitch is its NVLink out, NVSwitch -> GPU its NVLink in, and
the same with the fabric for its NIC), weighted by seconds per byte; a direct transfer between two GPUs is
the lightest two-edge path between them (`hops`), so its link and the two ports it occupies come from
the graph, not from node arithmetic. A relayed line follows a path that passes through a receiver's GPU
node; the LPs below route byte classes over these paths with every edge's load at most T times its
bandwidth.

Relay classes (`relay_classes`): the needed lines cut where the set of receivers (target GPUs lacking
them) or of holders changes; (receivers, holders) -> the runs of lines, in model order.

The relay LP (`relay_split`), which plans: per class of B bytes, each receiver r is the *first receiver*
of a part A_r of the lines (sum of A_r = B, r gets them straight from holders), and any other receiver d
takes w_rd <= A_r of them from r instead of from a holder; d gets the rest of the B bytes straight from
holders (y_hd). Relays forward only lines they got straight from a holder (trees of depth two: holder ->
first receiver -> the others), which is what "cross the network once, fan out over NVLink" needs and
keeps the plan linear. Least T first, then, at that T, the fewest network bytes; the planner caps the
network bytes at the relay-free plan's (relays are there to save crossings). Every relay-free split is
feasible here (no relays), so its T is never above the relay-free LP's. Depth two lost nothing measurable
on `oserve bench switch`: on its 22 changing switches at 8, 16 and 32 GPUs, remapped and as given, its T
(with that cap) was within 3e-7 of the relay bound below.

The relay bound (`relay_bound_seconds`): the same classes as a multicast flow problem on the graph: per
receiver d, B bytes flow from the holders to d through receivers only, and an edge carries, per class,
the most any receiver's flow puts on it (a line forwarded once serves every receiver downstream). Any
plan whose relays run through target GPUs that want the lines has such flows (trace each line at d back
through the transfers that carried it), so no such plan is faster than this LP's T: a valid lower bound
with relays of any depth. It relaxes the plans (flows may split lines in ways forwarding cannot), so it
may lie below what any plan reaches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

import networkx as nx
import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_array

from oserve.specs import ClusterSpec
from oserve.switch.layout import TensorSpec

FABRIC = "fabric"
"""The network fabric's node in the topology graph."""

Port = tuple[int, str, str]
"""(gpu, link, direction): one port of the time model."""
RelayClass = tuple[frozenset[int], frozenset[int]]
"""(receivers, holders): target GPUs that lack the lines, GPUs that hold them in the source deployment."""
Atom = tuple[str, int, int, int, frozenset[int]]
"""(tensor, dst, lo, hi, holders): lines [lo, hi) of a tensor that target GPU dst needs."""

_SCALE = 1e9  # LP variables in GB, times in s, bandwidths in GB/s: coefficients near 1


def nvswitch(node: int) -> tuple[str, int]:
    """The NVSwitch node of a cluster node in the topology graph."""
    return ("nvswitch", node)


@lru_cache(maxsize=32)
def topology(cluster: ClusterSpec) -> nx.DiGraph:
    """The cluster as a graph whose edges are the time model's ports. Pure (the graph is frozen).

    Edge attributes: `port` (gpu, link, direction), `link` ('nvlink' or 'network'), `bytes_per_s` (one
    direction, per GPU, as `ClusterSpec` gives it) and `weight` (seconds per byte).
    """
    g = nx.DiGraph(name=cluster.name)
    links = [("nvlink", cluster.nvlink_bytes_per_s)]
    if cluster.num_nodes > 1:
        links.append(("network", cluster.network_bytes_per_s))
    for gpu in range(cluster.num_gpus):
        g.add_node(gpu, kind="gpu", node=cluster.node_of(gpu))
        for link, bw in links:
            hub = nvswitch(cluster.node_of(gpu)) if link == "nvlink" else FABRIC
            g.add_edge(gpu, hub, port=(gpu, link, "out"), link=link, bytes_per_s=bw, weight=1.0 / bw)
            g.add_edge(hub, gpu, port=(gpu, link, "in"), link=link, bytes_per_s=bw, weight=1.0 / bw)
    return nx.freeze(g)


@dataclass(frozen=True, slots=True)
class Hop:
    """A direct transfer between two GPUs: its link and the ports (graph edges) it occupies."""

    link: str
    ports: tuple[Port, ...]


@lru_cache(maxsize=32)
def hops(cluster: ClusterSpec) -> Mapping[tuple[int, int], Hop]:
    """(src, dst) -> the hop of a direct transfer: the lightest path between two GPUs on `topology`. Pure.

    GPUs connect only through a hub (an NVSwitch or the fabric), so a two-edge path never passes another
    GPU; inside a node the NVSwitch path is lighter than the fabric's, across nodes the fabric's is the
    only one.
    """
    g = topology(cluster)
    out: dict[tuple[int, int], Hop] = {}
    gpus = [n for n, kind in g.nodes(data="kind") if kind == "gpu"]
    for src in gpus:
        _, paths = nx.single_source_dijkstra(g, src, weight="weight", cutoff=None)
        for dst in gpus:
            if dst == src:
                continue
            path = paths[dst]
            if len(path) != 3:
                raise AssertionError(f"no direct path {src} -> {dst} in the topology: {path}")
            edges = [g.edges[a, b] for a, b in zip(path, path[1:])]
            out[(src, dst)] = Hop(edges[0]["link"], tuple(e["port"] for e in edges))
    return MappingProxyType(out)


def port_bandwidths(cluster: ClusterSpec) -> dict[Port, float]:
    """port -> bytes per second, from the topology's edges. Pure."""
    return {d["port"]: d["bytes_per_s"] for _, _, d in topology(cluster).edges(data=True)}


# --- relay classes -----------------------------------------------------------------------------

def relay_classes(atoms: Sequence[Atom], tensors: Mapping[str, TensorSpec],
                  ) -> dict[RelayClass, list[tuple[str, int, int]]]:
    """(receivers, holders) -> runs (tensor, lo, hi) of the needed lines, tensors in model order. Pure.

    Each line of each tensor lands in exactly one class: the receivers are every target GPU whose atoms
    cover it, the holders the atoms' holder set (equal for every atom over one line, since atoms are cut
    where the holders change).
    """
    by_tensor: dict[str, list[tuple[int, int, int, frozenset[int]]]] = defaultdict(list)
    for name, dst, lo, hi, holders in atoms:
        by_tensor[name].append((lo, hi, dst, holders))
    out: dict[RelayClass, list[tuple[str, int, int]]] = defaultdict(list)
    for name in (n for n in tensors if n in by_tensor):
        events: dict[int, list[tuple[int, int, frozenset[int]]]] = defaultdict(list)  # pos -> [(+1/-1, dst, H)]
        for lo, hi, dst, holders in by_tensor[name]:
            events[lo].append((1, dst, holders))
            events[hi].append((-1, dst, holders))
        active: dict[int, frozenset[int]] = {}  # dst -> holders, over the current segment
        positions = sorted(events)
        for a, b in zip(positions, positions[1:] + [None]):
            for sign, dst, holders in events[a]:
                if sign < 0:
                    active.pop(dst, None)
            for sign, dst, holders in events[a]:
                if sign > 0:
                    active[dst] = holders
            if b is None or not active:
                continue
            hs = set(active.values())
            if len(hs) != 1:
                raise AssertionError(f"atoms over lines [{a}, {b}) of {name} disagree on their holders")
            key = (frozenset(active), hs.pop())
            runs = out[key]
            if runs and runs[-1][0] == name and runs[-1][2] == a:
                runs[-1] = (name, runs[-1][1], b)
            else:
                runs.append((name, a, b))
    return out


def class_bytes(runs: Sequence[tuple[str, int, int]], tensors: Mapping[str, TensorSpec]) -> int:
    return sum((hi - lo) * tensors[n].line_bytes for n, lo, hi in runs)


# --- the relay LP (plans) ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RelaySplit:
    """One class's share of the relay LP's answer, in bytes."""

    first: Mapping[int, float]
    """receiver -> bytes of the class it is the first receiver of (straight from holders)."""
    direct: Mapping[tuple[int, int], float]
    """(holder, receiver) -> bytes sent straight from the holder, first parts included."""
    relay: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """(first receiver, other receiver) -> bytes forwarded, out of the first receiver's part."""


class _Program:
    """A sparse LP being built: columns on hops, <= rows (one per port, with the makespan column), = rows."""

    def __init__(self, bw: Mapping[Port, float]) -> None:
        self.bw = bw
        self.num_cols = 0
        self.is_net: list[bool] = []
        self.cost2: list[float] = []  # phase-two cost of each column
        self.on_port: list[tuple[Port, int]] = []  # (port, column) pairs
        self.ub: list[tuple[list[tuple[int, float]], float]] = []  # sum(value * col) <= rhs (bytes)
        self.eq: list[tuple[list[tuple[int, float]], float]] = []  # sum(value * col) == rhs (bytes)

    def col(self, hop: Hop | None = None, cost2: float = 1e-6) -> int:
        """A new non-negative column (bytes); on a hop it loads the hop's ports and network ones cost 1."""
        j = self.num_cols
        self.num_cols += 1
        net = hop is not None and hop.link == "network"
        self.is_net.append(net)
        self.cost2.append(1.0 if net else cost2)
        if hop is not None:
            self.on_port.extend((p, j) for p in hop.ports)
        return j

    def solve(self, local_floor_s: float, time_limit_s: float, phase_two: bool) -> tuple[float, np.ndarray] | None:
        """(least T, columns in bytes / 1e9); with `phase_two`, at that T the least phase-two cost.
        None when HiGHS stops short of optimal (time limit)."""
        nv = self.num_cols
        rows, cols, vals = [], [], []
        ports: dict[Port, int] = {}
        for p, j in self.on_port:
            rows.append(ports.setdefault(p, len(ports)))
            cols.append(j)
            vals.append(1.0)
        for p, r in ports.items():
            rows.append(r)
            cols.append(nv)
            vals.append(-self.bw[p] / _SCALE)
        b_ub = [0.0] * len(ports)
        for terms, rhs in self.ub:
            for j, v in terms:
                rows.append(len(b_ub))
                cols.append(j)
                vals.append(v)
            b_ub.append(rhs / _SCALE)
        a_ub = coo_array((vals, (rows, cols)), shape=(len(b_ub), nv + 1)).tocsr()
        er, ec, ev, b_eq = [], [], [], []
        for i, (terms, rhs) in enumerate(self.eq):
            for j, v in terms:
                er.append(i)
                ec.append(j)
                ev.append(v)
            b_eq.append(rhs / _SCALE)
        a_eq = coo_array((ev, (er, ec)), shape=(len(self.eq), nv + 1)).tocsr()
        c = np.zeros(nv + 1)
        c[nv] = 1.0
        opts = {"time_limit": time_limit_s}
        res = linprog(c, A_ub=a_ub, b_ub=np.array(b_ub), A_eq=a_eq, b_eq=np.array(b_eq),
                      bounds=[(0, None)] * nv + [(local_floor_s, None)], method="highs", options=opts)
        if res.status != 0:
            return None
        t_star = float(res.x[nv])
        if not phase_two:
            return t_star, res.x
        c2 = np.zeros(nv + 1)
        c2[:nv] = self.cost2
        res2 = linprog(c2, A_ub=a_ub, b_ub=np.array(b_ub), A_eq=a_eq, b_eq=np.array(b_eq),
                       bounds=[(0, None)] * nv + [(t_star, t_star * (1 + 1e-7) + 1e-12)], method="highs",
                       options=opts)
        return t_star, (res2.x if res2.status == 0 else res.x)


def relay_split(classes: Mapping[RelayClass, Sequence[tuple[str, int, int]]], tensors: Mapping[str, TensorSpec],
                cluster: ClusterSpec, local_floor_s: float, time_limit_s: float,
                network_budget_bytes: float | None = None) -> tuple[float, dict[RelayClass, RelaySplit]] | None:
    """The relay LP (see the module docstring): least T, then fewest network bytes. Pure.

    With `network_budget_bytes`, at most that many bytes cross the network (pass a relay-free plan's:
    that plan's split stays feasible, so T is still no more than its makespan's LP value).

    Returns (T seconds, class -> split), or None when the LP hit its time limit or the budget is below
    what the classes need.
    """
    if not classes:
        return local_floor_s, {}
    hop = hops(cluster)
    lp = _Program(port_bandwidths(cluster))
    index: list[tuple[RelayClass, dict[tuple, int]]] = []
    for key, runs in classes.items():
        receivers, holders = key
        b = class_bytes(runs, tensors)
        cols: dict[tuple, int] = {}
        for d in sorted(receivers):
            for h in sorted(holders):
                cols[("y", h, d)] = lp.col(hop[(h, d)])
        if len(receivers) == 1:
            (d,) = receivers
            lp.eq.append(([(cols[("y", h, d)], 1.0) for h in holders], b))
        else:
            for r in sorted(receivers):
                cols[("a", r)] = lp.col()
                for d in sorted(receivers - {r}):
                    # A relayed byte costs a little more than a direct one in phase two: it waits for its
                    # delivery, so among equally fast splits the one with fewer relays is preferred.
                    cols[("w", r, d)] = lp.col(hop[(r, d)], cost2=1e-3)
            lp.eq.append(([(cols[("a", r)], 1.0) for r in receivers], b))
            for r in receivers:
                lp.ub.append(([(cols[("a", r)], 1.0)] + [(cols[("y", h, r)], -1.0) for h in holders], 0.0))
                for d in receivers - {r}:
                    lp.ub.append(([(cols[("w", r, d)], 1.0), (cols[("a", r)], -1.0)], 0.0))
            for d in receivers:
                lp.eq.append(([(cols[("y", h, d)], 1.0) for h in holders]
                              + [(cols[("w", r, d)], 1.0) for r in receivers - {d}], b))
        index.append((key, cols))
    if network_budget_bytes is not None:
        lp.ub.append(([(j, 1.0) for j in range(lp.num_cols) if lp.is_net[j]], float(network_budget_bytes)))
    solved = lp.solve(local_floor_s, time_limit_s, phase_two=True)
    if solved is None:
        return None
    t_star, x = solved
    out: dict[RelayClass, RelaySplit] = {}
    for key, cols in index:
        first: dict[int, float] = {}
        direct: dict[tuple[int, int], float] = {}
        relay: dict[tuple[int, int], float] = {}
        for k, j in cols.items():
            v = float(x[j]) * _SCALE
            if v <= 0:
                continue
            if k[0] == "y":
                direct[(k[1], k[2])] = v
            elif k[0] == "a":
                first[k[1]] = v
            else:
                relay[(k[1], k[2])] = v
        if len(key[0]) == 1:
            (d,) = key[0]
            first = {d: sum(direct.values())}
        out[key] = RelaySplit(first, direct, relay)
    return t_star, out


# --- the relay bound ---------------------------------------------------------------------------

def relay_bound_seconds(classes: Mapping[RelayClass, Sequence[tuple[str, int, int]]],
                        tensors: Mapping[str, TensorSpec], cluster: ClusterSpec, local_floor_s: float,
                        time_limit_s: float) -> float:
    """No plan whose relays run through target GPUs that want the lines is faster (multicast LP). Pure.

    Past the LP's time limit, the closed form of `simple_relay_bound_seconds` (weaker, still valid).
    """
    if not classes:
        return local_floor_s
    hop = hops(cluster)
    lp = _Program(port_bandwidths(cluster))
    for (receivers, holders), runs in classes.items():
        b = class_bytes(runs, tensors)
        if len(receivers) == 1:
            (d,) = receivers
            lp.eq.append(([(lp.col(hop[(h, d)]), 1.0) for h in holders], b))
            continue
        # Edge loads x[u, v] (what is sent on the hop), and per receiver a flow under them.
        senders = sorted(holders | receivers)
        load = {(u, v): lp.col(hop[(u, v)]) for u in senders for v in sorted(receivers) if u != v}
        for d in receivers:
            balance: dict[int, list[tuple[int, float]]] = {v: [] for v in receivers}  # v -> its in - out terms
            for (u, v), x in load.items():
                if u == d:
                    continue
                f = lp.col()
                lp.ub.append(([(f, 1.0), (x, -1.0)], 0.0))
                balance[v].append((f, 1.0))
                if u in balance:
                    balance[u].append((f, -1.0))
            for v, terms in balance.items():
                lp.eq.append((terms, b if v == d else 0.0))
    solved = lp.solve(local_floor_s, time_limit_s, phase_two=False)
    if solved is None:
        return simple_relay_bound_seconds(classes, tensors, cluster, local_floor_s)
    return solved[0]


def simple_relay_bound_seconds(classes: Mapping[RelayClass, Sequence[tuple[str, int, int]]],
                               tensors: Mapping[str, TensorSpec], cluster: ClusterSpec,
                               local_floor_s: float) -> float:
    """A closed-form bound valid with relays. Pure.

    Per target GPU, every byte it lacks enters through its NVLink and network ports together; per node,
    the bytes some GPU of it lacks and no GPU of it holds enter through the network ports of the GPUs of
    that node that want them, at least once.
    """
    nvl, net = cluster.nvlink_bytes_per_s, cluster.network_bytes_per_s
    total: dict[int, int] = defaultdict(int)  # target GPU -> bytes it lacks
    far_bytes: dict[int, int] = defaultdict(int)  # node -> bytes some GPU of it lacks and none of it holds
    far_gpus: dict[int, set[int]] = defaultdict(set)  # node -> its GPUs that want such bytes
    for (receivers, holders), runs in classes.items():
        b = class_bytes(runs, tensors)
        for d in receivers:
            total[d] += b
        held = {cluster.node_of(h) for h in holders}
        for d in receivers:
            n = cluster.node_of(d)
            if n not in held:
                far_gpus[n].add(d)
        for n in {cluster.node_of(d) for d in receivers} - held:
            far_bytes[n] += b
    return max([local_floor_s] + [b / (nvl + net) for b in total.values()]
               + [far_bytes[n] / (len(far_gpus[n]) * net) for n in far_bytes])

__all__ = ["FABRIC", "Hop", "RelayClass", "RelaySplit", "class_bytes", "hops", "nvswitch", "port_bandwidths",
           "relay_bound_seconds", "relay_classes", "relay_split", "simple_relay_bound_seconds", "topology"]
