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
    """Index of the accepting replica with the least KV load among those with a positive weight in
    `eligible` (all accepting replicas when `eligible` is None or none of those accepts); None when no
    replica accepts. Pure."""
    best, best_key = None, None
    for pass_all in (False, True):
        if pass_all and best is None and eligible is None:
            break  # the first pass already looked at every replica
        for k, r in enumerate(loads):
            if not r.accepting:
                continue
            if not pass_all and eligible is not None and (k >= len(eligible) or eligible[k] <= 0):
                continue
            key = (r.kv_load_frac, r.num_requests)
            if best_key is None or key < best_key:
                best, best_key = k, key
        if best is not None:
            return best
    return None


def round_robin(loads: Sequence[ReplicaLoad], counter: int) -> int | None:
    """The first accepting replica at or after `counter` modulo the number of replicas (round robin,
    skipping replicas that do not accept); None when none accepts. Pure."""
    n = len(loads)
    for step in range(n):
        k = (counter + step) % n
        if loads[k].accepting:
            return k
    return None
