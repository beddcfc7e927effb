"""A Llumnix-like balancer for the simulator: freeness dispatch plus live migration of running requests. Pure.

Llumnix (Sun et al., OSDI 2024) schedules over per-instance *virtual usage*: the KV blocks in use plus
the demand of the queued requests (and, here, the blocks reserved for requests migrating in). From it
each instance's *freeness* is how many more tokens every running request could still grow before the
cache is full:

    freeness_tokens = (total_blocks - virtual_blocks) * block_tokens / max(1, running requests)

- Dispatch: each new request goes to the accepting replica of highest freeness.
- Migration: every `migration_interval_s` the overloaded replicas (freeness under
  `migrate_out_freeness_tokens`, or a full batch with requests waiting behind it) are paired, most
  loaded first, with the least loaded ones (no queue, a free batch slot, freeness over
  `migrate_in_freeness_tokens`), and up to `max_migrations_per_pair` running requests move from each
  source to its destination, shortest context first (the cheapest to copy; Llumnix's default).

What a move costs (`migration_times`). Llumnix copies the KV cache stage by stage while the request
keeps decoding on the source; only the last stage (the tokens decoded during the previous one) runs
with the request stopped, so its downtime is near-constant whatever the sequence length. Every GPU
copies its own shard to its peer on the destination in parallel, at `migration_link_frac` of the link
(NVLink when both replicas sit on one node, the network otherwise):

    precopy_s  = context_tokens * kv_bytes_per_token_per_gpu / link      (overlapped with decoding)
    downtime_s = migration_fixed_s + block_tokens * kv_bytes_per_token_per_gpu / link

`kv_bytes_per_token_per_gpu` is the largest stage's (`oserve.specs.stage_kv_bytes_per_token`); the
last stage is taken as one KV block (decoding adds a token per step; a stage copy takes far less).
The fixed part (stop on the source, handshake, resume on the destination) dominates; Llumnix reports
downtimes of a few tens of milliseconds regardless of length.

Deployments are static (the vllm-static deployment): Llumnix balances load, it does not reshape the
cluster. Its dispatch sees loads only; its migration planner, like Llumnix's llumlets inside the
engines, sees each replica's running requests and their contexts (never their output lengths).
"""

from __future__ import annotations

from collections.abc import Sequence

from oserve.correction import migration_times
from oserve.errors import ConfigError
from oserve.evaluation.baselines import StaticPolicy
from oserve.routing import ReplicaLoad
from oserve.sim.kernel import BalancerView, Migration
from oserve.specs import ClusterSpec, Deployment, ModelSpec


def virtual_blocks(rep: BalancerView) -> float:
    """KV blocks in use, demanded by the queue, and reserved for requests migrating in. Pure."""
    return rep.kv_load_frac * rep.total_blocks + rep.incoming_kv_blocks


def freeness_tokens(rep: BalancerView) -> float:
    """Tokens each running request could still grow by before the KV cache is full (may be < 0). Pure."""
    free = (rep.total_blocks - virtual_blocks(rep)) * rep.block_tokens
    return free / max(1, rep.num_running)


def load_freeness_tokens(load: ReplicaLoad) -> float:
    """`freeness_tokens` from what a router sees of a replica (its load report). Pure."""
    capacity = load.kv_capacity_tokens
    free = capacity - load.kv_load_frac * capacity - load.incoming_kv_tokens
    return free / max(1, load.num_running)


class LlumnixPolicy(StaticPolicy):
    """Static deployment, freeness dispatch, periodic live migration off overloaded replicas."""

    def __init__(self, deployment: Deployment, num_classes: int, model: ModelSpec, cluster: ClusterSpec, *,
                 name: str = "llumnix",
                 migration_interval_s: float | None = 0.5, migrate_out_freeness_tokens: float = 256.0,
                 migrate_in_freeness_tokens: float = 1024.0, max_migrations_per_pair: int = 1,
                 migration_fixed_s: float = 0.02, migration_link_frac: float = 0.5) -> None:
        """
        Args:
            migration_interval_s: seconds between two migration rounds; None turns migration off
                (dispatch alone, for comparison).
            migrate_out_freeness_tokens: a replica whose freeness is below this migrates out (so does one
                whose batch is full with requests waiting).
            migrate_in_freeness_tokens: a replica takes migrations only with freeness above this (and no
                queue, and a free batch slot); above the migrate-out threshold, so moves never ping-pong.
            max_migrations_per_pair: requests moved per source-destination pair per round.
            migration_fixed_s: the part of a move's downtime that does not depend on its size.
            migration_link_frac: the fraction of the link's bandwidth the KV copy achieves.
        """
        if migration_interval_s is not None and not migration_interval_s > 0:
            raise ConfigError(f"LlumnixPolicy: migration_interval_s must be positive or None, "
                              f"got {migration_interval_s}")
        if not migrate_in_freeness_tokens > migrate_out_freeness_tokens:
            raise ConfigError(f"LlumnixPolicy: migrate_in_freeness_tokens ({migrate_in_freeness_tokens}) must exceed "
                              f"migrate_out_freeness_tokens ({migrate_out_freeness_tokens})")
        if max_migrations_per_pair < 1 or migration_fixed_s < 0 or not 0 < migration_link_frac <= 1:
            raise ConfigError(f"LlumnixPolicy: invalid max_migrations_per_pair={max_migrations_per_pair}, "
                              f"migration_fixed_s={migration_fixed_s} or migration_link_frac={migration_link_frac}")
        super().__init__(deployment, num_classes, name)
        self.model, self.cluster = model, cluster
        self.migration_interval_s = migration_interval_s
        self.migrate_out_freeness_tokens = migrate_out_freeness_tokens
        self.migrate_in_freeness_tokens = migrate_in_freeness_tokens
        self.max_migrations_per_pair = max_migrations_per_pair
        self.migration_fixed_s = migration_fixed_s
        self.migration_link_frac = migration_link_frac

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        """The accepting replica of highest freeness (ties: fewer requests, then the lower index)."""
        best, best_key = None, None
        for k, r in enumerate(loads):
            if not r.accepting:
                continue
            key = (-load_freeness_tokens(r), r.num_requests)
            if best_key is None or key < best_key:
                best, best_key = k, key
        return best

    def migration_times(self, context_tokens: int, src: BalancerView, dst: BalancerView) -> tuple[float, float]:
        """(precopy_s, downtime_s) of moving a request with this context from `src` to `dst` (module doc). Pure."""
        return migration_times(self.model, self.cluster, context_tokens, src, dst, self.migration_fixed_s,
                               self.migration_link_frac)

    def _is_source(self, rep: BalancerView) -> bool:
        if not rep.accepting:
            return False  # a retiring replica hands its requests off by itself
        slot_bound = rep.num_waiting > 0 and rep.num_running >= rep.max_num_seqs
        return slot_bound or freeness_tokens(rep) < self.migrate_out_freeness_tokens

    def _takes(self, rep: BalancerView, extra_blocks: int, extra_seqs: int) -> bool:
        """Whether `rep` stays a healthy destination after receiving `extra_seqs` requests of `extra_blocks`."""
        if not rep.accepting or rep.num_waiting or rep.num_running + extra_seqs > rep.max_num_seqs:
            return False
        free = (rep.total_blocks - virtual_blocks(rep) - extra_blocks) * rep.block_tokens
        return free / max(1, rep.num_running + extra_seqs) > self.migrate_in_freeness_tokens

    def plan_migrations(self, replicas: list[BalancerView], now_s: float) -> list[Migration]:
        """Pair overloaded replicas with the least loaded and pick what to move. Pure (reads replicas)."""
        if len(replicas) < 2:
            return []
        freeness = [freeness_tokens(r) for r in replicas]
        sources = sorted((k for k, r in enumerate(replicas) if self._is_source(r)), key=lambda k: (freeness[k], k))
        if not sources:
            return []
        taken = set(sources)
        dests = sorted((k for k, r in enumerate(replicas) if k not in taken and self._takes(r, 0, 0)),
                       key=lambda k: (-freeness[k], k))
        moves: list[Migration] = []
        for s, d in zip(sources, dests):
            src, dst = replicas[s], replicas[d]
            candidates = sorted(src.decoding_contexts())
            blocks = seqs = 0
            for ctx, request_id in candidates:
                if seqs >= self.max_migrations_per_pair:
                    break
                need = -(-(ctx + 1) // dst.block_tokens)  # its context plus the token of its next step
                if not self._takes(dst, blocks + need, seqs + 1):
                    break  # shortest first: a longer one fits no better
                precopy_s, downtime_s = self.migration_times(ctx, src, dst)
                moves.append(Migration(s, d, request_id, need, precopy_s, downtime_s))
                blocks += need
                seqs += 1
        return moves
