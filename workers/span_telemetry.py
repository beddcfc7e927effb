"""What each replica did in a span, from its heartbeats and completions: the live scheduler's `SpanRecord`. Pure.

The simulator's OServe policy reads each replica's cumulative counters at the span's boundaries
(`oserve.evaluation.policies.Telemetry`); live, the same counters come in the engines' heartbeats
(`Heartbeat.busy_s`, `saturated_s`, `num_waiting`), and what each replica finished in its `Completed`
events. The scheduler keeps each replica's latest heartbeat and, at every forecast event, takes a
`snapshot` of the replicas of the decision in force; `span_record` differences two snapshots into the
`SpanRecord` that `SelfCorrectingPlanner.observe` reads, with the very function the simulator uses
(`oserve.planner.learned.replica_windows`), called once per replica: each replica's window runs from
its heartbeat at the previous snapshot to its heartbeat at this one (a heartbeat is up to an interval
old, 10 clock seconds of a 60 s span in the demo at 20x; a window of the span's length would call a
replica that was saturated throughout unsaturated whenever its last heartbeat came early), and holds
the completions that finished between the two heartbeats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from oserve.decision import Decision
from oserve.planner.adaptive import SpanRecord
from oserve.planner.learned import replica_windows, saturated_gpus
from oserve.specs import ReplicaShape
from oserve.streams.schemas import Completion, Heartbeat


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """One replica's cumulative counters at a snapshot (its latest heartbeat), with its shape and GPUs in
    the decision in force: the attributes `replica_windows` reads of a replica's stats."""

    replica_id: str
    shape: ReplicaShape
    gpu_ids: tuple[int, ...]
    at_s: float
    """Clock time of the heartbeat the counters come from."""
    busy_s: float
    saturated_s: float
    num_waiting: int
    ready: bool
    """It was accepting requests (not draining)."""


@dataclass(frozen=True, slots=True)
class _Served:
    """A completion as `replica_windows` reads it (times from the request's arrival at its engine)."""

    replica_gpus: tuple[int, ...]
    routed_class: int
    first_token_s: float
    finish_s: float
    output_tokens: int


def snapshot(heartbeats: Mapping[str, Heartbeat], current: Decision | None) -> dict[str, ReplicaCounters]:
    """The counters of `current`'s replicas from their latest heartbeats (`heartbeats`: replica id -> the
    latest); a replica without one (still starting) is left out. Pure."""
    if current is None:
        return {}
    out = {}
    for r in current.deployment.replicas:
        hb = heartbeats.get(r.replica_id)
        if hb is not None:
            out[r.replica_id] = ReplicaCounters(r.replica_id, r.shape, tuple(r.gpu_ids), hb.at_s, hb.busy_s,
                                                hb.saturated_s, hb.num_waiting, hb.accepting)
    return out


def served_through(before: Mapping[str, ReplicaCounters], now: Mapping[str, ReplicaCounters]) -> list[str]:
    """The replicas that served from one snapshot to the next: in both, with the same shape and GPUs, a newer
    heartbeat and counters that did not go back (a replica restarted under its id counts from 0). Pure."""
    out = []
    for rid, n in now.items():
        b = before.get(rid)
        if b is not None and b.shape == n.shape and b.gpu_ids == n.gpu_ids and n.at_s > b.at_s \
                and n.busy_s >= b.busy_s and n.saturated_s >= b.saturated_s:
            out.append(rid)
    return out


def span_record(before: Mapping[str, ReplicaCounters], now: Mapping[str, ReplicaCounters],
                completions: Iterable[Completion], num_classes: int, span_s: float, *, arrivals: float,
                num_completed: float, saturated_before: frozenset[str] = frozenset(),
                saturated_frac: float = 0.95,
                arrivals_by_class: tuple[float, ...] = ()) -> tuple[SpanRecord, frozenset[str]]:
    """The `SpanRecord` of the span between two snapshots, and the replicas saturated through it (the next
    span's `saturated_before`). Pure.

    Each replica that served through (`served_through`) gives one window from its two heartbeats: its
    saturated seconds differenced, its completions (from `completions`, by replica id) that finished between
    them counted by the class the gateway routed them as (`Completion.type_index`), their mean time per
    output token `(e2e_s - ttft_s) / (output_tokens - 1)`. `saturated_before` names the replicas saturated
    through the span before. `arrivals` and `num_completed` are the span's (all replicas), and
    `arrivals_by_class` its arrivals per class as the gateway classed them; the waiting growth is summed
    over the replicas that served through."""
    kept = served_through(before, now)
    by_replica: dict[str, list[_Served]] = {rid: [] for rid in kept}
    for c in completions:
        mine = by_replica.get(c.replica_id)
        if mine is None:
            continue
        b, n = before[c.replica_id], now[c.replica_id]
        if b.at_s < c.finished_at_s <= n.at_s:
            mine.append(_Served(n.gpu_ids, c.type_index, c.ttft_s, c.e2e_s, c.output_tokens))
    windows = []
    saturated = set()
    for rid in kept:
        b, n = before[rid], now[rid]
        seconds = n.at_s - b.at_s
        windows += replica_windows({b.gpu_ids: b}, [n], by_replica[rid], num_classes, seconds,
                                   {n.gpu_ids} if rid in saturated_before else set())
        if saturated_gpus({b.gpu_ids: b}, [n], seconds, saturated_frac):
            saturated.add(rid)
    growth = float(sum(now[rid].num_waiting - before[rid].num_waiting for rid in kept))
    return SpanRecord(tuple(windows), float(arrivals), float(num_completed), span_s, growth,
                      tuple(arrivals_by_class)), frozenset(saturated)
