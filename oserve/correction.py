"""Correct after the fact: a request that outgrows the class it was routed as moves to a replica of the class
it turned out to be. Pure.

A gateway does not know a request's output length at arrival; it classes the request by an estimate
(`oserve.online_types`). But it learns a lower bound as the answer streams: a request that has generated g
tokens will have at least g. Classes are clusters of (input, output) in log space, so with its input known
and g tokens out, a request's class *so far* is the nearest centroid to (input, g). Once that class is one
of longer answers than the class it is routed as, the request has outgrown it. If the decision in force
does not let its replica serve that class, it moves, live with its KV (as Llumnix moves requests), to the
least loaded replica that does and has room for its context. A request classed too long is never moved: a
bound from below says nothing against it.

What a move costs is Llumnix's model (`migration_times`): the KV copy overlaps decoding on the source
stage by stage; only the last stage, one KV block, plus a fixed handshake, stops the request.

The simulator's policies and the twin call `OutgrownMover.plan` every `CorrectionConfig.interval_s` with
what each replica's engine reports (`oserve.sim.kernel.BalancerView`: the contexts of its running requests,
never their output lengths). The live gateway applies the same rule by message: the dispatch carries the
count at which a request outgrows its class (`move_after_tokens`), the engine asks at that count, and the
gateway says move only to a replica of the grown class with room for its context (`workers.gateway`,
`MoveAsk`); the live move re-prefills, where the simulator copies the KV.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from oserve.errors import ConfigError
from oserve.sim.kernel import BalancerView, Migration
from oserve.specs import ClusterSpec, ModelSpec, stage_kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class CorrectionConfig:
    """How requests that outgrow their class are moved."""

    interval_s: float = 1.0
    """Seconds between two looks at the running requests (a gateway sees tokens stream back continuously;
    a second bounds how late it acts on them)."""
    max_moves_per_round: int = 16
    """Moves started per look, at most (the longest outgrown first)."""
    migration_fixed_s: float = 0.02
    """The part of a move's downtime that does not depend on its size (Llumnix's few tens of ms)."""
    migration_link_frac: float = 0.5
    """The fraction of the link's bandwidth the KV copy achieves."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"CorrectionConfig: interval_s must be positive, got {self.interval_s}")
        if self.max_moves_per_round < 1:
            raise ConfigError(f"CorrectionConfig: max_moves_per_round must be >= 1, got {self.max_moves_per_round}")
        if self.migration_fixed_s < 0 or not 0 < self.migration_link_frac <= 1:
            raise ConfigError(f"CorrectionConfig: invalid migration_fixed_s={self.migration_fixed_s} or "
                              f"migration_link_frac={self.migration_link_frac}")


def migration_times(model: ModelSpec, cluster: ClusterSpec, context_tokens: int, src: BalancerView,
                    dst: BalancerView, fixed_s: float, link_frac: float) -> tuple[float, float]:
    """(precopy_s, downtime_s) of moving a request with this context from `src` to `dst`: every GPU copies its
    own shard to its peer in parallel, at `link_frac` of NVLink within a node, of the network across. Pure.

        precopy_s  = context_tokens * kv_bytes_per_token_per_gpu / link      (overlapped with decoding)
        downtime_s = fixed_s + block_tokens * kv_bytes_per_token_per_gpu / link
    """
    per_token_bytes = max(stage_kv_bytes_per_token(model, src.shape))
    nodes = {cluster.node_of(g) for g in (*src.gpu_ids, *dst.gpu_ids)}
    link = cluster.nvlink_bytes_per_s if len(nodes) <= 1 else cluster.network_bytes_per_s
    bytes_per_s = link * link_frac
    return context_tokens * per_token_bytes / bytes_per_s, fixed_s + src.block_tokens * per_token_bytes / bytes_per_s


def outgrown(class_so_far: int, routed_class: int, log_outputs: np.ndarray) -> bool:
    """Whether a request routed as `routed_class` has outgrown it: its class so far is one of longer answers
    (a larger centroid output). Pure."""
    return class_so_far != routed_class and bool(log_outputs[class_so_far] > log_outputs[routed_class])


class OutgrownMover:
    """Tracks the requests a gateway routed (input length and class) and plans the moves of those that outgrew
    their class (module docstring). `class_at(input_tokens, output_tokens)` is the gateway's classes (the
    nearest centroid), `log_outputs()` each class's centroid output in log1p tokens."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, class_at: Callable[[int, int], int],
                 log_outputs: Callable[[], np.ndarray], config: CorrectionConfig = CorrectionConfig()) -> None:
        self.model, self.cluster, self.config = model, cluster, config
        self._class_at = class_at
        self._log_outputs = log_outputs
        self._routed: dict[int, tuple[int, int]] = {}
        """request id -> (input tokens, class it is routed as): until it finishes."""
        self.num_moves = 0
        self.num_reclassed = 0

    def admit(self, request_id: int, input_tokens: int, routed_class: int) -> None:
        self._routed[request_id] = (int(input_tokens), int(routed_class))

    def done(self, request_id: int) -> None:
        self._routed.pop(request_id, None)

    def routed_class(self, request_id: int) -> int | None:
        entry = self._routed.get(request_id)
        return entry[1] if entry is not None else None

    def plan(self, replicas: Sequence[BalancerView], eligible: Callable[[int], tuple[float, ...] | None]
             ) -> list[Migration]:
        """The moves for this look (module docstring). `eligible(j)` is the weights of the decision in force
        over `replicas` for class j (None: no row). A request that outgrew its class on a replica that serves
        the class it grew into is reclassed and stays."""
        if len(replicas) < 2:
            return []
        log_out = self._log_outputs()
        # (generated so far, source, request id, class so far, context) of each request to move
        wanted: list[tuple[int, int, int, int, int]] = []
        for s, src in enumerate(replicas):
            if not src.accepting:
                continue  # a retiring replica hands its requests off by itself
            for ctx, rid in src.decoding_contexts():
                entry = self._routed.get(rid)
                if entry is None:
                    continue
                inp, cls = entry
                generated = max(ctx - inp, 1)
                now_cls = self._class_at(inp, generated)
                if not outgrown(now_cls, cls, log_out):
                    continue
                w = eligible(now_cls)
                if w is None or (s < len(w) and w[s] > 0):
                    self._routed[rid] = (inp, now_cls)  # its replica serves what it grew into: it stays
                    self.num_reclassed += 1
                    continue
                wanted.append((generated, s, rid, now_cls, ctx))
        if not wanted:
            return []
        wanted.sort(key=lambda x: (-x[0], x[2]))
        reserved = [0] * len(replicas)
        moves: list[Migration] = []
        for _, s, rid, now_cls, ctx in wanted:
            if len(moves) >= self.config.max_moves_per_round:
                break
            src = replicas[s]
            w = eligible(now_cls)
            assert w is not None
            best, best_key = None, None
            for d, dst in enumerate(replicas):
                if d == s or d >= len(w) or not w[d] > 0 or not dst.accepting or not dst.ready:
                    continue
                need = -(-(ctx + 1) // dst.block_tokens)  # its context plus the token of its next step
                used = dst.kv_load_frac * dst.total_blocks + dst.incoming_kv_blocks + reserved[d]
                if used + need > dst.total_blocks:
                    continue  # no room: it would queue there behind the destination's own
                key = (used / max(1, dst.total_blocks), dst.num_requests, d)
                if best_key is None or key < best_key:
                    best, best_key = d, key
            if best is None:
                continue  # nowhere to go now: looked at again next time
            dst = replicas[best]
            need = -(-(ctx + 1) // dst.block_tokens)
            precopy_s, downtime_s = migration_times(self.model, self.cluster, ctx, src, dst,
                                                    self.config.migration_fixed_s, self.config.migration_link_frac)
            moves.append(Migration(s, best, rid, need, precopy_s, downtime_s))
            reserved[best] += need
            self.num_moves += 1  # its class stays until it lands: a move the kernel cancels is tried again
        return moves


def move_after_tokens(centroids_log: np.ndarray, input_tokens: int, routed_class: int,
                      moves_for: Callable[[int], bool], max_tokens: int) -> int | None:
    """The fewest generated tokens at which a request routed as `routed_class` has outgrown it into a class
    `moves_for(j)` says it must move for (its replica does not serve j, another does); None when that never
    happens within `max_tokens`. The live gateway sends it with the dispatch, and the engine asks to hand the
    request back at that count (`streams.schemas.Dispatch.move_after_tokens`, `MoveAsk`); the simulator's
    `OutgrownMover` applies the same rule by looking at the running requests. Pure.

    Along a line of fixed input the nearest centroid (`oserve.workload_types`, log space, ties to the lower
    index) changes only where the line crosses the bisector of two centroids, so the class is tried just
    around those crossings, and the smallest count where the rule holds is one of them (or 1)."""
    c = np.asarray(centroids_log, dtype=np.float64).reshape(-1, 2)
    k = len(c)
    if max_tokens < 1 or k < 2:
        return None
    x = math.log1p(input_tokens)

    def class_at(g: int) -> int:
        d = (c[:, 0] - x) ** 2 + (c[:, 1] - math.log1p(g)) ** 2
        return int(np.argmin(d))

    candidates = {1}
    for i in range(k):
        for j in range(i + 1, k):
            db = c[j, 1] - c[i, 1]
            if db == 0:
                continue
            # centroids a hair apart overflow to +-inf (never a crossing within max_tokens, or none below 1)
            with np.errstate(over="ignore", invalid="ignore"):
                y = ((x - c[j, 0]) ** 2 - (x - c[i, 0]) ** 2 + c[j, 1] ** 2 - c[i, 1] ** 2) / (2 * db)
            if y > math.log1p(max_tokens) + 1e-9:
                continue
            g0 = int(math.floor(math.expm1(y))) if y > 0 else 0
            candidates.update(g for g in range(g0 - 1, g0 + 3) if 1 <= g <= max_tokens)
    for g in sorted(candidates):
        j = class_at(g)
        if outgrown(j, routed_class, c[:, 1]) and moves_for(j):
            return g
    return None
