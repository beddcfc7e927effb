"""Deployments worth considering, the assignment of rates over one, and placement that keeps replicas. Pure.

Every planner builds on these: OServe's candidates and its switch, the baselines' homogeneous
deployments, the ceiling's fixed ones.
"""

from __future__ import annotations

import numpy as np

from oserve.capacity import CapacityTable, homogeneous_rate
from oserve.errors import ConfigError, InfeasibleError
from oserve.scheduler import Assignment, assign
from oserve.scheduler.packing import place
from oserve.specs import ClusterSpec, Deployment, Replica, ReplicaShape


def mix_capacity_rps(n_row: np.ndarray, rates: np.ndarray) -> float:
    """Requests/s one replica (capacities `n_row` per class) sustains for the mix of `rates`: harmonic. Pure."""
    total = float(np.sum(rates))
    if total <= 0:
        return 0.0
    p = np.asarray(rates, dtype=float) / total
    used = p > 0
    return float(1.0 / np.sum(p[used] / np.asarray(n_row, dtype=float)[used]))


def weights_for(plan_assignment: Assignment, capacity_rows: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """Routing weights [class][replica] from an assignment: each class's planned rate on each replica
    (`oserve.decision.Decision.weights`); a class it serves nowhere may go anywhere, weighted by
    capacity. Pure."""
    x = np.asarray(plan_assignment.rates_rps, dtype=float)  # [replica][class]
    out = []
    for j in range(capacity_rows.shape[1]):
        col = x[:, j] if len(x) else np.zeros(0)
        if col.sum() <= 0:
            col = capacity_rows[:, j]
        out.append(tuple(float(v) for v in col))
    return tuple(out)


def assign_even(rates: np.ndarray, n: np.ndarray) -> Assignment:
    """The exact assignment of `rates` over replicas with capacity rows `n`, identical replicas sharing
    their group's flows evenly. Pure.

    Replicas with equal rows are interchangeable, so the LP runs over groups (a group of c replicas has
    c times the capacity; exact, as in `oserve.scheduler.problem`) and each member gets 1/c of its
    group's flow of every class. A per-replica vertex solution instead pins classes to arbitrary members
    of a group, and re-solving every span moves them around: the router then shifts whole classes
    between identical replicas from one span to the next, which the twin (fixed weights) does not foresee.
    """
    n = np.asarray(n, dtype=float)
    if len(n) == 0:
        return assign(rates, n)
    groups: dict[tuple, list[int]] = {}
    for k, row in enumerate(n):
        groups.setdefault(tuple(row), []).append(k)
    members = list(groups.values())
    agg = np.array([n[m[0]] * len(m) for m in members])
    a = assign(rates, agg)
    x = np.zeros_like(n)
    for g, m in enumerate(members):
        x[m] = np.asarray(a.rates_rps[g], dtype=float) / len(m)
    return Assignment(tuple(f"r{k}" for k in range(len(n))), a.type_names, a.demand_rps,
                      tuple(tuple(float(v) for v in row) for row in x),
                      tuple(tuple(float(v) for v in row) for row in n))


def served(table: CapacityTable, deployment: Deployment, rates: np.ndarray) -> tuple[Assignment, np.ndarray]:
    """The exact assignment of `rates` over an existing deployment (identical replicas evenly), and the
    deployment's capacity rows. Pure."""
    n = table.matrix(deployment.shapes())
    return assign_even(rates, n), n


def homogeneous_deployment(cluster: ClusterSpec, shape: ReplicaShape) -> Deployment:
    """As many replicas of `shape` as pack on the cluster (TP groups inside nodes), placed. Pure."""
    for count in range(cluster.num_gpus // shape.num_gpus, 0, -1):
        try:
            return place([shape] * count, cluster)
        except (ConfigError, InfeasibleError):
            continue  # fewer replicas if the last ones do not pack
    raise InfeasibleError(f"no replica of {shape} packs on {cluster.name}")


def static_capacity_rps(table: CapacityTable, cluster: ClusterSpec,
                        mix: np.ndarray) -> list[tuple[float, ReplicaShape]]:
    """Modelled capacity of every homogeneous deployment for a mix (fractions summing to 1), best first. Pure."""
    out = []
    for shape in table.shapes(cluster.num_gpus):
        count = len(homogeneous_deployment(cluster, shape).replicas)
        out.append((homogeneous_rate(table, shape, mix) * count, shape))
    return sorted(out, key=lambda x: (-x[0], x[1].num_gpus))


def best_homogeneous(table: CapacityTable, cluster: ClusterSpec, rates: np.ndarray) -> tuple[Deployment, Assignment]:
    """The homogeneous deployment that serves `rates` best (served rate, then lowest peak utilisation). Pure."""
    best = None
    for shape in table.shapes(cluster.num_gpus):
        try:
            dep = homogeneous_deployment(cluster, shape)
        except (ConfigError, InfeasibleError):
            continue
        a, _ = served(table, dep, rates)
        key = (round(a.served_rps, 9), -a.peak_utilisation)
        if best is None or key > best[0]:
            best = (key, dep, a)
    if best is None:
        raise InfeasibleError(f"no homogeneous deployment of {table.model.name} fits {cluster.name}")
    return best[1], best[2]


def stabilize(old: Deployment, new: Deployment, cluster: ClusterSpec) -> Deployment:
    """Place `new` so that replicas it shares with `old` (same shape) keep their GPUs and ids. Pure.

    Old replicas whose shape the new deployment still wants are kept where they are; the remaining
    new replicas go on the GPUs left free, largest TP groups first, each TP group inside one node. If
    they cannot be packed that way, `new` is returned as it was placed.
    """
    if not old.replicas:
        return new
    pool: dict[ReplicaShape, list[Replica]] = {}
    for r in old.replicas:
        pool.setdefault(r.shape, []).append(r)
    kept: list[Replica] = []
    rest: list[ReplicaShape] = []
    for r in new.replicas:
        same = pool.get(r.shape)
        if same:
            kept.append(same.pop(0))
        else:
            rest.append(r.shape)
    used = {g for r in kept for g in r.gpu_ids}
    free = {n: [g for g in range(n * cluster.gpus_per_node, (n + 1) * cluster.gpus_per_node) if g not in used]
            for n in range(cluster.num_nodes)}
    placed: list[tuple[ReplicaShape, tuple[int, ...]]] = []
    for shape in sorted(rest, key=lambda s: (-s.tp, -s.pp)):
        gpus: list[int] = []
        for _ in range(shape.pp):
            # the fullest node that still fits a TP group (keeps whole nodes free for big groups)
            fits = [n for n in free if len(free[n]) >= shape.tp]
            if not fits:
                return new
            n = min(fits, key=lambda n: (len(free[n]), n))
            gpus += free[n][:shape.tp]
            free[n] = free[n][shape.tp:]
        placed.append((shape, tuple(gpus)))
    # kept replicas keep their ids; new ones get ids no old replica had
    old_ids = {r.replica_id for r in old.replicas}
    fresh = (f"n{i}" for i in range(len(old_ids) + len(placed) + 1) if f"n{i}" not in old_ids)
    out = list(kept) + [Replica(next(fresh), s, g) for s, g in placed]
    return Deployment(tuple(out))
