"""A Dynamo-like baseline: a planner that scales replica counts from an aggregate load forecast. Pure.

NVIDIA Dynamo's planner (its SLA planner, `components/planner` in ai-dynamo/dynamo) forecasts, for the
next adjustment interval, the request count and the mean input and output lengths (ISL, OSL), each
with its own predictor (constant, ARIMA, Prophet); it turns them into replica counts with throughput
per GPU profiled before deployment at the TTFT and ITL targets (replicas = ceil(demand / what one
replica sustains)), bounded below by one; each worker's parallelism is fixed when it is deployed; a new
replica is a new worker process that loads the weights. Its KV router sends each request to the
worker of least cost, overlap_score_weight x prefill blocks + decode blocks; with no prefix-cache
overlap that is the worker with the least KV demand.

Here, as Dynamo does it in aggregated mode:
- The shape is the static baseline's (chosen before the window); the count is what the forecast
  needs at the latency target, from the capacity model at the forecast's mean lengths (the stand-in
  for Dynamo's pre-deployment profile), between one and as many as fit the cluster.
- The forecast is Dynamo's constant predictor (the last interval's count, ISL and OSL: OSL from the
  interval's completions, as Dynamo reads it from the frontend's metrics), the same information as
  OServe's default last-value forecast; the interval is the span (Dynamo's default is 180 s; a
  shorter one only helps it follow the load).
- Scaling up starts replicas that load their weights from disk (the switch planner's reload time);
  scaling down retires replicas, which finish what they run.
- Routing is the least-loaded rule over all replicas: the KV router without prefix overlap.

Not modelled: disaggregated prefill and decode workers, prefix-cache overlap, the planner's correction
factors (observed over expected TTFT and ITL), metric-collection lag, and pod scheduling time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from oserve.capacity import CapacityTable, FixedLengths
from oserve.decision import Decision
from oserve.errors import ConfigError, InfeasibleError
from oserve.evaluation.policies import Gateway
from oserve.planner.candidates import homogeneous_deployment, stabilize
from oserve.planner.context import PlanningContext
from oserve.planner.prior import Prior
from oserve.planner.twin import ArrivalPattern
from oserve.routing import ReplicaLoad, least_loaded
from oserve.scheduler.packing import place
from oserve.sim.kernel import ArrivalInfo, SpanView
from oserve.specs import Deployment, ReplicaShape
from oserve.traces import Trace


class DynamoPolicy(Gateway):
    """Replica count from an aggregate forecast, a fixed shape, KV-aware routing (module docstring)."""

    def __init__(self, ctx: PlanningContext, prior: Prior, shape: ReplicaShape, history: Trace, history_s: float,
                 span_s: float, name: str = "dynamo") -> None:
        super().__init__(name, len(prior.class_names))
        self.ctx, self.shape = ctx, shape
        self.max_replicas = len(homogeneous_deployment(ctx.cluster, shape).replicas)
        # the history's last span as the gateway saw it: the requests it admitted, their lengths as served
        refused, served = history.served(ctx.model.max_context_tokens)
        last = (history.arrival_s >= history_s - span_s) & ~refused
        if not last.any():
            raise ConfigError("DynamoPolicy: the history's last span has no request to forecast from")
        self.count = float(last.sum())
        self.isl = float(history.input_tokens[last].mean())
        self.osl = float(served[last].mean())
        self._inputs: list[int] = []

    def classify(self, arrival: ArrivalInfo) -> int:
        self._inputs.append(arrival.input_tokens)
        return super().classify(arrival)

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        return least_loaded(loads, None)

    def replica_rate_rps(self, isl: float, osl: float) -> float:
        """What one replica of the shape sustains at the latency target for requests of these lengths."""
        lengths = FixedLengths(("all",), ((max(1, round(isl)),),), ((max(1, round(osl)),),))
        table = CapacityTable(self.ctx.model, self.ctx.cluster.gpu, lengths, self.ctx.table.target,
                              gpus_per_node=self.ctx.cluster.gpus_per_node, perf=self.ctx.table.perf)
        return table.rate(self.shape, 0)

    def plan(self, view: SpanView, counts: np.ndarray, pattern: ArrivalPattern) -> Decision | None:
        if view.current is not None:  # the constant predictor: the last interval's values
            self.count = float(counts.sum())
            if self._inputs:
                self.isl = float(np.mean(self._inputs))
            if view.completed:
                self.osl = float(np.mean([c.output_tokens for c in view.completed]))
        self._inputs = []
        demand_rps = self.count / view.span_s
        need = math.ceil(demand_rps / max(self.replica_rate_rps(self.isl, self.osl), 1e-9))
        count = min(max(need, 1), self.max_replicas)
        old = view.current.deployment if view.current is not None else Deployment.empty()
        if len(old.replicas) == count:
            return None
        try:
            target = stabilize(old, place([self.shape] * count, self.ctx.cluster), self.ctx.cluster)
        except InfeasibleError:
            return None
        weights = tuple((1.0,) * count for _ in range(self.k))
        if view.current is None:
            return Decision(target, weights, 0.0, (demand_rps,), "initial")
        grows = count > len(old.replicas)
        switch_s = self.ctx.costs.reload_s(self.ctx.model, self.ctx.cluster, old, target) if grows else 0.0
        return Decision(target, weights, switch_s, (demand_rps,), "scale-up" if grows else "scale-down",
                        drain_retired=True)
