"""Serving policies the simulator compares: OServe, vLLM static, vLLM reload, a Llumnix-like balancer, an oracle.

Pure: each policy turns what it may see at a span boundary (`SpanView`) into a `Decision`. They share
the planning code with the live system (`oserve.scheduler.search`, the capacity table) and differ only
in what they know and what they may deploy:

- `oserve`: forecast of the next span (a forecaster object, or the last span's rates) -> candidate
  deployments from the MILP over every shape, scored on the digital twin -> switch GPU-to-GPU when the
  gain outweighs the capacity lost while switching.
- `oracle`: like `oserve` but with the coming span's true rates and free switching (its switch rule
  weighs the gain against a zero cost; retired replicas finish what they run).
- `vllm-reload`: the best homogeneous deployment for the forecast, each span, reloading from disk.
- `vllm-static`: one homogeneous deployment for the whole trace (the caller picks the best).
- `llumnix`: a homogeneous deployment; every request to the freest replica, running requests migrated
  off overloaded replicas (`oserve.sim.llumnix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from oserve.capacity import CapacityTable, homogeneous_rate
from oserve.errors import ConfigError, InfeasibleError
from oserve.scheduler import Assignment, Plan, assign, search
from oserve.scheduler.packing import place
from oserve.scheduler.search import SearchConfig
from oserve.sim.cluster import Decision, SpanView
from oserve.sim.engine import SimReplica, SimRequest
from oserve.sim.twin import DigitalTwin, Multiset, TwinConfig, local_search
from oserve.specs import ClusterSpec, Deployment, ModelSpec, Replica, ReplicaShape

if TYPE_CHECKING:  # llumnix.py imports this module; `llumnix()` imports it lazily
    from oserve.sim.llumnix import LlumnixPolicy


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """How long replicas are out of service when a deployment changes (the switch planner's models)."""

    engine_start_s: float = 8.0
    """Starting an engine on GPUs that already hold (or are receiving) weights: process start, KV
    allocation, CUDA-graph capture. The paper measures about 10 s for a GPU-to-GPU switch in all."""
    disk_bytes_per_s: float = 3.0e9
    """Per-node storage bandwidth a reload reads weights at (the GPUs of a node share it)."""
    gpu_copy_efficiency: float = 0.8
    """Fraction of the modelled link bandwidth a weight transfer achieves."""

    def __post_init__(self) -> None:
        if self.engine_start_s < 0 or not self.disk_bytes_per_s > 0 or not 0 < self.gpu_copy_efficiency <= 1:
            raise ConfigError(f"SwitchCosts: invalid values {self}")

    def _config(self):
        from oserve.switch import SwitchConfig

        return SwitchConfig(disk_bytes_per_s=self.disk_bytes_per_s, engine_start_s=self.engine_start_s)

    def reload_s(self, model: ModelSpec, cluster: ClusterSpec, old: Deployment, target: Deployment) -> float:
        """The switch planner's reload baseline: changed replicas read their shards from disk, then start."""
        from oserve.switch.planner import reload_seconds

        return reload_seconds(model, cluster, old, target, self._config())

    def gpu_to_gpu(self, model: ModelSpec, cluster: ClusterSpec, old: Deployment,
                   target: Deployment) -> tuple[Deployment, float]:
        """The target as the improved switch planner places it, and the switch time: engine start plus
        the planner's modelled time to move every needed weight byte (kept replicas move nothing)."""
        from oserve.switch import plan_switch

        plan = plan_switch(model, cluster, old, target, planner="improved", config=self._config())
        return plan.target, plan.switch_seconds / self.gpu_copy_efficiency + self.engine_start_s


def mix_capacity_rps(n_row: np.ndarray, rates: np.ndarray) -> float:
    """Requests/s one replica (capacities `n_row` per type) sustains for the mix of `rates`: harmonic. Pure."""
    total = float(np.sum(rates))
    if total <= 0:
        return 0.0
    p = np.asarray(rates, dtype=float) / total
    used = p > 0
    return float(1.0 / np.sum(p[used] / np.asarray(n_row, dtype=float)[used]))


class _Base:
    name = "base"

    def route(self, req: SimRequest, replicas: list[SimReplica]) -> int | None:
        return None


@dataclass
class PlanningContext:
    """What every planning policy shares."""

    model: ModelSpec
    cluster: ClusterSpec
    table: CapacityTable
    costs: SwitchCosts = field(default_factory=SwitchCosts)
    initial_rps: np.ndarray | None = None
    """Per-type rates assumed before any span is observed (span 0)."""

    @property
    def type_names(self) -> tuple[str, ...]:
        return self.table.type_names


class Forecaster(Protocol):
    """The forecasting interface the policies use (see `oserve.forecast`)."""

    def forecast_rps(self, observed_counts: np.ndarray, span_s: float) -> np.ndarray: ...


@dataclass
class LastSpanForecaster:
    """Next span's rates = the last observed span's rates."""

    def forecast_rps(self, observed_counts: np.ndarray, span_s: float) -> np.ndarray:
        return observed_counts[-1] / span_s


class OnlineForecaster:
    """Adapts an `oserve.forecast.Forecaster` (learn_one / forecast on span counts) to the policies.

    Feeds it every span that closed since the last call, then forecasts the next span's counts;
    until the forecaster is ready it answers with the last span's rates.
    """

    def __init__(self, forecaster) -> None:
        self.forecaster = forecaster
        self._seen = 0

    def forecast_rps(self, observed_counts: np.ndarray, span_s: float) -> np.ndarray:
        for row in observed_counts[self._seen:]:
            self.forecaster.learn_one(np.asarray(row, dtype=float))
        self._seen = len(observed_counts)
        if self.forecaster.needs_retrain():
            self.forecaster.retrain()
        if not self.forecaster.ready:
            return observed_counts[-1] / span_s
        return np.maximum(self.forecaster.forecast(), 0.0) / span_s


def weights_for(plan_assignment, capacity_rows: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """Routing weights [type][replica] from an assignment; a type it serves nowhere goes by capacity."""
    x = np.asarray(plan_assignment.rates_rps, dtype=float)  # [replica][type]
    out = []
    for j in range(capacity_rows.shape[1]):
        col = x[:, j] if len(x) else np.zeros(0)
        if col.sum() <= 0:
            col = capacity_rows[:, j]
        out.append(tuple(float(v) for v in col))
    return tuple(out)


def stabilize(old: Deployment, new: Deployment, cluster: ClusterSpec) -> Deployment:
    """Place `new` so that replicas it shares with `old` (same shape) keep their GPUs. Pure.

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
    replicas = [Replica(f"r{i}", r.shape, r.gpu_ids) for i, r in enumerate(kept)]
    replicas += [Replica(f"r{len(kept) + i}", s, g) for i, (s, g) in enumerate(placed)]
    # keep ids stable for kept replicas: reuse their old ids where free
    ids_old = {(r.shape, r.gpu_ids): r.replica_id for r in old.replicas}
    taken = set()
    out = []
    counter = 0
    for r in replicas:
        rid = ids_old.get((r.shape, r.gpu_ids))
        if rid is None or rid in taken:
            while f"n{counter}" in taken or any(o.replica_id == f"n{counter}" for o in old.replicas):
                counter += 1
            rid = f"n{counter}"
            counter += 1
        taken.add(rid)
        out.append(Replica(rid, r.shape, r.gpu_ids))
    return Deployment(tuple(out))


def assign_even(rates: np.ndarray, n: np.ndarray) -> Assignment:
    """The exact assignment of `rates` over replicas with capacity rows `n`, identical replicas sharing
    their group's flows evenly. Pure.

    Replicas with equal rows are interchangeable, so the LP runs over groups (a group of c replicas has
    c times the capacity; exact, as in `oserve.scheduler.problem`) and each member gets 1/c of its
    group's flow of every type. A per-replica vertex solution instead pins types to arbitrary members
    of a group, and re-solving every span moves them around: the router then shifts whole types between
    identical replicas from one span to the next, which the twin (fixed weights) does not foresee.
    """
    n = np.asarray(n, dtype=float)
    if len(n) == 0:
        return assign(rates, n)
    keys = [tuple(row) for row in n]
    groups: dict[tuple, list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    members = list(groups.values())
    agg = np.array([n[m[0]] * len(m) for m in members])
    a = assign(rates, agg)
    x = np.zeros_like(n)
    for g, m in enumerate(members):
        x[m] = np.asarray(a.rates_rps[g], dtype=float) / len(m)
    return Assignment(tuple(f"r{k}" for k in range(len(n))), a.type_names, a.demand_rps,
                      tuple(tuple(float(v) for v in row) for row in x),
                      tuple(tuple(float(v) for v in row) for row in n))


def _served(ctx: PlanningContext, deployment: Deployment, rates: np.ndarray):
    """The exact assignment of `rates` over an existing deployment (identical replicas evenly)."""
    n = ctx.table.matrix(deployment.shapes())
    return assign_even(rates, n), n


def _homogeneous_candidates(ctx: PlanningContext) -> list[ReplicaShape]:
    return [s for s in ctx.table.shapes(ctx.cluster.num_gpus) if ctx.cluster.num_gpus // s.num_gpus >= 1]


def homogeneous_deployment(ctx: PlanningContext | ClusterSpec, shape: ReplicaShape) -> Deployment:
    """As many replicas of `shape` as pack on the cluster (TP groups inside nodes), placed. Pure."""
    cluster = ctx.cluster if isinstance(ctx, PlanningContext) else ctx
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


def best_homogeneous(ctx: PlanningContext, rates: np.ndarray) -> tuple[Deployment, object]:
    """The homogeneous deployment that serves `rates` best (served rate, then lowest peak utilisation)."""
    best = None
    for shape in _homogeneous_candidates(ctx):
        try:
            dep = homogeneous_deployment(ctx, shape)
        except (ConfigError, InfeasibleError):
            continue
        a, _ = _served(ctx, dep, rates)
        key = (round(a.served_rps, 9), -a.peak_utilisation)
        if best is None or key > best[0]:
            best = (key, dep, a)
    if best is None:
        raise InfeasibleError(f"no homogeneous deployment of {ctx.model.name} fits {ctx.cluster.name}")
    return best[1], best[2]


def _should_switch(current_served: float, current_peak: float, new_plan_served: float, new_peak: float,
                   lost_capacity_rps: float, switch_s: float, span_s: float, demand: float) -> bool:
    """Switch when the gain over the coming span outweighs what the switch costs.

    Gain: more requests served over the span, or, when both serve everything, a lower peak utilisation
    (queueing delay grows like 1 / (1 - utilisation)). Cost: the capacity of replacing replicas lost for
    the switching time.
    """
    served_gain = (new_plan_served - current_served) * span_s
    cost = lost_capacity_rps * switch_s
    if served_gain > cost and new_plan_served > current_served * 1.01:
        return True
    if current_served >= demand * 0.999 and new_plan_served >= demand * 0.999:
        # both serve everything: switch only for a clearly lower peak utilisation, and only when the
        # capacity lost while switching is under a tenth of the span's demand
        return current_peak > 0.8 and new_peak < current_peak - 0.15 and cost < 0.1 * demand * span_s
    return False


def least_loaded_among(replicas: list[SimReplica], eligible: tuple[float, ...] | None) -> int | None:
    """Index of the accepting replica with the least KV load (used plus queued), among those with a
    positive weight in `eligible` (all accepting replicas when none of those accepts)."""
    best, best_key = None, None
    for pass_all in (False, True):
        for k, r in enumerate(replicas):
            if not r.accepting or (not pass_all and eligible is not None and (k >= len(eligible) or eligible[k] <= 0)):
                continue
            key = (r.kv_load_frac(), r.num_requests)
            if best_key is None or key < best_key:
                best, best_key = k, key
        if best is not None:
            return best
    return None


class OServePolicy(_Base):
    """Forecast -> MILP deployment over every shape -> GPU-to-GPU switch when worth it.

    Routing: the assignment decides which replicas may serve each type (its affinity); among those,
    each request goes to the least-loaded one. Routing by the assignment's exact fractions is fragile
    when the forecast is off (a type the forecast underestimates overloads the replicas it was given
    while others idle); least-loaded within the affinity keeps the heterogeneous split and absorbs the
    forecast error.

    Planning. The shapes of Llama-2-70B lie within a few percent of each other per GPU in the capacity
    table, so its exact optimum is decided by modelling noise while the candidates' tail latencies
    differ by tens of percent. So the policy builds a few candidates (the MILP at slacks 0, 2% and 5%
    of its third, fewest-replicas phase; the three best homogeneous deployments for the forecast mix;
    what runs now) and scores each on the digital twin (`oserve.sim.twin`: the last span's arrivals at
    the forecast's counts, replayed on the simulated engine); it moves to the best when that beats
    what runs by `switch_gain` and the capacity lost while switching is under a tenth of the span's
    demand. Candidates are rescored only when the forecast moved since the last scoring by more than
    `rescore_change` and twice what Poisson noise alone moves it. With `twin=None` the capacity model
    alone decides (the MILP with `search_config`, switched by `_should_switch`).

    Each scoring then searches further from the best candidate: up to `neighbour_steps` moves of
    steepest descent on the twin's score over deployments one move away (a replica replaced by
    another shape of as many GPUs, split in two, or two merged; `oserve.sim.twin.neighbours`). A move
    is taken only if it beats the current score by more than `neighbour_min_gain`, the bar a switch
    must clear too: the best of some thirty neighbours on one synthetic span looks better than it is
    (on S3 the twin gave its pick 9% on two seeds and -1% on a third, and it served 4% worse; on the
    Azure code trace's quiet first minute every deployment scores within 2% and the pick served 32%
    worse), while the moves that pay score 24-27% better on every seed (S4, S5). A neighbour is
    allowed only if its peak utilisation for the forecast is within `neighbour_capacity_slack` of the
    lowest among the candidates: the twin scores a span at the forecast's load, and a deployment that
    trades capacity for speed there is overrun when the load rises (on the Azure conversation trace
    the twin's favourite neighbour, two TP8 replicas, has a third less headroom and, fixed for the
    hour, a P99 of 86 s against 38 s).
    """

    def __init__(self, ctx: PlanningContext, forecaster: Forecaster | None = None, search_name: str = "milp",
                 oracle: bool = False, headroom: float = 1.0, name: str | None = None,
                 search_config: SearchConfig = SearchConfig(fewer_replicas_slack=0.02),
                 twin: TwinConfig | None = TwinConfig(), rescore_change: float = 0.1, switch_gain: float = 0.1,
                 neighbour_steps: int = 2, neighbour_capacity_slack: float = 0.05,
                 neighbour_min_gain: float = 0.1) -> None:
        if neighbour_steps < 0 or not (neighbour_capacity_slack >= 0 and 0 <= neighbour_min_gain < 1):
            raise ConfigError(f"OServePolicy: need neighbour_steps >= 0, neighbour_capacity_slack >= 0 and "
                              f"neighbour_min_gain in [0, 1), got {neighbour_steps}, {neighbour_capacity_slack}, "
                              f"{neighbour_min_gain}")
        self.neighbour_steps = neighbour_steps
        self.neighbour_min_gain = neighbour_min_gain
        self.neighbour_capacity_slack = neighbour_capacity_slack
        self.ctx = ctx
        self.search_config = search_config
        self.twin = DigitalTwin(ctx.model, ctx.cluster.gpu, ctx.cluster, ctx.table.types, twin) if twin else None
        self.rescore_change = rescore_change
        self.switch_gain = switch_gain
        self._scored_rates: np.ndarray | None = None
        self.forecaster = forecaster or LastSpanForecaster()
        self.search_name = search_name
        self.oracle = oracle
        self.headroom = headroom
        self.name = name or ("oracle" if oracle else "oserve")
        self._affinity: tuple[tuple[float, ...], ...] = ()

    def route(self, req: SimRequest, replicas: list[SimReplica]) -> int | None:
        eligible = self._affinity[req.type_index] if req.type_index < len(self._affinity) else None
        return least_loaded_among(replicas, eligible)

    def _rates(self, view: SpanView) -> np.ndarray:
        if self.oracle and view.true_next_counts is not None:
            return view.true_next_counts / view.span_s
        if len(view.observed_counts) == 0:
            if self.ctx.initial_rps is None:
                raise ConfigError(f"{self.name}: no observed span and no initial rates")
            return np.asarray(self.ctx.initial_rps, dtype=float)
        return np.maximum(self.forecaster.forecast_rps(view.observed_counts, view.span_s), 0.0)

    def decide(self, view: SpanView) -> Decision | None:
        decision = self._decide(view)
        self._affinity = decision.weights
        return decision

    def _decide(self, view: SpanView) -> Decision:
        rates = self._rates(view) * self.headroom
        if self.twin is not None:
            return self._decide_by_twin(view, rates)
        return self._decide_by_model(view, rates)

    def _candidates(self, rates: np.ndarray, old: Deployment) -> list[Deployment]:
        """Deployments worth scoring: the MILP's at three slacks, the best homogeneous ones by modelled
        capacity for this mix, and what runs now (one of each shape multiset)."""
        ctx = self.ctx
        out: list[Deployment] = [old] if old.replicas else []
        for slack in sorted({self.search_config.fewer_replicas_slack, 0.0, 0.05}):
            cfg = replace(self.search_config, fewer_replicas_slack=slack)
            out.append(search(self.search_name, ctx.model, ctx.cluster, rates, ctx.table, config=cfg).deployment)
        total = float(np.sum(rates))
        if total > 0:
            ranked = static_capacity_rps(ctx.table, ctx.cluster, np.asarray(rates, dtype=float) / total)
            out += [homogeneous_deployment(ctx, shape) for _, shape in ranked[:3]]
        seen, unique = set(), []
        for dep in out:
            key = tuple(sorted(dep.shapes()))
            if key not in seen:
                seen.add(key)
                unique.append(dep)
        return unique

    def _decide_by_twin(self, view: SpanView, rates: np.ndarray) -> Decision:
        """Candidates scored on a synthetic span of the forecast (`oserve.sim.twin`); switch when the best
        beats what runs by `switch_gain` and the capacity lost while switching is affordable. Scoring is
        redone only when the forecast moved (relative L1) by more than `rescore_change` and than Poisson
        noise explains since the last scoring."""
        ctx = self.ctx
        current = view.current
        old = current.deployment if current else Deployment.empty()
        if current is not None and self._scored_rates is not None:
            base = max(float(self._scored_rates.sum()), 1e-9)
            moved = float(np.abs(rates - self._scored_rates).sum()) / base
            # what two spans of the same mix differ by through Poisson noise alone is no reason to rescore
            # (sqrt(2k / (pi N)) is a rough, low estimate of the relative L1 distance of two multinomial
            # samples of N over k types: about 20% under the uniform mix's 2 sqrt((k - 1) / (pi N)))
            noise = float(np.sqrt(2.0 * len(rates) / (np.pi * max(base * view.span_s, 1.0))))
            a_cur, n_cur = _served(ctx, old, rates)
            if moved < max(self.rescore_change, 2.0 * noise) and a_cur.served_rps >= 0.999 * float(rates.sum()):
                return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "reroute")
        self._scored_rates = np.array(rates, dtype=float)
        pattern = view.true_next_arrivals if self.oracle else view.last_arrivals
        scored = []
        for i, dep in enumerate(self._candidates(rates, old)):
            a, n = _served(ctx, dep, rates)
            weights = weights_for(a, n)
            scored.append((self.twin.score(dep, weights, rates, least_loaded_among, pattern, view.span_s,
                                           long=current is None), i, dep, weights, a.peak_utilisation))
        best_score, _, best, best_weights, _ = min(scored, key=lambda x: (x[0], x[1]))
        if self.neighbour_steps > 0:
            best, best_weights, best_score = self._search_neighbours(rates, pattern, view.span_s, scored, best,
                                                                     best_score, best_weights, current is None)
        if current is None:
            return Decision(best, best_weights, 0.0, tuple(rates), "initial")
        cur_score = scored[0][0]  # the first candidate is what runs
        a_cur, n_cur = _served(ctx, old, rates)
        same = tuple(sorted(best.shapes())) == tuple(sorted(old.shapes()))
        if same or best_score >= cur_score * (1 - self.switch_gain):
            return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "reroute")
        target = stabilize(old, best, ctx.cluster)
        switch_s = 0.0
        if not self.oracle:
            target, switch_s = ctx.costs.gpu_to_gpu(ctx.model, ctx.cluster, old, target)
            new_keys = {(r.shape, r.gpu_ids) for r in target.replicas}
            lost = sum(mix_capacity_rps(n_cur[k], rates) for k, r in enumerate(old.replicas)
                       if (r.shape, r.gpu_ids) not in new_keys)
            if lost * switch_s > 0.1 * float(rates.sum()) * view.span_s:
                return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "keep")
        n_t = ctx.table.matrix(target.shapes())
        return Decision(target, weights_for(assign_even(rates, n_t), n_t), switch_s, tuple(rates), "switch",
                        drain_retired=self.oracle)

    def _search_neighbours(self, rates: np.ndarray, pattern, span_s: float, scored: list, best: Deployment,
                           best_score: float, best_weights: tuple[tuple[float, ...], ...], long: bool
                           ) -> tuple[Deployment, tuple[tuple[float, ...], ...], float]:
        """Steepest descent on the twin's score from `best` over deployments with about the candidates'
        headroom (see the class docstring); returns the deployment reached, its weights and its score.
        `long`: score on the twin's long first span (the first deployment) or on the replayed span."""
        ctx = self.ctx
        cap = min(util for *_, util in scored)
        cap *= 1 + self.neighbour_capacity_slack
        demand = float(rates.sum())
        known = {tuple(sorted(dep.shapes())): sc for sc, _, dep, _, _ in scored}
        placed: dict[Multiset, tuple[Deployment, tuple[tuple[float, ...], ...]]] = {}

        def score(shapes: Multiset) -> float | None:
            try:
                dep = place(list(shapes), ctx.cluster)
            except (ConfigError, InfeasibleError):
                return None  # does not pack onto the nodes
            a, n = _served(ctx, dep, rates)
            if a.peak_utilisation > cap or a.served_rps < 0.999 * demand:
                return None  # gives up headroom the candidates keep
            placed[shapes] = (dep, weights_for(a, n))
            if shapes in known:
                return known[shapes]
            return self.twin.score(dep, placed[shapes][1], rates, least_loaded_among, pattern, span_s, long=long)

        start = tuple(sorted(best.shapes()))
        reached, reached_score = local_search(start, best_score, ctx.table.shapes(ctx.cluster.num_gpus), score,
                                              self.neighbour_steps, self.neighbour_min_gain)
        return (best, best_weights, best_score) if reached == start else (*placed[reached], reached_score)

    def _decide_by_model(self, view: SpanView, rates: np.ndarray) -> Decision:
        ctx = self.ctx
        plan: Plan = search(self.search_name, ctx.model, ctx.cluster, rates, ctx.table, config=self.search_config)
        current = view.current
        old = current.deployment if current else Deployment.empty()
        target = stabilize(old, plan.deployment, ctx.cluster)
        n_target = ctx.table.matrix(target.shapes())
        a_target = assign_even(rates, n_target)
        if current is None:
            return Decision(target, weights_for(a_target, n_target), 0.0, tuple(rates), "initial")
        a_cur, n_cur = _served(ctx, old, rates)
        old_keys = {(r.shape, r.gpu_ids) for r in old.replicas}
        new_keys = {(r.shape, r.gpu_ids) for r in target.replicas}
        new_reps = [r for r in target.replicas if (r.shape, r.gpu_ids) not in old_keys]
        if not new_reps and old_keys == new_keys:
            # same deployment: just re-route for the new mix
            return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "reroute")
        switch_s = 0.0
        if not self.oracle:
            target, switch_s = ctx.costs.gpu_to_gpu(ctx.model, ctx.cluster, old, target)
            n_target = ctx.table.matrix(target.shapes())
            a_target = assign_even(rates, n_target)
            new_keys = {(r.shape, r.gpu_ids) for r in target.replicas}
        leaving = [k for k, r in enumerate(old.replicas) if (r.shape, r.gpu_ids) not in new_keys]
        lost = sum(mix_capacity_rps(n_cur[k], rates) for k in leaving)
        if _should_switch(a_cur.served_rps, a_cur.peak_utilisation, a_target.served_rps,
                                         a_target.peak_utilisation, lost, switch_s, view.span_s, float(rates.sum())):
            return Decision(target, weights_for(a_target, n_target), switch_s, tuple(rates), "switch",
                            drain_retired=self.oracle)
        return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "keep")


class VllmReloadPolicy(_Base):
    """The best homogeneous deployment for the forecast each span; changing it reloads from disk."""

    name = "vllm-reload"

    def __init__(self, ctx: PlanningContext, forecaster: Forecaster | None = None) -> None:
        self.ctx = ctx
        self.forecaster = forecaster or LastSpanForecaster()

    def decide(self, view: SpanView) -> Decision | None:
        ctx = self.ctx
        if len(view.observed_counts) == 0:
            if ctx.initial_rps is None:
                raise ConfigError(f"{self.name}: no observed span and no initial rates")
            rates = np.asarray(ctx.initial_rps, dtype=float)
        else:
            rates = np.maximum(self.forecaster.forecast_rps(view.observed_counts, view.span_s), 0.0)
        dep, a = best_homogeneous(ctx, rates)
        n = ctx.table.matrix(dep.shapes())
        current = view.current
        if current is None:
            return Decision(dep, weights_for(a, n), 0.0, tuple(rates), "initial")
        a_cur, n_cur = _served(ctx, current.deployment, rates)
        same = current.deployment.shapes() == dep.shapes()
        if same:
            return Decision(current.deployment, weights_for(a_cur, n_cur), 0.0, tuple(rates), "reroute")
        reload_s = ctx.costs.reload_s(ctx.model, ctx.cluster, current.deployment, dep)
        lost = sum(mix_capacity_rps(n_cur[k], rates) for k in range(len(n_cur)))
        if _should_switch(a_cur.served_rps, a_cur.peak_utilisation, a.served_rps, a.peak_utilisation, lost, reload_s,
                          view.span_s, float(rates.sum())):
            # every replica changes shape, so the kernel restarts them all
            return Decision(dep, weights_for(a, n), reload_s, tuple(rates), "reload")
        return Decision(current.deployment, weights_for(a_cur, n_cur), 0.0, tuple(rates), "keep")


class StaticPolicy(_Base):
    """One deployment for the whole trace, routed by capacity share per type."""

    def __init__(self, ctx: PlanningContext, deployment: Deployment, name: str = "vllm-static",
                 least_loaded: bool = False) -> None:
        self.ctx = ctx
        self.deployment = deployment
        self.name = name
        self.least_loaded = least_loaded

    def decide(self, view: SpanView) -> Decision | None:
        n = self.ctx.table.matrix(self.deployment.shapes())
        if len(view.observed_counts) == 0:
            rates = np.asarray(self.ctx.initial_rps, dtype=float) if self.ctx.initial_rps is not None else n[0]
        else:
            rates = view.observed_counts[-1] / view.span_s
        a = assign_even(rates, n)
        return Decision(self.deployment, weights_for(a, n), 0.0, tuple(rates), "static")

    def route(self, req: SimRequest, replicas: list[SimReplica]) -> int | None:
        if not self.least_loaded:
            return None
        return least_loaded_among(replicas, None)


def llumnix(ctx: PlanningContext, deployment: Deployment) -> LlumnixPolicy:
    """Homogeneous replicas; Llumnix's freeness dispatch and live migration of running requests
    (`oserve.sim.llumnix`)."""
    from oserve.sim.llumnix import LlumnixPolicy

    return LlumnixPolicy(ctx, deployment)
