"""KV-cache policy for a switch: which running requests drain, which migrate, where, and how. Pure.

Requests on replicas that stay exactly as they are (`SwitchPlan.kept_replicas`) are untouched. Of the
others, requests with short contexts drain: they finish on the old deployment, which keeps serving until
the new one is ready (recomputing or moving a short cache is not worth it). Requests with long contexts
migrate: longest first, each goes to the changed target replica that already holds most of its KV bytes
on the same GPUs, then the one with the most free room, provided the room reserved for it fits — its
context plus `headroom_frac` of it for the tokens it will still generate, rounded up to whole blocks,
inside the replica's KV capacity (`specs.kv_capacity_tokens`). A request that fits nowhere drains.

Each target replica gets one KV buffer pre-allocated before any byte moves: the blocks of the requests
it receives, laid out back to back (a block table per request). The bytes then move with the same
planner as the weights: one KV tensor per (request, layer), so every transfer is layer-aligned, and
pieces are cut to at most `SwitchConfig.max_transfer_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oserve.defaults import MIGRATE_MIN_CONTEXT_TOKENS
from oserve.errors import ConfigError
from oserve.specs import ClusterSpec, MemoryConfig, ModelSpec, Replica, kv_capacity_tokens, stage_kv_bytes_per_token
from oserve.switch.intervals import intersection, length
from oserve.switch.layout import RunningRequest, TensorSpec, replica_kv_layout
from oserve.switch.planner import SwitchConfig, SwitchPlan, Transfer, plan_transfers


@dataclass(frozen=True, slots=True)
class KVPolicy:
    """How running requests are handled when their replica changes."""

    migrate_min_context_tokens: int = MIGRATE_MIN_CONTEXT_TOKENS
    """Requests with fewer cached tokens drain on the old deployment; the others migrate."""
    headroom_frac: float = 0.25
    """Room reserved on the target beyond a migrated request's context, as a fraction of it."""
    block_tokens: int = 16
    """Tokens per KV block of the pre-allocated buffers (vLLM's default block size)."""

    def __post_init__(self) -> None:
        if self.migrate_min_context_tokens < 0:
            raise ConfigError(f"KVPolicy: migrate_min_context_tokens must be >= 0, got {self.migrate_min_context_tokens}")
        if not 0.0 <= self.headroom_frac <= 10.0:
            raise ConfigError(f"KVPolicy: headroom_frac must be in [0, 10], got {self.headroom_frac}")
        if self.block_tokens < 1:
            raise ConfigError(f"KVPolicy: block_tokens must be >= 1, got {self.block_tokens}")

    def reserved_blocks(self, context_tokens: int) -> int:
        """Blocks a migrated request of this context takes on its target, headroom included."""
        tokens = context_tokens + int(context_tokens * self.headroom_frac + 0.999999)
        return -(-tokens // self.block_tokens)


@dataclass(frozen=True, slots=True)
class KVMigration:
    request_id: str
    src_replica_id: str
    dst_replica_id: str
    context_tokens: int
    first_block: int
    """First block of its block table in the target replica's buffer (its blocks are consecutive)."""
    num_blocks: int


@dataclass(frozen=True, slots=True)
class KVBuffer:
    """The KV buffer pre-allocated on one target replica before the migration starts."""

    replica_id: str
    num_blocks: int
    block_tokens: int
    stage_bytes: tuple[int, ...]
    """Bytes on each GPU of each pipeline stage."""


@dataclass(frozen=True, slots=True)
class KVMigrationPlan:
    """What happens to every running request, and the transfers that move the migrating ones."""

    stay: tuple[str, ...]
    """Requests on kept replicas: untouched."""
    drained: tuple[tuple[str, str], ...]
    """(request id, why): 'short' context, or 'no-room' on any target."""
    migrations: tuple[KVMigration, ...]
    buffers: tuple[KVBuffer, ...]
    transfers: tuple[Transfer, ...]
    nvlink_bytes: int
    network_bytes: int
    local_bytes: int
    reused_bytes: int
    switch_seconds: float
    lower_bound_seconds: float
    tensors: tuple[TensorSpec, ...] = ()
    """The KV tensors the transfers name."""

    @classmethod
    def empty(cls) -> KVMigrationPlan:
        return cls((), (), (), (), (), 0, 0, 0, 0, 0.0, 0.0)

    @property
    def is_empty(self) -> bool:
        return not self.migrations and not self.drained


def _overlap_bytes(model: ModelSpec, req: RunningRequest, src: Replica, dst: Replica) -> int:
    """KV bytes of `req` that `dst` would hold on GPUs that already hold them in `src`."""
    shared = set(src.gpu_ids) & set(dst.gpu_ids)
    if not shared:
        return 0
    tensors, have = replica_kv_layout(model, src, [req])
    _, want = replica_kv_layout(model, dst, [req])
    return sum(length(intersection(lines, have[g].get(name, ()))) * tensors[name].line_bytes
               for g in shared for name, lines in want[g].items())


def plan_kv_migration(model: ModelSpec, cluster: ClusterSpec, weight_plan: SwitchPlan,
                      requests: Sequence[RunningRequest], *, policy: KVPolicy = KVPolicy(),
                      planner: str = "improved", config: SwitchConfig = SwitchConfig(),
                      memory: MemoryConfig = MemoryConfig()) -> KVMigrationPlan:
    """Decide drain or migrate for every running request and plan the KV transfers. Pure.

    The target placement is the weight plan's (after any relabelling of GPUs).

    Raises:
        ConfigError: a request on a replica the source deployment does not have, or a repeated id.
    """
    if weight_plan.is_empty or not requests:
        return KVMigrationPlan.empty()
    source = {r.replica_id: r for r in weight_plan.source.replicas}
    kept_src = {s for _, s in weight_plan.kept_replicas}
    kept_dst = {t for t, _ in weight_plan.kept_replicas}
    targets = [r for r in weight_plan.target.replicas if r.replica_id not in kept_dst]
    ids = [q.request_id for q in requests]
    if len(set(ids)) != len(ids):
        raise ConfigError("plan_kv_migration: a request id appears twice")
    for q in requests:
        if q.replica_id not in source:
            raise ConfigError(f"request {q.request_id} runs on replica {q.replica_id!r}, not in the source deployment")
    capacity = {r.replica_id: kv_capacity_tokens(model, cluster.gpu, r.shape, memory) // policy.block_tokens
                for r in targets}  # replica_id -> blocks
    used = {r.replica_id: 0 for r in targets}
    stay, drained = [], []
    moving: list[tuple[RunningRequest, Replica]] = []
    for q in sorted(requests, key=lambda q: (-q.context_tokens, q.request_id)):
        if q.replica_id in kept_src:
            stay.append(q.request_id)
            continue
        if q.context_tokens < policy.migrate_min_context_tokens:
            drained.append((q.request_id, "short"))
            continue
        need = policy.reserved_blocks(q.context_tokens)
        fits = [r for r in targets if used[r.replica_id] + need <= capacity[r.replica_id]]
        if not fits:
            drained.append((q.request_id, "no-room"))
            continue
        src = source[q.replica_id]
        best = max(fits, key=lambda r: (_overlap_bytes(model, q, src, r),
                                        capacity[r.replica_id] - used[r.replica_id], [-g for g in r.gpu_ids]))
        used[best.replica_id] += need
        moving.append((q, best))
    migrations = []
    next_block = {r.replica_id: 0 for r in targets}
    tensors: dict[str, TensorSpec] = {}
    have: dict[int, dict] = {}
    want: dict[int, dict] = {}
    for q, dst in sorted(moving, key=lambda m: m[0].request_id):
        n = policy.reserved_blocks(q.context_tokens)
        migrations.append(KVMigration(q.request_id, q.replica_id, dst.replica_id, q.context_tokens,
                                      next_block[dst.replica_id], n))
        next_block[dst.replica_id] += n
        t_src, h = replica_kv_layout(model, source[q.replica_id], [q])
        _, w = replica_kv_layout(model, dst, [q])
        tensors.update(t_src)
        for layout, into in ((h, have), (w, want)):
            for g, lines in layout.items():
                into.setdefault(g, {}).update(lines)
    buffers = tuple(KVBuffer(r.replica_id, used[r.replica_id], policy.block_tokens,
                             tuple(used[r.replica_id] * policy.block_tokens * b
                                   for b in stage_kv_bytes_per_token(model, r.shape)))
                    for r in targets if used[r.replica_id])
    tp = plan_transfers(tensors, have, want, cluster, planner, config)
    return KVMigrationPlan(tuple(sorted(stay)), tuple(sorted(drained)), tuple(migrations), buffers, tp.transfers,
                           tp.nvlink_bytes, tp.network_bytes, tp.local_bytes, tp.reused_bytes, tp.switch_seconds,
                           tp.lower_bound_seconds, tuple(tensors.values()))


__all__ = ["KVBuffer", "KVMigration", "KVMigrationPlan", "KVPolicy", "plan_kv_migration"]
