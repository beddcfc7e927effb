"""Packing replicas onto nodes: a TP group (one pipeline stage) must sit inside one node. Pure.

A replica of shape TPt x PPp is p stages of t GPUs; the stages of one replica may sit on different
nodes. So a multiset of shapes can be placed iff its stages, as items of size t, pack into the
cluster's nodes as bins of `gpus_per_node`. Where the distinct stage sizes form a divisibility chain
that divides the node size (1, 2, 4, 8 on 8-GPU nodes: every preset model) any-fit in decreasing size
order is optimal, so the GPU count alone decides; otherwise an exact pattern program (Gilmore-Gomory:
how many nodes use each maximal node pattern) decides and gives the layout.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from oserve.errors import InfeasibleError
from oserve.specs import ClusterSpec, Deployment, Replica, ReplicaShape



@contextlib.contextmanager
def highs_quiet():
    """Silence the C-level stdout for one HiGHS MIP solve.

    HiGHS's MIP solver (as bundled with scipy 1.17) writes a developer message
    ("HighsMipSolverData::transformNewIntegerFeasibleSolution ...") straight to file descriptor 1 on
    some solves, whatever its display options say; that would corrupt a command's --json output.
    Where stdout is not a real file descriptor (captured by a test runner) nothing is changed.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)

def node_patterns(sizes: Iterable[int], gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
    """Maximal ways to fill one node with stages of the given sizes, as counts per size. Pure.

    `sizes` are taken sorted and distinct; a pattern is maximal when no stage of any size still fits.
    """
    return _node_patterns(tuple(sorted(set(sizes))), gpus_per_node)


@lru_cache(maxsize=1024)
def _node_patterns(sizes: tuple[int, ...], gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
    smallest = sizes[0] if sizes else gpus_per_node + 1
    out: list[tuple[int, ...]] = []

    def rec(i: int, left: int, counts: list[int]) -> None:
        if i == len(sizes):
            if left < smallest:
                out.append(tuple(counts))
            return
        for c in range(left // sizes[i], -1, -1):
            counts.append(c)
            rec(i + 1, left - c * sizes[i], counts)
            counts.pop()

    rec(0, gpus_per_node, [])
    return tuple(out)


def is_divisible_chain(sizes: Iterable[int], gpus_per_node: int) -> bool:
    """Whether each distinct size divides the next larger one and the largest divides the node size."""
    chain = sorted(set(sizes)) + [gpus_per_node]
    return all(b % a == 0 for a, b in zip(chain, chain[1:]))


def stage_counts(shapes: Iterable[ReplicaShape]) -> dict[int, int]:
    """Stages of each TP size a multiset of shapes needs (tp -> number of stages)."""
    counts: Counter[int] = Counter()
    for s in shapes:
        counts[s.tp] += s.pp
    return dict(counts)


def can_pack(stages: Mapping[int, int], num_nodes: int, gpus_per_node: int) -> bool:
    """Whether `stages` (tp -> count) fit on `num_nodes` nodes of `gpus_per_node` GPUs. Pure, exact."""
    key = tuple(sorted((t, c) for t, c in stages.items() if c > 0))
    return _can_pack(key, num_nodes, gpus_per_node)


@lru_cache(maxsize=65536)
def _can_pack(key: tuple[tuple[int, int], ...], num_nodes: int, gpus_per_node: int) -> bool:
    if not key:
        return True
    if any(t > gpus_per_node for t, _ in key):
        return False
    if sum(t * c for t, c in key) > num_nodes * gpus_per_node:
        return False
    if is_divisible_chain([t for t, _ in key], gpus_per_node):
        return True
    return _layout(key, num_nodes, gpus_per_node) is not None


def _first_fit_decreasing(key: tuple[tuple[int, int], ...], num_nodes: int,
                          gpus_per_node: int) -> list[tuple[int, ...]] | None:
    free = [gpus_per_node] * num_nodes
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    for t, c in sorted(key, reverse=True):
        for _ in range(c):
            node = next((b for b in range(num_nodes) if free[b] >= t), None)
            if node is None:
                return None
            free[node] -= t
            nodes[node].append(t)
    return [tuple(n) for n in nodes]


def _layout(key: tuple[tuple[int, int], ...], num_nodes: int, gpus_per_node: int) -> list[tuple[int, ...]] | None:
    """Per node, the stage sizes it holds; None when the stages do not pack. First-fit decreasing
    settles most cases; when it fails, an exact search over node patterns decides, and the exact
    pattern program where that search would take too long."""
    layout = _first_fit_decreasing(key, num_nodes, gpus_per_node)
    if layout is not None:
        return layout
    found = _pattern_search(key, num_nodes, gpus_per_node)
    if found is not False:
        return found
    return _pattern_layout(key, num_nodes, gpus_per_node)


def _pattern_search(key: tuple[tuple[int, int], ...], num_nodes: int, gpus_per_node: int,
                    max_states: int = 20_000) -> list[tuple[int, ...]] | None | bool:
    """Depth-first search: each node takes a pattern holding one of the largest stages left (which
    loses no solution: some node holds that stage), memoised on the stages left. A layout, None when
    none exists, or False when it gave up after `max_states` states."""
    sizes = [t for t, _ in key]
    patterns = node_patterns(sizes, gpus_per_node)
    dead: set[tuple[tuple[int, ...], int]] = set()

    def rec(left: tuple[int, ...], nodes: int) -> list[tuple[int, ...]] | None:
        if not any(left):
            return []
        if nodes == 0 or sum(t * c for t, c in zip(sizes, left)) > nodes * gpus_per_node:
            return None
        if (left, nodes) in dead:
            return None
        if len(dead) >= max_states:
            raise _GaveUp
        top = max(i for i, c in enumerate(left) if c)
        tried = set()
        for pat in patterns:
            take = tuple(min(p, c) for p, c in zip(pat, left))
            if take[top] == 0 or take in tried:
                continue
            tried.add(take)
            rest = rec(tuple(c - k for c, k in zip(left, take)), nodes - 1)
            if rest is not None:
                return [tuple(t for t, k in zip(sizes, take) for _ in range(k))] + rest
        dead.add((left, nodes))
        return None

    try:
        return rec(tuple(c for _, c in key), num_nodes)
    except _GaveUp:
        return False


class _GaveUp(Exception):
    pass


def _pattern_layout(key: tuple[tuple[int, int], ...], num_nodes: int,
                    gpus_per_node: int) -> list[tuple[int, ...]] | None:
    """Per node, the stage sizes it holds, from the exact pattern program; None when nothing packs."""
    sizes = [t for t, _ in key]
    need = np.array([c for _, c in key], dtype=float)
    patterns = node_patterns(sizes, gpus_per_node)
    a = np.array(patterns, dtype=float).T  # sizes x patterns
    num_q = a.shape[1]
    constraints = [LinearConstraint(a, lb=need, ub=np.inf), LinearConstraint(np.ones((1, num_q)), ub=num_nodes)]
    with highs_quiet():
        res = milp(np.ones(num_q), constraints=constraints, integrality=np.ones(num_q),
                   bounds=Bounds(0, num_nodes))
    if res.status != 0 or res.x is None:
        return None
    layout: list[tuple[int, ...]] = []
    for q, count in enumerate(np.round(res.x).astype(int)):
        for _ in range(count):
            layout.append(tuple(t for t, c in zip(sizes, patterns[q]) for _ in range(c)))
    return layout


def place(shapes: Sequence[ReplicaShape], cluster: ClusterSpec, id_prefix: str = "r") -> Deployment:
    """Place a multiset of shapes on the cluster's GPUs; replica ids are `r0`, `r1`, ... by first GPU. Pure.

    Larger stages go first, each replica's stages preferably on the node of its previous stage (fewer
    cross-node pipeline hops), inside a node on the lowest free GPU ids, so TP groups stay aligned.

    Raises:
        InfeasibleError: the shapes do not pack onto the cluster's nodes.
    """
    g = cluster.gpus_per_node
    stages = stage_counts(shapes)
    if not can_pack(stages, cluster.num_nodes, g):
        raise InfeasibleError(f"replicas {[str(s) for s in shapes]} do not fit on {cluster.num_nodes} "
                              f"node(s) of {g} GPUs with every TP group inside one node")
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i].tp, -shapes[i].num_gpus, i))
    free = [list(range(n * g, (n + 1) * g)) for n in range(cluster.num_nodes)]  # node -> free GPU ids
    gpu_ids: dict[int, list[int]] = {}
    if is_divisible_chain(stages, g):
        for i in order:
            shape = shapes[i]
            ids: list[int] = []
            last = None
            for _ in range(shape.pp):
                candidates = ([last] if last is not None else []) + list(range(cluster.num_nodes))
                node = next(n for n in candidates if len(free[n]) >= shape.tp)
                ids.extend(free[node][:shape.tp])
                del free[node][:shape.tp]
                last = node
            gpu_ids[i] = ids
    else:
        key = tuple(sorted(stages.items()))
        layout = _layout(key, cluster.num_nodes, g)
        assert layout is not None  # can_pack said yes
        slots: dict[int, list[int]] = {}  # tp -> nodes with a free slot of that size, one entry per slot
        for node, sizes in enumerate(layout):
            for t in sorted(sizes, reverse=True):
                slots.setdefault(t, []).append(node)
        for i in order:
            shape = shapes[i]
            ids = []
            for _ in range(shape.pp):
                node = slots[shape.tp].pop(0)
                ids.extend(free[node][:shape.tp])
                del free[node][:shape.tp]
            gpu_ids[i] = ids
    by_first = sorted(gpu_ids, key=lambda i: min(gpu_ids[i]))
    return Deployment(tuple(Replica(f"{id_prefix}{rank}", shapes[i], tuple(gpu_ids[i]))
                            for rank, i in enumerate(by_first)))
