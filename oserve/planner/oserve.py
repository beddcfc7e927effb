"""OServe's planner: forecast rates, the decision in force and the last span's arrivals -> a `Decision`. Pure.

One brain: the live scheduler worker and the simulator's OServe policy call `OServePlanner.plan`
with what each has seen; nothing here knows which one called.

With the twin (the default):
1. If the forecast has hardly moved from the rates the deployment in force was scored at (by less
   than `rescore_change` and twice Poisson noise) and that deployment serves it all, keep it and only
   re-route for the new rates ("reroute").
2. Otherwise build candidates: the MILP's plan at each of `candidate_slacks`, the
   `num_homogeneous_candidates` best homogeneous deployments for the mix, what runs now, and the one
   measured to serve best before the window when there is one; score each on the digital twin
   (`oserve.planner.twin`: the last span's arrivals at the forecast's counts, each class's lengths what
   it turned out to contain lately), the measured one `measured_bonus` lower.
3. From the best, search deployments one move away by steepest descent on the twin
   (`oserve.planner.neighbours`), a move taken only when it scores `neighbour_min_gain` better and keeps
   about the candidates' headroom (`neighbour_capacity_slack`).
4. Switch GPU-to-GPU when the best beats what runs by `switch_gain` and the capacity lost while
   switching stays under `max_switch_loss_frac` of the span's demand ("switch"); else keep what runs,
   re-routed ("rescored" when it is still the best, "keep" when the switch would cost too much).

Without the twin the capacity model alone decides: the search's plan, switched to when it serves more
or lowers a high peak utilisation enough (`PlannerConfig`).

Routing is `oserve.routing.least_loaded` over the replicas a class's weights allow: the rule every
plan is scored with and every request is served with.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from oserve.decision import Decision
from oserve.errors import ConfigError, InfeasibleError
from oserve.planner.candidates import (homogeneous_deployment, mix_capacity_rps, served, stabilize,
                                       static_capacity_rps, weights_for)
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext
from oserve.planner.neighbours import Multiset, local_search
from oserve.planner.twin import ArrivalPattern, DigitalTwin
from oserve.scheduler import search
from oserve.scheduler.packing import place
from oserve.specs import Deployment

Weights = tuple[tuple[float, ...], ...]


def poisson_l1_noise(num_classes: int, num_requests: float) -> float:
    """A rough, low estimate of the relative L1 distance between two multinomial samples of
    `num_requests` over `num_classes` classes: sqrt(2k / (pi N)), about 20% under the uniform mix's
    2 sqrt((k - 1) / (pi N)). What two spans of one mix differ by through Poisson noise alone. Pure."""
    return float(np.sqrt(2.0 * num_classes / (np.pi * max(num_requests, 1.0))))


class OServePlanner:
    """OServe's decision (see the module docstring). Holds no state between calls: what it needs of the
    past comes in the `current` decision (its deployment, and the rates it was last scored at)."""

    def __init__(self, ctx: PlanningContext, config: PlannerConfig = PlannerConfig(), perf=None) -> None:
        """`perf`: the engine the twin simulates (the performance model by default; a learned correction's
        `oserve.perfmodel.ScaledPerf` when the capacity is learned, `oserve.planner.learned`)."""
        self.ctx = ctx
        self.config = config
        self.twin = DigitalTwin(ctx.model, ctx.cluster.gpu, ctx.cluster, ctx.table.types, config.twin, perf,
                                classes=ctx.classes, correction=config.correction) \
            if config.twin is not None else None

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.ctx.class_names

    def plan(self, rates_rps: np.ndarray, current: Decision | None, recent: ArrivalPattern | None,
             span_s: float, measured: Deployment | None = None) -> Decision:
        """The decision for the coming span of `span_s` seconds, for per-class `rates_rps`, from the
        decision in force (None before the first), what arrived in the last span (None if unknown) and the
        deployment measured to serve best before the window (None if none was: `PlannerConfig.measured_bonus`)."""
        rates = np.maximum(np.nan_to_num(np.asarray(rates_rps, dtype=float), nan=0.0, posinf=0.0), 0.0)
        if len(rates) != len(self.ctx.class_names):
            raise ConfigError(f"OServePlanner.plan: {len(rates)} rates for {len(self.ctx.class_names)} classes")
        if self.twin is not None:
            return self._plan_by_twin(rates, current, recent, span_s, measured)
        return self._plan_by_model(rates, current, span_s)

    # --- with the twin ------------------------------------------------------------------------------

    def _serves_all(self, served_rps: float, rates: np.ndarray) -> bool:
        return served_rps >= (1.0 - self.config.served_tolerance_frac) * float(rates.sum())

    def _keep(self, old: Deployment, rates: np.ndarray, label: str, scored: tuple[float, ...],
              assignment: tuple | None = None, deferred_spans: int = 0) -> Decision:
        """Keep `old`, re-routed for `rates` (`assignment`: its (assignment, capacity rows) when known)."""
        a, n = assignment if assignment is not None else served(self.ctx.table, old, rates)
        return Decision(old, weights_for(a, n), 0.0, tuple(rates), label, scored_rps=scored,
                        deferred_spans=deferred_spans)

    def candidates(self, rates: np.ndarray, old: Deployment, measured: Deployment | None = None) -> list[Deployment]:
        """Deployments worth scoring: what runs now, the one `measured` best before the window, the MILP's at
        each candidate slack, and the best homogeneous ones by modelled capacity for this mix (one of each
        shape multiset). Pure."""
        ctx, cfg = self.ctx, self.config
        out: list[Deployment] = [d for d in (old, measured) if d is not None and d.replicas]
        for slack in sorted(set(cfg.candidate_slacks)):
            sc = replace(cfg.search_config, fewer_replicas_slack=slack)
            out.append(search(cfg.search, ctx.model, ctx.cluster, rates, ctx.table, config=sc).deployment)
        total = float(np.sum(rates))
        if total > 0 and cfg.num_homogeneous_candidates:
            ranked = static_capacity_rps(ctx.table, ctx.cluster, np.asarray(rates, dtype=float) / total)
            out += [homogeneous_deployment(ctx.cluster, shape) for _, shape in ranked[:cfg.num_homogeneous_candidates]]
        seen, unique = set(), []
        for dep in out:
            key = tuple(sorted(dep.shapes()))
            if key not in seen:
                seen.add(key)
                unique.append(dep)
        return unique

    def _plan_by_twin(self, rates: np.ndarray, current: Decision | None, recent: ArrivalPattern | None,
                      span_s: float, measured: Deployment | None = None) -> Decision:
        ctx, cfg = self.ctx, self.config
        assert self.twin is not None
        old = current.deployment if current else Deployment.empty()
        held = 1  # spans the mix being planned for has held (this one included)
        if current is not None and current.scored_rps and len(current.scored_rps) == len(rates):
            scored_rates = np.asarray(current.scored_rps, dtype=float)
            base = max(float(scored_rates.sum()), 1e-9)
            moved = float(np.abs(rates - scored_rates).sum()) / base
            noise = poisson_l1_noise(len(rates), base * span_s)
            a_cur, n_cur = served(ctx.table, old, rates)
            steady = moved < max(cfg.rescore_change, 2.0 * noise)
            if current.deferred_spans:
                # a switch put off for its cost was wanted for that many spans: they count as held even when the
                # forecast moved with noise in between (else a wobbling mix resets the count, and a switch
                # away from an overrun deployment waits as long as the wobble lasts)
                held = current.deferred_spans + 1
            elif steady and self._serves_all(a_cur.served_rps, rates):
                return self._keep(old, rates, "reroute", current.scored_rps, (a_cur, n_cur))
        scored_at = tuple(float(r) for r in rates)
        # twin scorings left for this decision (the first decision, made before serving, has no limit)
        budget = [cfg.max_twin_scores if cfg.max_twin_scores is not None and current is not None else -1]
        scored = []
        anchor = tuple(sorted(measured.shapes())) if measured is not None else None
        for i, dep in enumerate(self.candidates(rates, old, measured)):
            if budget[0] == 0:
                break
            budget[0] -= 1
            a, n = served(ctx.table, dep, rates)
            weights = weights_for(a, n)
            score = self.twin.score(dep, weights, rates, recent, long=current is None)
            if tuple(sorted(dep.shapes())) == anchor:
                score *= 1.0 - cfg.measured_bonus  # measured over a whole run, not scored on one span
            scored.append((score, i, dep, weights, a.peak_utilisation))
        best_score, _, best, best_weights, _ = min(scored, key=lambda x: (x[0], x[1]))
        if cfg.neighbour_steps > 0 and budget[0] != 0:
            best, best_weights, best_score = self._search_neighbours(rates, recent, scored, best, best_score,
                                                                     best_weights, current is None, budget)
        if current is None:
            return Decision(best, best_weights, 0.0, tuple(rates), "initial", scored_rps=scored_at)
        cur_score = scored[0][0]  # the first candidate is what runs
        same = tuple(sorted(best.shapes())) == tuple(sorted(old.shapes()))
        if same or best_score >= cur_score * (1 - cfg.switch_gain):
            return self._keep(old, rates, "rescored", scored_at)
        return self._switch(old, best, rates, span_s, scored_at, held)

    def _switch(self, old: Deployment, best: Deployment, rates: np.ndarray, span_s: float,
                scored_at: tuple[float, ...], held: int = 1) -> Decision:
        """Move from `old` to `best` unless the switch costs too much: more of the capacity than
        `max_switch_loss_frac` of the demand of the `held` spans the mix has lasted, plus what the target
        carries of the coming span's demand that `old` does not (by the capacity model). A mix that held
        for h spans is expected to hold about as long again, so a switch put off for one span's gain is
        taken once the gain of the spans it has held pays for it (`Decision.deferred_spans`); a switch away
        from a deployment the forecast overruns is not put off for that, since each span it stays the
        queue grows by what it cannot carry."""
        ctx, cfg = self.ctx, self.config
        target = stabilize(old, best, ctx.cluster)
        switch_s = 0.0
        if not cfg.free_switching:
            target, switch_s = ctx.costs.gpu_to_gpu(ctx.model, ctx.cluster, old, target)
        a_t, n_t = served(ctx.table, target, rates)
        if not cfg.free_switching:
            a_cur, n_cur = served(ctx.table, old, rates)
            new_keys = {(r.shape, r.gpu_ids) for r in target.replicas}
            lost = sum(mix_capacity_rps(n_cur[k], rates) for k, r in enumerate(old.replicas)
                       if (r.shape, r.gpu_ids) not in new_keys)
            carried = max(a_t.served_rps - a_cur.served_rps, 0.0) * span_s
            if lost * switch_s > cfg.max_switch_loss_frac * float(rates.sum()) * span_s * held + carried:
                return self._keep(old, rates, "keep", scored_at, deferred_spans=held)
        return Decision(target, weights_for(a_t, n_t), switch_s, tuple(rates), "switch",
                        drain_retired=cfg.free_switching, scored_rps=scored_at)

    def _search_neighbours(self, rates: np.ndarray, recent: ArrivalPattern | None, scored: list, best: Deployment,
                           best_score: float, best_weights: Weights, long: bool,
                           budget: list[int]) -> tuple[Deployment, Weights, float]:
        """Steepest descent on the twin's score from `best` over deployments with about the candidates'
        headroom (`PlannerConfig.neighbour_capacity_slack`), while `budget[0]` twin scorings are left
        (negative: no limit); returns the deployment reached, its weights and its score."""
        ctx, cfg = self.ctx, self.config
        assert self.twin is not None
        cap = min(util for *_, util in scored) * (1 + cfg.neighbour_capacity_slack)
        known = {tuple(sorted(dep.shapes())): sc for sc, _, dep, _, _ in scored}
        placed: dict[Multiset, tuple[Deployment, Weights]] = {}

        def score(shapes: Multiset) -> float | None:
            if budget[0] == 0 and shapes not in known:
                return None  # out of budget: left unscored (and not even placed)
            try:
                dep = place(list(shapes), ctx.cluster)
            except (ConfigError, InfeasibleError):
                return None  # does not pack onto the nodes
            a, n = served(ctx.table, dep, rates)
            if a.peak_utilisation > cap or not self._serves_all(a.served_rps, rates):
                return None  # gives up headroom the candidates keep
            placed[shapes] = (dep, weights_for(a, n))
            if shapes in known:
                return known[shapes]
            budget[0] -= 1
            return self.twin.score(dep, placed[shapes][1], rates, recent, long=long)

        start = tuple(sorted(best.shapes()))
        reached, reached_score = local_search(start, best_score, ctx.table.shapes(ctx.cluster.num_gpus), score,
                                              cfg.neighbour_steps, cfg.neighbour_min_gain)
        return (best, best_weights, best_score) if reached == start else (*placed[reached], reached_score)

    # --- with the capacity model alone ----------------------------------------------------------------

    def _plan_by_model(self, rates: np.ndarray, current: Decision | None, span_s: float) -> Decision:
        ctx, cfg = self.ctx, self.config
        plan = search(cfg.search, ctx.model, ctx.cluster, rates, ctx.table, config=cfg.search_config)
        old = current.deployment if current else Deployment.empty()
        target = stabilize(old, plan.deployment, ctx.cluster)
        if current is None:
            a, n = served(ctx.table, target, rates)
            return Decision(target, weights_for(a, n), 0.0, tuple(rates), "initial")
        old_keys = {(r.shape, r.gpu_ids) for r in old.replicas}
        if old_keys == {(r.shape, r.gpu_ids) for r in target.replicas}:
            return self._keep(old, rates, "reroute", ())  # same deployment: re-route for the new mix
        switch_s = 0.0
        if not cfg.free_switching:
            target, switch_s = ctx.costs.gpu_to_gpu(ctx.model, ctx.cluster, old, target)
        a_cur, n_cur = served(ctx.table, old, rates)
        a_t, n_t = served(ctx.table, target, rates)
        new_keys = {(r.shape, r.gpu_ids) for r in target.replicas}
        lost = sum(mix_capacity_rps(n_cur[k], rates) for k, r in enumerate(old.replicas)
                   if (r.shape, r.gpu_ids) not in new_keys)
        if worth_switching(cfg, a_cur.served_rps, a_cur.peak_utilisation, a_t.served_rps, a_t.peak_utilisation,
                           lost, switch_s, span_s, float(rates.sum())):
            return Decision(target, weights_for(a_t, n_t), switch_s, tuple(rates), "switch",
                            drain_retired=cfg.free_switching)
        return Decision(old, weights_for(a_cur, n_cur), 0.0, tuple(rates), "keep")


def worth_switching(config: PlannerConfig, current_served: float, current_peak: float, new_served: float,
                    new_peak: float, lost_capacity_rps: float, switch_s: float, span_s: float, demand: float) -> bool:
    """The capacity model's switch rule: the gain over the coming span outweighs what the switch costs.

    Gain: more requests served over the span, or, when both serve everything, a clearly lower peak
    utilisation (`PlannerConfig.busy_peak_utilisation`, `min_peak_drop`). Cost: the capacity of the
    replicas replaced, lost for the switching time. Pure.
    """
    served_gain = (new_served - current_served) * span_s
    cost = lost_capacity_rps * switch_s
    if served_gain > cost and new_served > current_served * (1 + config.min_served_gain_frac):
        return True
    full = 1.0 - config.served_tolerance_frac
    if current_served >= demand * full and new_served >= demand * full:
        return (current_peak > config.busy_peak_utilisation and new_peak < current_peak - config.min_peak_drop
                and cost < config.max_switch_loss_frac * demand * span_s)
    return False
