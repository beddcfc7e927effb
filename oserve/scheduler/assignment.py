"""Lower level of the scheduler: route each workload type to the replicas of a fixed deployment. Pure.

The problem is the paper's (constraints C1-C3), for replicas k and types j:

    maximise   sum_kj x[k][j]                        requests/s served
    subject to sum_k x[k][j] <= rate[j]              (C1) no more than arrives of type j
               0 <= x[k][j] <= cap[k][j]             (C2) per-pair caps
               sum_j x[k][j] / n[k][j] <= 1          (C3) replica k's capacity is shared by the types

with n[k][j] the requests/s of type j replica k sustains alone at saturation. Then, among the
assignments that serve the most, the one with the lowest peak replica utilisation
max_k sum_j x[k][j] / n[k][j] (what keeps tail latency down).

Why a linear program and not a max-flow. In the paper's flow network (see `flownet.py`) one request/s
of type j routed to replica k uses up 1/n[k][j] of that replica, so the edge into the replica node
multiplies the flow by a type-dependent factor M_k / n[k][j]. A plain max-flow conserves flow on every
edge: it can only give one capacity to the replica node, the same for all types, and would let a replica
serve n_max requests/s of a type it can only serve n_min of. That is a generalised flow (flow with
gains), not a max-flow; it is still a linear program, so we solve it exactly as one with HiGHS (dual
simplex through scipy's `linprog`): phase one maximises the served rate, phase two fixes it (to within
a relative 1e-9) and minimises the peak utilisation u with sum_j x[k][j] / n[k][j] <= u. Where all of a
replica's n[k][j] are equal the factors are 1 and the LP optimum is the network's max-flow value; a
test checks this against networkx's preflow-push.

The returned rates satisfy C1-C3 exactly (up to float rounding): the solver's answer, feasible only to
its tolerance (1e-7), is clipped to the bounds and scaled down per type and per replica where needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_array, hstack, vstack

from oserve.errors import ConfigError, InfeasibleError

THROUGHPUT_REL_TOL = 1e-9
"""Phase two keeps the served rate within this relative tolerance of phase one's maximum."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """Which replica serves how much of each workload type; rows are replicas, columns types."""

    replica_ids: tuple[str, ...]
    type_names: tuple[str, ...]
    demand_rps: tuple[float, ...]
    """Arrival rate of each type, requests/s (lambda_j)."""
    rates_rps: tuple[tuple[float, ...], ...]
    """rates_rps[k][j]: requests/s of type j routed to replica k (x[k][j])."""
    capacity_rps: tuple[tuple[float, ...], ...]
    """capacity_rps[k][j]: requests/s of type j replica k sustains alone at saturation (n[k][j])."""

    def __post_init__(self) -> None:
        num_k, num_j = len(self.replica_ids), len(self.type_names)
        if len(self.demand_rps) != num_j:
            raise ConfigError(f"Assignment: {len(self.demand_rps)} demand rates for {num_j} types")
        for name, matrix in (("rates_rps", self.rates_rps), ("capacity_rps", self.capacity_rps)):
            if len(matrix) != num_k or any(len(row) != num_j for row in matrix):
                raise ConfigError(f"Assignment: {name} must be {num_k} x {num_j}")

    @classmethod
    def empty(cls, type_names: Sequence[str] = (), demand_rps: Sequence[float] | None = None) -> Assignment:
        """No replica, nothing served."""
        demand = tuple(float(r) for r in demand_rps) if demand_rps is not None else (0.0,) * len(type_names)
        return cls((), tuple(type_names), demand, (), ())

    @property
    def served_rps(self) -> float:
        """Total requests/s served."""
        return float(sum(sum(row) for row in self.rates_rps))

    @property
    def served_by_type_rps(self) -> tuple[float, ...]:
        return tuple(float(sum(row[j] for row in self.rates_rps)) for j in range(len(self.type_names)))

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Per replica, sum_j x[k][j] / n[k][j]: the fraction of its capacity in use (<= 1)."""
        return tuple(float(sum(x / n for x, n in zip(xr, nr) if x > 0.0))
                     for xr, nr in zip(self.rates_rps, self.capacity_rps))

    @property
    def peak_utilisation(self) -> float:
        return max(self.utilisation, default=0.0)

    @property
    def fractions(self) -> tuple[tuple[float, ...], ...]:
        """fractions[k][j]: share of type j's arrivals that replica k takes (x / lambda; 0 where lambda is 0).

        A column sums to the served share of that type, at most 1; the router spreads by these weights.
        """
        return tuple(tuple(x / lam if lam > 0.0 else 0.0 for x, lam in zip(row, self.demand_rps))
                     for row in self.rates_rps)

    def rate(self, replica_id: str, type_name: str) -> float:
        return self.rates_rps[self.replica_ids.index(replica_id)][self.type_names.index(type_name)]


def _as_inputs(rates: Sequence[float], capacity: Sequence[Sequence[float]],
               caps: Sequence[Sequence[float]] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lam = np.asarray(rates, dtype=float).reshape(-1)
    n = np.asarray(capacity, dtype=float)
    if n.size == 0:
        n = n.reshape(0, lam.size)
    if n.ndim != 2 or n.shape[1] != lam.size:
        raise ConfigError(f"capacity must be a replicas x types matrix with {lam.size} columns, got shape {n.shape}")
    if not np.all(np.isfinite(lam)) or np.any(lam < 0):
        raise ConfigError(f"rates must be finite and >= 0, got {lam.tolist()}")
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ConfigError("capacity n[k][j] must be finite and >= 0 (0: the replica cannot serve that type)")
    if caps is None:
        e = np.full(n.shape, np.inf)
    else:
        e = np.asarray(caps, dtype=float)
        if e.shape != n.shape:
            raise ConfigError(f"caps must have the capacity's shape {n.shape}, got {e.shape}")
        if np.any(np.isnan(e)) or np.any(e < 0):
            raise ConfigError("caps e[k][j] must be >= 0 (inf: no cap)")
    return lam, n, e


def _linprog(c, a_ub, b_ub, bounds, what: str):
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0 or res.x is None:
        raise InfeasibleError(f"{what}: HiGHS stopped with status {res.status}: {res.message}")
    return res


def make_exact(x: np.ndarray, lam: np.ndarray, n: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Clip and scale a near-feasible x down until C1-C3 hold in floating point. Pure.

    Scaling only lowers rates, so fixing C1 (per type) and then C3 (per replica) keeps C1 and C2.
    """
    x = np.clip(x, 0.0, None)
    x = np.minimum(x, e)
    x[n <= 0.0] = 0.0
    for j in range(x.shape[1]):
        total = x[:, j].sum()
        if total > lam[j]:
            x[:, j] *= lam[j] / total if total > 0 else 0.0
            factor = 1.0 - 1e-15
            while x[:, j].sum() > lam[j]:  # rounding of the product can overshoot by an ulp
                x[:, j] *= factor
                factor *= factor  # shrinks faster each time, so even denormals get there
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(n > 0.0, 1.0 / np.where(n > 0.0, n, 1.0), 0.0)
    for k in range(x.shape[0]):
        util = float(x[k] @ inv[k])
        if util > 1.0:
            x[k] /= util
            factor = 1.0 - 1e-15
            while float(x[k] @ inv[k]) > 1.0:
                x[k] *= factor
                factor *= factor
    return x


def assign(rates: Sequence[float], capacity: Sequence[Sequence[float]],
           caps: Sequence[Sequence[float]] | None = None, *,
           replica_ids: Sequence[str] | None = None, type_names: Sequence[str] | None = None) -> Assignment:
    """The assignment serving the most requests under C1-C3, lowest peak utilisation among those. Pure.

    Args:
        rates: lambda_j, requests/s of each type.
        capacity: n[k][j] >= 0, requests/s of type j replica k sustains alone (0: cannot serve it).
        caps: e[k][j] >= 0, the most of type j replica k may take (inf or None: no cap).
        replica_ids, type_names: labels; default "r0".. and "t0"...
    """
    lam, n, e = _as_inputs(rates, capacity, caps)
    num_k, num_j = n.shape
    rids = tuple(replica_ids) if replica_ids is not None else tuple(f"r{k}" for k in range(num_k))
    names = tuple(type_names) if type_names is not None else tuple(f"t{j}" for j in range(num_j))
    if len(rids) != num_k or len(names) != num_j:
        raise ConfigError(f"assign: {len(rids)} replica ids and {len(names)} type names for a "
                          f"{num_k} x {num_j} capacity matrix")
    x = _solve(lam, n, e) if num_k and num_j else np.zeros((num_k, num_j))
    return Assignment(rids, names, tuple(float(v) for v in lam),
                      tuple(tuple(float(v) for v in row) for row in x),
                      tuple(tuple(float(v) for v in row) for row in n))


def _solve(lam: np.ndarray, n: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Both phases. Each LP is solved on rates scaled to order one (rates, capacities and caps divided
    by one factor leave the problem the same up to that factor), so HiGHS's absolute tolerances act as
    relative ones."""
    num_k, num_j = n.shape
    num_x = num_k * num_j  # x flattened replica-major: index k * num_j + j
    usable = (n > 0.0) & (lam[None, :] > 0.0)
    inv_n = np.where(usable, 1.0 / np.where(n > 0.0, n, 1.0), 0.0)
    # C1 rows: one per type; C3 rows: one per replica. In units of `scale` the rates are x / scale and
    # the capacities n / scale, so a C3 coefficient is scale / n.
    rows_c1 = csr_array((np.ones(num_x), (np.tile(np.arange(num_j), num_k), np.arange(num_x))),
                        shape=(num_j, num_x))

    def rows_c3(scale: float) -> csr_array:
        return csr_array(((inv_n * scale).reshape(-1), (np.repeat(np.arange(num_k), num_j), np.arange(num_x))),
                         shape=(num_k, num_x))

    def bounds_for(scale: float) -> np.ndarray:
        upper = np.where(usable, e / scale, 0.0).reshape(-1)
        return np.column_stack([np.zeros(num_x), upper])

    scale1 = float(lam.max())
    if scale1 <= 0.0:
        return np.zeros((num_k, num_j))
    a_ub = vstack([rows_c1, rows_c3(scale1)]).tocsr()
    first = _linprog(-np.ones(num_x), a_ub, np.concatenate([lam / scale1, np.ones(num_k)]), bounds_for(scale1),
                     "assignment phase 1")
    x = first.x * scale1
    best = -float(first.fun) * scale1
    if best > 1e-12 * scale1:  # (below that, scaling by it would overflow; nothing worth spreading)
        # Phase two over (x, u), scaled by the best throughput: minimise u subject to
        # sum_j x/n - u <= 0 and served >= 1 - tol.
        u_col = csr_array(np.concatenate([np.zeros(num_j), -np.ones(num_k), [0.0]]).reshape(-1, 1))
        served_row = csr_array(-np.ones((1, num_x)))
        a2 = hstack([vstack([rows_c1, rows_c3(best), served_row]), u_col]).tocsr()
        b2 = np.concatenate([lam / best, np.zeros(num_k), [-(1.0 - THROUGHPUT_REL_TOL)]])
        c2 = np.zeros(num_x + 1)
        c2[-1] = 1.0
        bounds2 = np.vstack([bounds_for(best), [[0.0, 1.0]]])
        res = linprog(c2, A_ub=a2, b_ub=b2, bounds=bounds2, method="highs")
        if res.status == 0 and res.x is not None and res.x[:num_x].sum() >= 1.0 - 1e-7:
            x = res.x[:num_x] * best
    return make_exact(x.reshape(num_k, num_j), lam, n, e)


def violations(assignment: Assignment, caps: Sequence[Sequence[float]] | None = None,
               rel_tol: float = 1e-9) -> list[str]:
    """Which of C1-C3 (and x >= 0) an assignment breaks beyond `rel_tol`; empty when none. Pure."""
    lam = np.asarray(assignment.demand_rps, dtype=float)
    x = np.asarray(assignment.rates_rps, dtype=float).reshape(len(assignment.replica_ids), lam.size)
    n = np.asarray(assignment.capacity_rps, dtype=float).reshape(x.shape)
    problems = []
    if np.any(x < 0):
        problems.append("negative rate")
    for j, name in enumerate(assignment.type_names):
        if x[:, j].sum() > lam[j] * (1 + rel_tol) + rel_tol * 1e-3:
            problems.append(f"C1: type {name} gets {x[:, j].sum()!r} > rate {lam[j]!r}")
    if caps is not None:
        e = np.asarray(caps, dtype=float)
        bad = x > e * (1 + rel_tol)
        if np.any(bad):
            problems.append(f"C2: {int(bad.sum())} pairs above their cap")
    for k, rid in enumerate(assignment.replica_ids):
        if np.any((n[k] <= 0) & (x[k] > 0)):
            problems.append(f"replica {rid} serves a type it has no capacity for")
            continue
        util = sum(x[k, j] / n[k, j] for j in range(lam.size) if x[k, j] > 0)
        if util > 1 + rel_tol:
            problems.append(f"C3: replica {rid} utilisation {util!r} > 1")
    if not math.isfinite(assignment.served_rps):
        problems.append("served rate is not finite")
    return problems
