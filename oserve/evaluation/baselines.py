"""Baselines on the same gateway as OServe: vLLM static (least loaded, or round robin), vLLM reload. Pure.

- `StaticPolicy` (vllm-static): one homogeneous deployment for the whole window, every request to the
  least loaded replica (the routing class every policy gets; here every replica is eligible). Its
  shape is chosen before the window (`oserve.evaluation.compare`), as an operator would.
- `RoundRobinPolicy` (vllm-static-rr): the same deployment, round robin over the accepting replicas
  (vLLM's own router, and the paper's static baseline).
- `ReloadPolicy` (vllm-reload): each span, the best homogeneous deployment for the forecast per-class
  rates, switched to by reloading the weights from disk when the capacity model says it pays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oserve.decision import Decision
from oserve.evaluation.policies import Gateway
from oserve.forecast.base import Forecaster
from oserve.forecast.rates import RateForecaster
from oserve.planner.candidates import best_homogeneous, mix_capacity_rps, served, weights_for
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext
from oserve.planner.oserve import worth_switching
from oserve.planner.prior import Prior
from oserve.planner.static import everywhere
from oserve.planner.twin import ArrivalPattern
from oserve.routing import ReplicaLoad, least_loaded, round_robin
from oserve.sim.kernel import SpanView
from oserve.specs import Deployment


class StaticPolicy(Gateway):
    """One deployment for the whole window; every request to the least loaded replica."""

    def __init__(self, deployment: Deployment, num_classes: int, name: str = "vllm-static") -> None:
        super().__init__(name, num_classes)
        self.deployment = deployment

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        if view.current is not None:
            return None
        return Decision(self.deployment, everywhere(self.deployment, self.k), 0.0, (), "static")

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        return least_loaded(loads, None)


class RoundRobinPolicy(StaticPolicy):
    """The static deployment with round robin over the accepting replicas."""

    def __init__(self, deployment: Deployment, num_classes: int, name: str = "vllm-static-rr") -> None:
        super().__init__(deployment, num_classes, name)
        self._next = 0

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        k = round_robin(loads, self._next)
        if k is not None:
            self._next = k + 1
        return k


class ReloadPolicy(Gateway):
    """vLLM re-deployed per span: the best homogeneous deployment for the forecast, by reloading."""

    def __init__(self, ctx: PlanningContext, prior: Prior, forecaster: Forecaster, span_s: float,
                 config: PlannerConfig = PlannerConfig(), name: str = "vllm-reload") -> None:
        super().__init__(name, len(prior.class_names), prior.fresh_estimator())
        self.ctx, self.config = ctx, config
        forecaster.fit(prior.counts)
        self.rates = RateForecaster(forecaster, span_s)

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        return least_loaded(loads, None)  # homogeneous replicas: every one is eligible

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        ctx = self.ctx
        if view.current is not None:
            self.rates.observe(counts)
        rates = self.rates.rates_rps()
        dep, a = best_homogeneous(ctx.table, ctx.cluster, rates)
        n = ctx.table.matrix(dep.shapes())
        current = view.current
        if current is None:
            return Decision(dep, weights_for(a, n), 0.0, tuple(rates), "initial")
        a_cur, n_cur = served(ctx.table, current.deployment, rates)
        if current.deployment.shapes() == dep.shapes():
            return Decision(current.deployment, weights_for(a_cur, n_cur), 0.0, tuple(rates), "reroute")
        reload_s = ctx.costs.reload_s(ctx.model, ctx.cluster, current.deployment, dep)
        lost = sum(mix_capacity_rps(n_cur[k], rates) for k in range(len(n_cur)))
        if worth_switching(self.config, a_cur.served_rps, a_cur.peak_utilisation, a.served_rps, a.peak_utilisation,
                           lost, reload_s, view.span_s, float(rates.sum())):
            # every replica changes shape, so the kernel restarts them all
            return Decision(dep, weights_for(a, n), reload_s, tuple(rates), "reload")
        return Decision(current.deployment, weights_for(a_cur, n_cur), 0.0, tuple(rates), "keep")
