"""The routing rule, one implementation: each request to the least loaded replica among those its class
may use. Pure.

The plans are scored with it (`oserve.planner.twin`), the simulator routes every policy's requests with
it (`oserve.evaluation`), and the live gateway routes with it (`oserve.workers.gateway`). Routing by
the assignment's exact fractions is fragile when the forecast is off (a class the forecast
underestimates overloads the replicas it was given while others idle); least loaded within the
eligible replicas keeps the plan's split and absorbs the forecast's error.

Load is KV demand: the blocks in use plus those the queued prompts need, as a fraction of the
replica's blocks (what vLLM reports as KV-cache usage, with its waiting queue); ties go to fewer
requests, then to the lower index.

A replica still loading its weights (switching in) is not ready: a real router does not know it until
its engine is up. It gets a request only when no ready replica accepts; requests then wait in its queue.

A class that comes beyond its plan within a span (`beyond_plan`) is routed among all replicas: the
simulator's gateway and the live gateway count each class's arrivals against the rate the decision
gives it. The twin does not count: it scores a plan on a span drawn at the forecast's counts, so it does
not see a class arrive beyond its plan (a mix the forecast missed is scored by neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ReplicaLoad(Protocol):
    """What a router may know of one replica: its load, not its requests."""

    @property
    def accepting(self) -> bool:
        """False while draining or retiring: route nothing new there."""

    @property
    def ready(self) -> bool:
        """Serving now; False while it switches in (its weights still arriving)."""

    @property
    def kv_load_frac(self) -> float:
        """KV blocks used plus demanded by the queue, over the replica's blocks (may exceed 1)."""

    @property
    def num_requests(self) -> int:
        """Requests queued or running."""

    @property
    def num_running(self) -> int:
        """Requests running (admitted to the batch)."""

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the replica's KV cache holds."""

    @property
    def incoming_kv_tokens(self) -> int:
        """KV tokens reserved for requests migrating in (live migration)."""


def least_loaded(loads: Sequence[ReplicaLoad], eligible: Sequence[float] | None) -> int | None:
    """Index of the accepting replica with the least KV load, looked for in turn among: the ready replicas
    with a positive weight in `eligible`, all ready ones, the eligible ones still switching in, all
    accepting ones (`eligible` None: every replica is eligible); None when no replica accepts. Pure."""
    def allowed(k: int) -> bool:
        return eligible is None or (k < len(eligible) and eligible[k] > 0)

    passes = (((True, True), (True, False), (False, True), (False, False)) if eligible is not None
              else ((True, False), (False, False)))  # every replica eligible: two passes say it all
    for need_ready, need_eligible in passes:
        best, best_key = None, None
        for k, r in enumerate(loads):
            if not r.accepting or (need_ready and not r.ready) or (need_eligible and not allowed(k)):
                continue
            key = (r.kv_load_frac, r.num_requests)
            if best_key is None or key < best_key:
                best, best_key = k, key
        if best is not None:
            return best
    return None


SURPLUS_FACTOR = 1.5
"""A class has arrived beyond its plan in a span once its arrivals so far exceed this many times what the
plan's forecast gave it for the time elapsed ..."""
SURPLUS_SLACK = 10.0
"""... plus this many requests (a Poisson count's noise at the start of a span is not a surplus)."""


def plan_allowance(planned_rps: float, elapsed_s: float) -> float:
    """The arrivals a class may reach `elapsed_s` into a span before it is beyond its plan: `SURPLUS_FACTOR`
    times what the plan forecast for it (`planned_rps`) in that time, plus `SURPLUS_SLACK`. Pure."""
    return SURPLUS_FACTOR * max(planned_rps, 0.0) * max(elapsed_s, 0.0) + SURPLUS_SLACK


def beyond_plan(arrived: float, planned_rps: float, elapsed_s: float) -> bool:
    """Whether a class's `arrived` requests in a span, `elapsed_s` into it, exceed what the plan forecast
    for it (`planned_rps`) by `SURPLUS_FACTOR` and `SURPLUS_SLACK`. The router then sends that class's
    requests to the least loaded replica of any class: the plan gave it replicas sized for its forecast,
    and a mix that moved away from the forecast queues there while replicas planned for the classes that
    fell idle (the next plan answers it; this bounds the span until then). Pure."""
    return arrived > plan_allowance(planned_rps, elapsed_s)


def round_robin(loads: Sequence[ReplicaLoad], counter: int) -> int | None:
    """The first accepting replica at or after `counter` modulo the number of replicas (round robin,
    skipping replicas that do not accept), a ready one when any is; None when none accepts. Pure."""
    n = len(loads)
    for need_ready in (True, False):
        for step in range(n):
            k = (counter + step) % n
            if loads[k].accepting and (loads[k].ready or not need_ready):
                return k
    return None
