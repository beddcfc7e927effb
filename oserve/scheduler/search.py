"""Upper level of the scheduler: choose the deployment (replica shapes, counts, placement). Pure.

Three searches behind one interface, `search(name, ...) -> Plan`:

- `exhaustive`: every multiset of shapes that packs on the nodes, each evaluated exactly (the
  reference). It stays exact while skipping three kinds of multisets that cannot win:
  non-maximal ones (adding a replica never lowers the throughput nor raises the least peak
  utilisation, so some maximal superset is at least as good), ones using a dominated shape (see
  `problem.dominates`: m replicas of a smaller shape that carry whatever it carries), and ones whose
  throughput upper bound (or, on a throughput tie, peak-utilisation lower bound) already loses to the
  best found.
- `paper`: the paper's flow-guided generation: start from uniform pure-TP replicas of the smallest size
  that fits the model; each iteration reads the saturated (bottleneck) and least-used replicas off the
  flow, moves GPUs from a least-used replica (dissolving or shrinking it) to a bottleneck one, tries
  every TP/PP of the changed replicas, and moves to the best candidate not seen before; it returns the
  best deployment seen and stops after `paper_patience` iterations without improvement.
- `milp`: an exact mixed-integer program (HiGHS through scipy's `milp`) over integer counts c_s of each
  shape and continuous flows y[s][j] to each shape, with the assignment constraints aggregated per shape
  (sum_j y[s][j] / n[s][j] <= c_s; replicas of one shape are interchangeable) and node packing (GPU
  count, and where TP sizes do not form a divisibility chain, integer counts of nodes per maximal node
  pattern). Phase one maximises the throughput; if that serves all demand, phase two maximises alpha,
  the factor by which the demand could grow and still be served (peak utilisation 1/alpha), over counts
  and flows together. If demand exceeds what can be served every replica is saturated whatever the
  deployment, so there is no tie to break.
  An optional phase three (`SearchConfig.fewer_replicas_slack`, off by default) gives up to that
  fraction of alpha for the fewest replicas; the simulator's OServe policy turns it on.

Every search returns the replicas placed on physical GPUs (`packing.place`) and the per-replica
assignment (each shape's flows split evenly over its replicas). Among equal throughputs (relative
1e-9) the lower peak utilisation wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array, hstack, vstack

from oserve.errors import ConfigError, InfeasibleError, UnknownNameError
from oserve.scheduler.assignment import Assignment
from oserve.scheduler.packing import highs_quiet, is_divisible_chain, node_patterns, place
from oserve.scheduler.problem import REL_TOL, Evaluator, PlanningProblem, split_assignment
from oserve.specs import ClusterSpec, Deployment, MemoryConfig, ModelSpec, ReplicaShape

SEARCHES = ("milp", "paper", "exhaustive")



@dataclass(frozen=True, slots=True)
class SearchConfig:
    """Knobs of the deployment searches."""

    paper_patience: int = 20
    """The paper search stops after this many iterations without a better deployment."""
    paper_max_iterations: int = 200
    """Hard cap on the paper search's iterations."""
    paper_branching: int = 3
    """Bottleneck and under-used replica groups tried per iteration (each)."""
    exhaustive_max_gpus: int = 16
    """The exhaustive search refuses larger clusters (its run time grows exponentially)."""
    milp_time_limit_s: float = 60.0
    """Per MILP phase; on hitting it the best solution found so far is used."""
    milp_rel_gap: float = 1e-7
    """Relative optimality gap HiGHS must close (its default, 1e-4, is too loose for exactness)."""
    fewer_replicas_slack: float = 0.0
    """milp only. When > 0 and all demand is served, a third phase trades up to this fraction of phase
    two's headroom (alpha) for the fewest replicas: near-equal capacities are common (Llama-2-70B's
    shapes lie within a few percent per GPU), and among them fewer, larger replicas pool bursts and
    keep their batches' tails shorter. 0 keeps the search exact."""

    def __post_init__(self) -> None:
        if self.paper_patience < 1 or self.paper_max_iterations < 1 or self.paper_branching < 1:
            raise ConfigError(f"SearchConfig: paper iteration limits must be >= 1, got {self.paper_patience}, "
                              f"{self.paper_max_iterations}, {self.paper_branching}")
        if self.exhaustive_max_gpus < 1:
            raise ConfigError(f"SearchConfig: exhaustive_max_gpus must be >= 1, got {self.exhaustive_max_gpus}")
        if not 0 <= self.fewer_replicas_slack < 1:
            raise ConfigError(f"SearchConfig: fewer_replicas_slack must be in [0, 1), got {self.fewer_replicas_slack}")
        if not self.milp_time_limit_s > 0 or not 0 <= self.milp_rel_gap < 1:
            raise ConfigError(f"SearchConfig: milp_time_limit_s must be > 0 and milp_rel_gap in [0, 1), got "
                              f"{self.milp_time_limit_s}, {self.milp_rel_gap}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A search's answer: the placed deployment, its assignment and how good it is."""

    search: str
    deployment: Deployment
    assignment: Assignment
    throughput_rps: float
    """Requests/s served (the assignment's total)."""
    peak_utilisation: float
    """Largest replica utilisation in the assignment."""
    demand_rps: float
    """Requests/s arriving, all types."""
    solve_s: float
    """Wall time the search took."""
    evaluations: int = 0
    """Shape multisets the search evaluated by LP (the MILP's own solves not counted)."""

    @classmethod
    def empty(cls, search: str = "none") -> Plan:
        return cls(search, Deployment.empty(), Assignment.empty(), 0.0, 0.0, 0.0, 0.0)

    @property
    def served_frac(self) -> float:
        return self.throughput_rps / self.demand_rps if self.demand_rps > 0 else 1.0


def search(name: str, model: ModelSpec, cluster: ClusterSpec, rates: Mapping[str, float] | Sequence[float],
           capacity: object, *, type_names: Sequence[str] | None = None, memory: MemoryConfig = MemoryConfig(),
           shapes: Sequence[ReplicaShape] | None = None, config: SearchConfig = SearchConfig(),
           timer: Callable[[], float] = time.perf_counter) -> Plan:
    """The deployment and assignment the named search finds for per-type rates. Pure but for `timer`.

    Args:
        name: "milp", "paper" or "exhaustive".
        rates: requests/s per type, by type name (or a sequence in `type_names` order).
        capacity: a `CapacityFn` (shape, type index) -> requests/s, or an object with
            `rate(shape, type_index)` and `type_names` (`oserve.capacity.CapacityTable`).
        type_names: the types, in capacity's index order; default capacity.type_names or the mapping's keys.
        shapes: candidate shapes; default every valid shape of the model on the cluster.
        timer: monotonic seconds, read twice to report the solve time.

    Raises:
        UnknownNameError: unknown search or workload type. ConfigError: bad rates.
        InfeasibleError: the model fits on no replica of the cluster.
    """
    check_search_name(name)
    problem = PlanningProblem.build(model, cluster, rates, capacity, type_names=type_names, memory=memory,
                                    shapes=shapes)
    return search_problem(name, problem, config=config, timer=timer)


def check_search_name(name: str) -> str:
    """`name` if it names a search; UnknownNameError listing the searches otherwise."""
    if name not in SEARCHES:
        raise UnknownNameError("search", name, SEARCHES)
    return name


def check_search_fits(name: str, num_gpus: int, config: SearchConfig = SearchConfig()) -> None:
    """ConfigError when the named search refuses a cluster of `num_gpus` (exhaustive beyond its limit)."""
    if check_search_name(name) == "exhaustive" and num_gpus > config.exhaustive_max_gpus:
        raise ConfigError(f"the exhaustive search is limited to {config.exhaustive_max_gpus} GPUs "
                          f"(got {num_gpus}); use milp or paper")


def search_problem(name: str, problem: PlanningProblem, *, config: SearchConfig = SearchConfig(),
                   timer: Callable[[], float] = time.perf_counter) -> Plan:
    """Run the named search on a built problem (what `search` does after building it)."""
    fn = {"milp": _milp_counts, "paper": _paper_counts, "exhaustive": _exhaustive_counts}[check_search_name(name)]
    start = timer()
    evaluate = Evaluator(problem)
    counts = _complete(problem, fn(problem, config, evaluate), evaluate)
    deployment = place(problem.shape_list(counts), problem.cluster)
    assignment = split_assignment(problem, deployment, evaluate(counts))
    elapsed = timer() - start
    return Plan(name, deployment, assignment, assignment.served_rps, assignment.peak_utilisation,
                problem.total_demand_rps, elapsed, evaluate.num_evaluated)


def _complete(problem: PlanningProblem, counts: np.ndarray, evaluate: Evaluator) -> np.ndarray:
    """Add replicas while any shape still packs, the best-evaluated first (never makes a plan worse)."""
    counts = np.array(counts, dtype=int)
    while True:
        best, best_ev = None, None
        for s in range(len(problem.shapes)):
            trial = counts.copy()
            trial[s] += 1
            if not problem.packs(trial):
                continue
            ev = evaluate(trial)
            key_better = best_ev is None or ev.better_than(best_ev) or (
                not best_ev.better_than(ev) and _capacity_per_gpu(problem, s) > _capacity_per_gpu(problem, best))
            if key_better:
                best, best_ev = s, ev
        if best is None:
            return counts
        counts[best] += 1


def _capacity_per_gpu(problem: PlanningProblem, s: int) -> float:
    weights = problem.lam if problem.total_demand_rps > 0 else np.ones(len(problem.type_names))
    return float(weights @ problem.n[s]) / problem.shapes[s].num_gpus


# --- exhaustive -------------------------------------------------------------------------------------------------


def _exhaustive_counts(problem: PlanningProblem, config: SearchConfig, evaluate: Evaluator) -> np.ndarray:
    check_search_fits("exhaustive", problem.cluster.num_gpus, config)
    dominated = set(problem.dominated_shapes())
    keep = [s for s in range(len(problem.shapes)) if s not in dominated]
    num_gpus = problem.cluster.num_gpus
    counts = np.zeros(len(problem.shapes), dtype=int)
    best: list = [None, None]  # [counts, Evaluation]
    cuts = evaluate.cuts

    def maximal() -> bool:
        for s in keep:
            counts[s] += 1
            fits = problem.packs(counts)
            counts[s] -= 1
            if fits:
                return False
        return True

    def leaf() -> None:
        if not maximal() or cuts.cannot_beat(counts, best[1]):
            return
        ev = evaluate(counts)
        if ev.better_than(best[1]):
            best[0], best[1] = counts.copy(), ev

    def rec(i: int, gpus_left: int) -> None:
        if i == len(keep):
            leaf()
            return
        s = keep[i]
        g = problem.shapes[s].num_gpus
        for c in range(gpus_left // g, -1, -1):
            counts[s] = c
            if c and not problem.packs(counts):
                continue
            rec(i + 1, gpus_left - c * g)
        counts[s] = 0

    rec(0, num_gpus)
    if best[0] is None:
        raise InfeasibleError("no deployment packs on the cluster")
    return best[0]


# --- the paper's flow-guided generation ----------------------------------------------------------------------


def _start_counts(problem: PlanningProblem) -> np.ndarray:
    """Uniform pure-TP replicas of the smallest size that fits, as many as pack (else the smallest shape)."""
    pure = [s for s, shape in enumerate(problem.shapes) if shape.pp == 1]
    pool = pure or list(range(len(problem.shapes)))
    s0 = min(pool, key=lambda s: (problem.shapes[s].num_gpus, problem.shapes[s].tp))
    counts = np.zeros(len(problem.shapes), dtype=int)
    while True:
        counts[s0] += 1
        if not problem.packs(counts):
            counts[s0] -= 1
            return counts


def _paper_counts(problem: PlanningProblem, config: SearchConfig, evaluate: Evaluator) -> np.ndarray:
    shapes = problem.shapes
    by_size: dict[int, list[int]] = {}
    for s, shape in enumerate(shapes):
        by_size.setdefault(shape.num_gpus, []).append(s)
    num_gpus = problem.cluster.num_gpus
    current = _start_counts(problem)
    best_counts, best_ev = current, evaluate(current)
    cuts = evaluate.cuts
    visited = {tuple(current)}
    stale = 0
    for _ in range(config.paper_max_iterations):
        if stale >= config.paper_patience:
            break
        ev = evaluate(current)
        groups = [s for s in range(len(shapes)) if current[s] > 0]
        util = {s: float((ev.flows_rps[s] / problem.n[s]).sum() / current[s]) for s in groups}
        per_gpu = {s: float(ev.flows_rps[s].sum() / (current[s] * shapes[s].num_gpus)) for s in groups}
        saturated = [s for s in groups if util[s] >= 1 - 1e-6]
        bottlenecks = sorted(saturated or groups, key=lambda s: (-util[s], -per_gpu[s], s))[:config.paper_branching]
        underused = sorted(groups, key=lambda s: (util[s], per_gpu[s], s))[:config.paper_branching]
        free = num_gpus - int(current @ problem.gpus)
        candidates: set[tuple[int, ...]] = set()
        for b in bottlenecks:
            gb = shapes[b].num_gpus
            # Donors: a least-used replica, shrunk to any smaller size or dissolved; or idle GPUs.
            donors: list[tuple[int | None, int]] = [(None, d) for d in range(1, free + 1)]
            for u in underused:
                if u == b and current[u] < 2:
                    continue
                gu = shapes[u].num_gpus
                donors += [(u, gu - size) for size in by_size if size < gu] + [(u, gu)]
            for u, moved in donors:
                if gb + moved not in by_size:
                    continue
                rest_options: list[int | None] = [None]
                if u is not None and moved < shapes[u].num_gpus:
                    rest_options = list(by_size[shapes[u].num_gpus - moved])
                for nb in by_size[gb + moved]:
                    for nu in rest_options:
                        trial = current.copy()
                        trial[b] -= 1
                        trial[nb] += 1
                        if u is not None:
                            trial[u] -= 1
                            if nu is not None:
                                trial[nu] += 1
                        if min(trial) < 0:
                            continue
                        key = tuple(int(c) for c in trial)
                        if key not in visited and problem.packs(trial):
                            candidates.add(key)
        if not candidates:
            break
        # The best candidate, evaluating the most promising first and skipping those bounds rule out.
        order = sorted(candidates, key=lambda k: (-cuts.upper_throughput(np.array(k)), k))
        step_ev, step = None, None
        for k in order:
            trial = np.array(k)
            if cuts.cannot_beat(trial, step_ev):
                continue
            cand_ev = evaluate(trial)
            if cand_ev.better_than(step_ev):
                step_ev, step = cand_ev, k
        current = np.array(step)
        visited.add(step)
        if step_ev.better_than(best_ev):
            best_counts, best_ev, stale = current, step_ev, 0
        else:
            stale += 1
    return best_counts


# --- exact MILP --------------------------------------------------------------------------------------------------


def _milp_counts(problem: PlanningProblem, config: SearchConfig, evaluate: Evaluator) -> np.ndarray:
    # Dominated shapes cannot improve throughput or headroom, but one of them may stand in for several
    # replicas of the shape dominating it, so the fewest-replicas phase needs them all.
    dominated = set(problem.dominated_shapes()) if config.fewer_replicas_slack == 0 else set()
    keep = np.array([s for s in range(len(problem.shapes)) if s not in dominated])
    used_j = np.nonzero(problem.lam > 0)[0]
    if used_j.size == 0:
        return np.zeros(len(problem.shapes), dtype=int)  # nothing to serve; _complete fills the cluster
    shapes = [problem.shapes[s] for s in keep]
    # Rates and capacities in units of the largest rate (sum_j y/n <= c_s does not change), so that
    # HiGHS's absolute tolerances act as relative ones.
    scale = float(problem.lam.max())
    n = problem.n[np.ix_(keep, used_j)] / scale
    lam = problem.lam[used_j] / scale
    cluster = problem.cluster
    num_s, num_j = n.shape
    num_y = num_s * num_j
    tps = sorted({s.tp for s in shapes})
    patterns = () if is_divisible_chain(tps, cluster.gpus_per_node) else node_patterns(tps, cluster.gpus_per_node)
    num_q = len(patterns)
    # Columns: c (num_s) | y (num_y, shape-major) | p (num_q) | alpha (phase two only).
    y_cols = num_s + np.arange(num_y)
    rows_c1 = csr_array((np.ones(num_y), (np.tile(np.arange(num_j), num_s), y_cols)), shape=(num_j, num_s + num_y + num_q))
    c3_data = np.concatenate([(1.0 / n).reshape(-1), -np.ones(num_s)])
    c3_rows = np.concatenate([np.repeat(np.arange(num_s), num_j), np.arange(num_s)])
    c3_cols = np.concatenate([y_cols, np.arange(num_s)])
    rows_c3 = csr_array((c3_data, (c3_rows, c3_cols)), shape=(num_s, num_s + num_y + num_q))
    packing_rows = [csr_array(np.concatenate([[s.num_gpus for s in shapes], np.zeros(num_y + num_q)]).reshape(1, -1))]
    packing_ub = [float(cluster.num_gpus)]
    if num_q:
        for t in tps:
            row = np.zeros(num_s + num_y + num_q)
            row[:num_s] = [s.pp if s.tp == t else 0 for s in shapes]
            row[num_s + num_y:] = [-pat[tps.index(t)] for pat in patterns]
            packing_rows.append(csr_array(row.reshape(1, -1)))
            packing_ub.append(0.0)
        row = np.zeros(num_s + num_y + num_q)
        row[num_s + num_y:] = 1.0
        packing_rows.append(csr_array(row.reshape(1, -1)))
        packing_ub.append(float(cluster.num_nodes))
    packing = vstack(packing_rows).tocsr()
    c_ub = np.array([cluster.num_gpus // s.num_gpus for s in shapes], dtype=float)
    lower = np.zeros(num_s + num_y + num_q)
    upper = np.concatenate([c_ub, np.tile(lam, num_s), np.full(num_q, float(cluster.num_nodes))])
    integrality = np.concatenate([np.ones(num_s), np.zeros(num_y), np.ones(num_q)])
    options = {"time_limit": config.milp_time_limit_s, "mip_rel_gap": config.milp_rel_gap}

    obj = np.concatenate([np.zeros(num_s), -np.ones(num_y), np.zeros(num_q)])
    a1 = vstack([rows_c1, rows_c3, packing]).tocsr()
    ub1 = np.concatenate([lam, np.zeros(num_s), packing_ub])
    with highs_quiet():
        res = milp(obj, constraints=LinearConstraint(a1, -np.inf, ub1), integrality=integrality,
                   bounds=Bounds(lower, upper), options=options)
    if res.x is None:
        raise InfeasibleError(f"deployment MILP found no solution: {res.message}")
    candidates = [res.x]
    served = -float(res.fun)
    total = float(lam.sum())
    if served >= total * (1 - 1e-6):
        # Phase two: max alpha with sum_s y_sj = alpha * lambda_j; peak utilisation is then 1 / alpha.
        # (alpha >= 1 is infeasible, and phase one stands, if phase one fell short of serving all.)
        alpha_ub = float(cluster.num_gpus * max(n[s].max() / shapes[s].num_gpus for s in range(num_s))) / total
        alpha_col = csr_array(np.concatenate([-lam, np.zeros(num_s + packing.shape[0])]).reshape(-1, 1))
        a2 = hstack([vstack([rows_c1, rows_c3, packing]), alpha_col]).tocsr()
        lb2 = np.concatenate([np.zeros(num_j), np.full(num_s + packing.shape[0], -np.inf)])
        ub2 = np.concatenate([np.zeros(num_j), np.zeros(num_s), packing_ub])
        obj2 = np.zeros(num_s + num_y + num_q + 1)
        obj2[-1] = -1.0
        upper2 = np.concatenate([c_ub, np.full(num_y, np.inf), np.full(num_q, float(cluster.num_nodes)),
                                 [max(1.0, alpha_ub)]])
        lower2 = np.concatenate([np.zeros(num_s + num_y + num_q), [1.0]])
        with highs_quiet():
            res2 = milp(obj2, constraints=LinearConstraint(a2, lb2, ub2),
                        integrality=np.concatenate([integrality, [0]]), bounds=Bounds(lower2, upper2),
                        options=options)
        if res2.x is not None:
            candidates.append(res2.x)
            if config.fewer_replicas_slack > 0:
                # Phase three: the fewest replicas keeping alpha >= (1 - slack) x phase two's, and among
                # those the largest alpha (its weight keeps it below one replica).
                floor = max(1.0, float(res2.x[-1]) * (1.0 - config.fewer_replicas_slack))
                obj3 = np.zeros(num_s + num_y + num_q + 1)
                obj3[:num_s] = 1.0
                obj3[-1] = -0.5 / float(upper2[-1])
                lower3 = lower2.copy()
                lower3[-1] = floor
                with highs_quiet():
                    res3 = milp(obj3, constraints=LinearConstraint(a2, lb2, ub2),
                                integrality=np.concatenate([integrality, [0]]), bounds=Bounds(lower3, upper2),
                                options=options)
                if res3.x is not None:
                    counts3 = np.zeros(len(problem.shapes), dtype=int)
                    counts3[keep] = np.round(res3.x[:num_s]).astype(int)
                    if problem.packs(counts3) and evaluate(counts3).peak_utilisation <= (1 + 1e-6) / floor:
                        return counts3  # `_complete` still fills GPUs left free (a replica more each)
    best, best_ev = None, None
    for x in candidates:  # phase two wins unless a time limit cut it short
        counts = np.zeros(len(problem.shapes), dtype=int)
        counts[keep] = np.round(x[:num_s]).astype(int)
        if not problem.packs(counts):
            continue
        ev = evaluate(counts)
        if best_ev is None or not best_ev.better_than(ev):
            best, best_ev = counts, ev
    if best is None:
        raise InfeasibleError("deployment MILP returned counts that do not pack (numerical trouble)")
    return best
