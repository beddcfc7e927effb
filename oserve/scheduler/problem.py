"""The deployment problem the searches share, and the exact evaluation of a multiset of shapes. Pure.

Replicas of the same shape are interchangeable, so a deployment is evaluated on shape counts c_s: the
flows y[s][j] to all replicas of shape s obey sum_j y[s][j] / n[s][j] <= c_s, and splitting them evenly
over the c_s replicas gives a per-replica assignment meeting C1-C3 with the same throughput and the
lowest peak utilisation among those replicas. That is exact: any per-replica assignment sums to such
flows, and the even split minimises the largest of the group's utilisations.

Evaluation of counts c (see `evaluate`):
1. max alpha s.t. sum_s y[s][j] = alpha * lambda_j, sum_j y[s][j] / n[s][j] <= c_s. If alpha >= 1 the
   deployment serves all demand, and 1/alpha is the least possible peak utilisation while doing so
   (scale a solution with peak u by 1/u). One LP gives both throughput and tie-break.
2. Otherwise max sum y. With every n[s][j] > 0 (the capacity contract) every replica is then saturated
   (a replica with room left could take more of an unserved type), so the peak utilisation is 1 for
   every max-throughput assignment and there is nothing to tie-break.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from scipy.optimize import linprog

from oserve.errors import ConfigError, InfeasibleError, UnknownNameError
from oserve.scheduler.assignment import Assignment, make_exact
from oserve.scheduler.packing import can_pack
from oserve.specs import ClusterSpec, Deployment, MemoryConfig, ModelSpec, ReplicaShape, shape_problems, valid_shapes

CapacityFn = Callable[[ReplicaShape, int], float]
"""(shape, type index) -> requests/s one replica of that shape sustains for that type alone."""

REL_TOL = 1e-9
"""Throughputs within this relative distance are equal; the peak utilisation breaks the tie."""


def capacity_fn(capacity: object) -> CapacityFn:
    """A capacity callable from a callable or from anything with a `rate(shape, type_index)` method
    (`oserve.capacity.CapacityTable`)."""
    rate = getattr(capacity, "rate", None)
    if callable(rate):
        return rate
    if callable(capacity):
        return capacity  # type: ignore[return-value]
    raise ConfigError(f"capacity must be callable(shape, type_index) or have a rate() method, got {capacity!r}")


def resolve_rates(rates: Mapping[str, float] | Sequence[float],
                  type_names: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """(type names, rates in that order) from a name -> rate mapping or a sequence. Pure.

    Raises:
        UnknownNameError: a mapping names a type not in `type_names`.
        ConfigError: a type has no rate, a rate is negative or not finite, or the lengths differ.
    """
    if isinstance(rates, Mapping):
        names = tuple(type_names) if type_names is not None else tuple(rates)
        unknown = [k for k in rates if k not in names]
        if unknown:
            raise UnknownNameError("workload type", unknown[0], names)
        missing = [k for k in names if k not in rates]
        if missing:
            raise ConfigError(f"no rate given for workload type(s) {', '.join(missing)} (types: {', '.join(names)})")
        values = [rates[k] for k in names]
    else:
        values = list(rates)
        names = tuple(type_names) if type_names is not None else tuple(f"t{j}" for j in range(len(values)))
        if len(values) != len(names):
            raise ConfigError(f"{len(values)} rates for {len(names)} workload types {names}")
    out = []
    for name, v in zip(names, values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"rate of {name} is not a number: {v!r}") from None
        if not math.isfinite(f) or f < 0:
            raise ConfigError(f"rate of {name} must be finite and >= 0 requests/s, got {v!r}")
        out.append(f)
    if not names:
        raise ConfigError("no workload types given")
    return names, tuple(out)


@dataclass(frozen=True)
class PlanningProblem:
    """What every deployment search is given: candidate shapes with their capacities, demand, cluster."""

    cluster: ClusterSpec
    shapes: tuple[ReplicaShape, ...]
    """Candidate replica shapes (each fits the model; TP within a node)."""
    type_names: tuple[str, ...]
    demand_rps: tuple[float, ...]
    """lambda_j, requests/s per type."""
    capacity_rps: tuple[tuple[float, ...], ...]
    """capacity_rps[s][j]: n for shape s and type j, > 0 and finite."""
    model_name: str = ""

    def __post_init__(self) -> None:
        if not self.shapes:
            raise InfeasibleError(f"no replica shape of {self.model_name or 'the model'} fits on "
                                  f"{self.cluster.num_gpus} GPU(s)")
        if len(set(self.shapes)) != len(self.shapes):
            raise ConfigError(f"PlanningProblem: a shape is listed twice in {[str(s) for s in self.shapes]}")
        if len(self.demand_rps) != len(self.type_names):
            raise ConfigError("PlanningProblem: demand_rps and type_names differ in length")
        n = np.asarray(self.capacity_rps, dtype=float)
        if n.shape != (len(self.shapes), len(self.type_names)):
            raise ConfigError(f"PlanningProblem: capacity must be {len(self.shapes)} x {len(self.type_names)}, "
                              f"got {n.shape}")
        if not np.all(np.isfinite(n)) or np.any(n <= 0):
            bad = [(str(self.shapes[s]), self.type_names[j]) for s, j in zip(*np.nonzero(~(np.isfinite(n) & (n > 0))))]
            raise ConfigError(f"capacity must be > 0 and finite for every shape and type; bad: {bad[:4]}")
        if any(not math.isfinite(r) or r < 0 for r in self.demand_rps):
            raise ConfigError(f"demand rates must be finite and >= 0, got {self.demand_rps}")
        for s in self.shapes:
            if s.tp > self.cluster.gpus_per_node or s.num_gpus > self.cluster.num_gpus:
                raise ConfigError(f"shape {s} does not fit the cluster {self.cluster.name}")

    @classmethod
    def build(cls, model: ModelSpec, cluster: ClusterSpec, rates: Mapping[str, float] | Sequence[float],
              capacity: object, *, type_names: Sequence[str] | None = None,
              memory: MemoryConfig = MemoryConfig(),
              shapes: Sequence[ReplicaShape] | None = None) -> PlanningProblem:
        """The problem for a model on a cluster; shapes default to every valid one. Pure but for capacity.

        `capacity` is a `CapacityFn` or has `rate(shape, type_index)` (and then, if `type_names` is not
        given, its `type_names` name the types, and if `shapes` is not given, its `shapes(max_gpus)`
        lists the candidates).
        """
        if type_names is None:
            type_names = getattr(capacity, "type_names", None)
        names, lam = resolve_rates(rates, type_names)
        if shapes is None:
            table_shapes = getattr(capacity, "shapes", None)
            if callable(table_shapes):  # a CapacityTable knows which shapes it rates (and its memory rules)
                shapes = tuple(s for s in table_shapes(cluster.num_gpus) if s.tp <= cluster.gpus_per_node)
            else:
                shapes = valid_shapes(model, cluster.gpu, cluster.gpus_per_node, cluster.num_gpus, memory)
        else:
            for s in shapes:  # shapes handed in are checked against the model like the defaults are
                why = shape_problems(model, cluster.gpu, s, cluster.gpus_per_node, memory)
                if why:
                    raise ConfigError(f"shape {s} cannot serve {model.name}: {why[0]}")
        if not shapes:
            smallest = min(cluster.gpus_per_node, cluster.num_gpus)
            why = shape_problems(model, cluster.gpu, ReplicaShape(smallest, max(1, cluster.num_gpus // smallest)),
                                 cluster.gpus_per_node, memory)
            raise InfeasibleError(f"{model.name} fits on no replica of the {cluster.num_gpus}-GPU cluster "
                                  f"{cluster.name}" + (f": {why[0]}" if why else ""))
        rate = capacity_fn(capacity)
        n = tuple(tuple(float(rate(s, j)) for j in range(len(names))) for s in shapes)
        return cls(cluster, tuple(shapes), names, lam, n, model.name)

    @cached_property
    def n(self) -> np.ndarray:
        return np.asarray(self.capacity_rps, dtype=float)

    @cached_property
    def lam(self) -> np.ndarray:
        return np.asarray(self.demand_rps, dtype=float)

    @cached_property
    def total_demand_rps(self) -> float:
        return float(self.lam.sum())

    @cached_property
    def gpus(self) -> np.ndarray:
        return np.array([s.num_gpus for s in self.shapes])

    @cached_property
    def _stage_matrix(self) -> tuple[tuple[int, ...], np.ndarray]:
        tps = tuple(sorted({s.tp for s in self.shapes}))
        m = np.array([[s.pp if s.tp == t else 0 for s in self.shapes] for t in tps], dtype=np.int64)
        return tps, m

    def packs(self, counts: Sequence[int] | np.ndarray) -> bool:
        """Whether counts per shape can be placed on the cluster (exact, memoised)."""
        tps, m = self._stage_matrix
        stages = m @ np.asarray(counts, dtype=np.int64)
        return can_pack(dict(zip(tps, stages.tolist())), self.cluster.num_nodes, self.cluster.gpus_per_node)

    def shape_list(self, counts: Sequence[int]) -> list[ReplicaShape]:
        return [s for s, c in zip(self.shapes, counts) for _ in range(c)]

    def evaluate(self, counts: Sequence[int] | np.ndarray) -> Evaluation:
        """Throughput, peak utilisation and flows per shape for counts per shape (see `evaluate_counts`)."""
        return evaluate_counts(self.lam, self.n, np.asarray(counts, dtype=int))

    def dominated_shapes(self) -> tuple[int, ...]:
        """Indices of shapes some other shape makes redundant (exact; see `dominates`)."""
        out = []
        for b in range(len(self.shapes)):
            for a in range(len(self.shapes)):
                if a != b and dominates(self.shapes[a], self.n[a], self.shapes[b], self.n[b]) and (
                        not dominates(self.shapes[b], self.n[b], self.shapes[a], self.n[a]) or a < b):
                    out.append(b)
                    break
        return tuple(out)


def dominates(sa: ReplicaShape, na: np.ndarray, sb: ReplicaShape, nb: np.ndarray) -> bool:
    """Whether m replicas of shape A can stand in for one of B in any deployment, weakly better. Pure.

    True when A's TP divides B's (A's stages then fit in B's TP slots), m * gpus(A) <= gpus(B) and
    m * n_A >= n_B for every type, for some m >= 1: the m replicas can carry any load B carries, at a
    utilisation no higher, on a subset of B's GPUs. So an optimum never needs B.
    """
    if sb.tp % sa.tp:
        return False
    m = sb.num_gpus // sa.num_gpus
    return m >= 1 and bool(np.all(m * na >= nb))


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The best assignment for shape counts: served requests/s, peak utilisation, flows per shape."""

    throughput_rps: float
    peak_utilisation: float
    flows_rps: np.ndarray = field(compare=False)
    """flows_rps[s][j]: requests/s of type j to all replicas of shape s together."""
    type_values: np.ndarray | None = field(default=None, compare=False)
    """A dual solution of the LP: the value of one more request/s of capacity per type (see DualCuts)."""

    def better_than(self, other: Evaluation | None) -> bool:
        """Higher throughput, or equal throughput (REL_TOL) and lower peak utilisation."""
        if other is None:
            return True
        scale = max(1.0, abs(other.throughput_rps))
        if self.throughput_rps > other.throughput_rps + REL_TOL * scale:
            return True
        if self.throughput_rps < other.throughput_rps - REL_TOL * scale:
            return False
        return self.peak_utilisation < other.peak_utilisation - REL_TOL


class DualCuts:
    """Cheap exact bounds on a shape multiset's evaluation, from LP dual solutions seen so far.

    For any v in [0, 1]^J (v_j: value of serving one more request/s of type j), weak duality gives
        throughput(c) <= sum_j lambda_j (1 - v_j) + sum_s c_s max_j n[s][j] v_j
    and, for any v >= 0, serving all demand needs peak utilisation
        peak(c) >= sum_j lambda_j v_j / sum_s c_s max_j n[s][j] v_j.
    Unit vectors and all-ones seed the pool; each LP solved adds its dual. A search may skip a multiset
    whose bound already loses: the bounds are valid for every v, so skipping stays exact.
    """

    def __init__(self, lam: np.ndarray, n: np.ndarray, max_cuts: int = 64) -> None:
        self.lam = lam
        self.n = n
        self.max_cuts = max_cuts
        seeds = [np.eye(lam.size)[j] for j in range(lam.size)] + [np.ones(lam.size)]
        self._v = np.array(seeds)
        self._refresh()

    def _refresh(self) -> None:
        self._slope = (self.n[None, :, :] * self._v[:, None, :]).max(axis=2)  # cut -> shape -> max_j n v
        self._const = (self.lam[None, :] * (1.0 - self._v)).sum(axis=1)
        self._demand = self._v @ self.lam

    def add(self, v: np.ndarray | None) -> None:
        if v is None or not np.all(np.isfinite(v)) or v.max() <= 0:
            return
        v = np.clip(v / v.max(), 0.0, 1.0)
        if np.any(np.abs(self._v - v).max(axis=1) < 1e-9):
            return
        keep = self._v[: self.lam.size + 1]
        extra = self._v[self.lam.size + 1:][-(self.max_cuts - 1):]
        self._v = np.vstack([keep, extra, v[None, :]])
        self._refresh()

    def upper_throughput(self, counts: np.ndarray) -> float:
        return float(min((self._const + self._slope @ counts).min(), self.lam.sum()))

    def lower_peak(self, counts: np.ndarray) -> float:
        cap = self._slope @ counts
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(cap > 0, self._demand / np.where(cap > 0, cap, 1.0), np.inf)
        return float(ratio.max())

    def cannot_beat(self, counts: np.ndarray, incumbent: Evaluation | None) -> bool:
        """Whether `counts` surely does not evaluate better than `incumbent` (Evaluation.better_than)."""
        if incumbent is None:
            return False
        total = float(self.lam.sum())
        scale = max(1.0, abs(incumbent.throughput_rps))
        upper = self.upper_throughput(counts)
        if upper < incumbent.throughput_rps - REL_TOL * scale:
            return True
        if upper > incumbent.throughput_rps + REL_TOL * scale:
            return False
        # At best a throughput tie. Below full service every replica is saturated (peak 1), so a tie
        # cannot win; at full service it wins only with a lower peak.
        if incumbent.throughput_rps < total * (1 - REL_TOL):
            return incumbent.peak_utilisation <= 1.0 + REL_TOL
        return self.lower_peak(counts) >= incumbent.peak_utilisation - REL_TOL


class Evaluator:
    """One search run's evaluations: memoised by shape counts, each LP's dual kept as a cut."""

    def __init__(self, problem: PlanningProblem) -> None:
        self.problem = problem
        self.cuts = DualCuts(problem.lam, problem.n)
        self._memo: dict[tuple[int, ...], Evaluation] = {}  # counts -> evaluation

    def __call__(self, counts: Sequence[int] | np.ndarray) -> Evaluation:
        key = tuple(int(c) for c in counts)
        hit = self._memo.get(key)
        if hit is None:
            hit = self.problem.evaluate(key)
            self._memo[key] = hit
            self.cuts.add(hit.type_values)
        return hit

    @property
    def num_evaluated(self) -> int:
        """Distinct shape multisets evaluated by LP so far."""
        return len(self._memo)


def _lp_matrices(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense rows over y[s][j] (shape-major): per-type sums (J x SJ) and per-shape utilisation (S x SJ)."""
    num_s, num_j = n.shape
    types = np.tile(np.eye(num_j), (1, num_s))
    util = np.zeros((num_s, num_s * num_j))
    for s in range(num_s):
        util[s, s * num_j:(s + 1) * num_j] = 1.0 / n[s]
    return types, util


def _alpha_lp(lam: np.ndarray, n: np.ndarray, c: np.ndarray):
    """max alpha: sum_s y_sj - alpha lambda_j = 0, sum_j y_sj / n_sj <= c_s. Returns (y, alpha, duals)."""
    types, util = _lp_matrices(n)
    num_y = types.shape[1]
    obj = np.zeros(num_y + 1)
    obj[-1] = -1.0
    res = linprog(obj, A_ub=np.hstack([util, np.zeros((util.shape[0], 1))]), b_ub=c.astype(float),
                  A_eq=np.hstack([types, -lam[:, None]]), b_eq=np.zeros(lam.size), bounds=(0, None), method="highs")
    if res.status != 0 or res.x is None:
        raise InfeasibleError(f"evaluation LP failed: {res.message}")
    return res.x[:-1].reshape(n.shape), float(res.x[-1]), np.clip(np.asarray(res.eqlin.marginals), 0.0, None)


def _throughput_lp(lam: np.ndarray, n: np.ndarray, c: np.ndarray):
    """max sum y: sum_s y_sj <= lambda_j, sum_j y_sj / n_sj <= c_s. Returns (y, duals v = 1 - pi)."""
    types, util = _lp_matrices(n)
    res = linprog(-np.ones(types.shape[1]), A_ub=np.vstack([types, util]), b_ub=np.concatenate([lam, c.astype(float)]),
                  bounds=(0, None), method="highs")
    if res.status != 0 or res.x is None:
        raise InfeasibleError(f"evaluation LP failed: {res.message}")
    pi = -np.asarray(res.ineqlin.marginals)[:lam.size]
    return res.x.reshape(n.shape), 1.0 - np.clip(pi, 0.0, 1.0)


def evaluate_counts(lam: np.ndarray, n: np.ndarray, counts: np.ndarray) -> Evaluation:
    """Exact evaluation of shape counts (module docstring). Pure; flows returned meet C1 and C3 exactly."""
    flows = np.zeros(n.shape)
    used_s = np.nonzero(counts > 0)[0]
    used_j = np.nonzero(lam > 0)[0]
    if used_s.size == 0 or used_j.size == 0:
        return Evaluation(0.0, 0.0, flows)
    sub_n = n[np.ix_(used_s, used_j)]
    sub_lam = lam[used_j]
    c = counts[used_s].astype(float)
    values = np.zeros(lam.size)
    # Cheap test first: if even the per-type capacity cannot cover the demand, skip the alpha LP.
    may_serve_all = bool(np.all(c @ sub_n >= sub_lam * (1 - 1e-12)))
    alpha = 0.0
    if may_serve_all:
        y, alpha, v = _alpha_lp(sub_lam, sub_n, c)
    if alpha >= 1.0:
        y = y / alpha
    else:
        y, v = _throughput_lp(sub_lam, sub_n, c)
    values[used_j] = v
    # Exactness: per shape group C3 reads sum_j y/n <= c_s, i.e. per replica with n scaled by c_s.
    y = make_exact(y, sub_lam, sub_n * c[:, None], np.full(sub_n.shape, np.inf))
    flows[np.ix_(used_s, used_j)] = y
    util = (y / sub_n).sum(axis=1) / c
    return Evaluation(float(y.sum()), float(util.max()), flows, values)


def split_assignment(problem: PlanningProblem, deployment: Deployment, evaluation: Evaluation) -> Assignment:
    """Per-replica assignment: each shape's flows split evenly over its replicas in `deployment`. Pure."""
    index = {s: i for i, s in enumerate(problem.shapes)}
    counts = np.zeros(len(problem.shapes), dtype=int)
    for r in deployment.replicas:
        counts[index[r.shape]] += 1
    rows, caps = [], []
    for r in deployment.replicas:
        s = index[r.shape]
        rows.append(evaluation.flows_rps[s] / counts[s])
        caps.append(problem.n[s])
    if not rows:
        return Assignment.empty(problem.type_names, problem.demand_rps)
    x = make_exact(np.array(rows), problem.lam, np.array(caps), np.full((len(rows), len(problem.type_names)), np.inf))
    return Assignment(tuple(r.replica_id for r in deployment.replicas), problem.type_names, problem.demand_rps,
                      tuple(tuple(float(v) for v in row) for row in x),
                      tuple(tuple(float(v) for v in row) for row in caps))
