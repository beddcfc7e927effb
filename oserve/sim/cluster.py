"""The cluster simulator: a tiny discrete-event kernel over simulated replicas, a router, and policies.

Pure: virtual time only, randomness nowhere (routing is smooth weighted round robin). The kernel pops
the earliest event — an arrival, a replica's step end, a span boundary, a replica switching in, a
hand-off — advances time to it and applies it. Policies return decisions as data (`Decision`); the
kernel applies them:

- at each span boundary the policy sees the per-type counts observed so far and may return a new
  deployment with routing weights and a switching time;
- replicas present in both deployments (same shape on the same GPUs) keep serving untouched;
- retired replicas stop taking requests; their queued requests are re-routed at once, their running
  requests drain until the switch completes, and then what is still running moves to the new
  replicas: requests with at least `migrate_min_context_tokens` of context migrate with their KV
  cache, shorter ones are recomputed there;
- new replicas start serving `switch_s` after the boundary (requests routed to them wait in their
  queue meanwhile);
- live migration, for a policy with a `migration_interval_s` (and `plan_migrations`): every interval
  the policy names running requests to move (`Migration`s). Each keeps decoding on its source for the
  move's `precopy_s` (the KV copied while it runs), leaves the source at the next step boundary, and
  after `downtime_s` (the last copy stage) is queued first on the destination with its KV, so it
  resumes without a recompute. Policies without the attribute get no such events.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from oserve.errors import ConfigError
from oserve.perfmodel import PerfModel
from oserve.sim.engine import SimReplica, SimRequest, TokenHistogram
from oserve.specs import (ClusterSpec, Deployment, EngineConfig, GPUSpec, MemoryConfig, ModelSpec, Replica,
                          kv_capacity_tokens)

ARRIVAL, STEP_END, SPAN, ACTIVATE, HANDOFF, MIGRATE, MIGRATE_OUT, MIGRATE_IN = 0, 1, 2, 3, 4, 5, 6, 7
# Same-time order: a step ending frees room before a span boundary re-plans, which goes before arrivals;
# live migration's events come last (a balancer looks at the state after the arrivals of that instant).
_PRIORITY = {STEP_END: 0, HANDOFF: 1, ACTIVATE: 2, SPAN: 3, ARRIVAL: 4, MIGRATE_IN: 5, MIGRATE_OUT: 6, MIGRATE: 7}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the simulated cluster behaves."""

    span_s: float = 60.0
    """Re-planning period."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    migrate_min_context_tokens: int = 512
    """On a switch, running requests with at least this context migrate with their KV; shorter ones drain
    on the old replica and, if still running when the switch completes, are recomputed elsewhere."""
    horizon_after_last_arrival_s: float = 3600.0
    """Requests unfinished this long after the last arrival are reported as dropped ('horizon')."""

    def __post_init__(self) -> None:
        if not self.span_s > 0:
            raise ConfigError(f"SimConfig: span_s must be positive, got {self.span_s}")
        if self.migrate_min_context_tokens < 0:
            raise ConfigError("SimConfig: migrate_min_context_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer at a span boundary: the deployment and how to route each type over it."""

    deployment: Deployment
    weights: tuple[tuple[float, ...], ...]
    """weights[j][k]: share of type j's requests for replica k of `deployment` (any scale, >= 0)."""
    switch_s: float = 0.0
    """Seconds until replicas new in this deployment start serving."""
    forecast_rps: tuple[float, ...] = ()
    """The per-type rates the decision was planned for (reported, not used by the kernel)."""
    label: str = ""
    drain_retired: bool = False
    """Retired replicas finish everything they run instead of handing it off when the switch completes
    (free switching, as the oracle assumes: no request is disturbed)."""


@dataclass(frozen=True, slots=True)
class Migration:
    """A policy's order to live-migrate one running request, with the move's modelled times."""

    src_index: int
    """Index of the source in the replicas the policy was shown."""
    dst_index: int
    request: SimRequest
    """A request decoding on the source."""
    kv_blocks: int
    """KV blocks the destination reserves for it while it is in flight."""
    precopy_s: float
    """Seconds the KV copy overlaps decoding on the source before the request stops there."""
    downtime_s: float
    """Seconds between leaving the source and being queued on the destination (last copy stage)."""

    def __post_init__(self) -> None:
        if self.precopy_s < 0 or self.downtime_s < 0 or self.kv_blocks < 0:
            raise ConfigError(f"Migration: negative time or blocks in {self}")


@dataclass
class SpanView:
    """What a policy may look at when a span starts."""

    span_index: int
    now_s: float
    span_s: float
    observed_counts: np.ndarray
    """(spans so far, k) per-type arrivals of the spans that have ended."""
    true_next_counts: np.ndarray | None
    """The coming span's true per-type counts; only for oracle policies."""
    current: Decision | None
    last_arrivals: tuple[np.ndarray, np.ndarray] | None = None
    """(offsets in seconds from the span's start, type index) of every request of the span that just
    ended: what a gateway saw arrive (not their output lengths)."""
    true_next_arrivals: tuple[np.ndarray, np.ndarray] | None = None
    """The same for the coming span; only for oracle policies."""


class Policy(Protocol):
    name: str

    def decide(self, view: SpanView) -> Decision | None:
        """Return a new decision, or None to keep the current one."""

    def route(self, req: SimRequest, replicas: list[SimReplica]) -> int | None:
        """Pick a replica index for a request, or None to use the decision's weights."""

    # Optional, for live migration (the kernel checks with getattr):
    # migration_interval_s: float | None — seconds between two `plan_migrations` calls; None: never.
    # def plan_migrations(self, replicas: list[SimReplica], now_s: float) -> list[Migration]: ...


class SmoothRouter:
    """Smooth weighted round robin per type (nginx's): deterministic, proportional to weights."""

    def __init__(self, weights: tuple[tuple[float, ...], ...], fallback: list[float]) -> None:
        self.weights = [np.asarray(w, dtype=float) for w in weights]
        self.fallback = np.asarray(fallback, dtype=float)
        self.current = [np.zeros(len(fallback)) for _ in weights]

    def pick(self, j: int, accepting: np.ndarray) -> int | None:
        w = self.weights[j] if j < len(self.weights) else self.fallback
        w = np.where(accepting, w, 0.0)
        if w.sum() <= 0:
            w = np.where(accepting, self.fallback, 0.0)
            if w.sum() <= 0:
                return None
        cur = self.current[j] if j < len(self.current) else np.zeros(len(w))
        cur += w
        k = int(np.argmax(cur))
        cur[k] -= w.sum()
        return k


@dataclass
class SimResult:
    """Everything a run produced, per request and over time."""

    policy: str
    arrival_s: np.ndarray
    type_index: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    finish_s: np.ndarray
    dropped: np.ndarray
    """Bool per request: never finished (rejected, or past the horizon)."""
    num_preemptions: int
    num_migrations: int
    tbt: TokenHistogram
    output_tokens: np.ndarray
    spans: list[dict]
    """One dict per span: start_s, deployment (list of (replica_id, str(shape), gpu_ids)), forecast_rps,
    counts, switched, switch_s."""
    num_events: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    """Why requests were dropped: 'rejected' (the prompt fits no replica's KV cache), 'horizon'
    (unfinished `horizon_after_last_arrival_s` after the last arrival)."""

    def percentile(self, what: str, q: float) -> float:
        if what == "tbt":
            return self.tbt.quantile(q / 100.0)
        values = {"e2e": self.e2e_s, "ttft": self.ttft_s}[what][~self.dropped]
        return float(np.percentile(values, q)) if len(values) else math.nan

    @property
    def duration_s(self) -> float:
        done = self.finish_s[~self.dropped]
        end = float(done.max()) if len(done) else float(self.arrival_s.max())
        return max(end - float(self.arrival_s.min()), 1e-9)

    @property
    def throughput_rps(self) -> float:
        """Finished requests per second, from the first arrival to the last finish."""
        return float((~self.dropped).sum()) / self.duration_s

    @property
    def token_throughput(self) -> float:
        return float(self.output_tokens[~self.dropped].sum()) / self.duration_s

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "requests": int(len(self.arrival_s)),
            "finished": int((~self.dropped).sum()),
            "dropped": int(self.dropped.sum()),
            "drop_reasons": dict(self.drop_reasons),
            "p50_e2e_s": self.percentile("e2e", 50), "p90_e2e_s": self.percentile("e2e", 90),
            "p99_e2e_s": self.percentile("e2e", 99),
            "p50_ttft_s": self.percentile("ttft", 50), "p90_ttft_s": self.percentile("ttft", 90),
            "p99_ttft_s": self.percentile("ttft", 99),
            "p50_tbt_s": self.percentile("tbt", 50), "p90_tbt_s": self.percentile("tbt", 90),
            "p99_tbt_s": self.percentile("tbt", 99),
            "throughput_rps": self.throughput_rps, "token_throughput": self.token_throughput,
            "preemptions": self.num_preemptions, "migrations": self.num_migrations,
            "switches": sum(1 for s in self.spans if s["switched"]),
        }


def simulate(model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, arrival_s: np.ndarray, input_tokens: np.ndarray,
             output_tokens: np.ndarray, type_index: np.ndarray, num_types: int, policy: Policy,
             config: SimConfig = SimConfig(), perf: PerfModel | None = None,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Run `policy` over a trace on the simulated cluster. Pure and deterministic.

    `type_index` is the type the router sees for each request. `progress`, when given, is called with
    the fraction of arrivals processed, now and then.
    """
    kernel = _Kernel(model, gpu, cluster, np.asarray(arrival_s, dtype=float), np.asarray(input_tokens),
                     np.asarray(output_tokens), np.asarray(type_index), num_types, policy, config,
                     perf or PerfModel(model, gpu, gpus_per_node=cluster.gpus_per_node))
    return kernel.run(progress)


class _Kernel:
    """State of one simulation run; `simulate` is its only user."""

    def __init__(self, model, gpu, cluster, arrival_s, input_tokens, output_tokens, type_index, num_types,
                 policy, config: SimConfig, perf: PerfModel) -> None:
        if len(arrival_s) == 0:
            raise ConfigError("simulate: the trace has no requests")
        order = np.argsort(arrival_s, kind="stable")
        self.arrival_s = arrival_s[order]
        self.output_tokens = output_tokens[order]
        self.type_index = type_index[order]
        self.model, self.gpu, self.cluster, self.policy, self.config, self.perf = model, gpu, cluster, policy, config, perf
        n = len(self.arrival_s)
        self.t0 = float(self.arrival_s[0])
        self.num_spans = max(1, int(math.ceil((self.arrival_s[-1] - self.t0 + 1e-9) / config.span_s)))
        span_of = np.minimum(((self.arrival_s - self.t0) // config.span_s).astype(int), self.num_spans - 1)
        self.true_counts = np.zeros((self.num_spans, num_types), dtype=np.int64)
        np.add.at(self.true_counts, (span_of, self.type_index), 1)
        self.horizon = float(self.arrival_s[-1]) + config.horizon_after_last_arrival_s
        inp = input_tokens[order]
        self.reqs = [SimRequest(i, int(self.type_index[i]), float(self.arrival_s[i]), int(inp[i]),
                                int(self.output_tokens[i])) for i in range(n)]
        self.tbt = TokenHistogram()
        self.heap: list = []
        self.seq = 0
        self.replicas: list[SimReplica] = []
        self.router: SmoothRouter | None = None
        self.decision: Decision | None = None
        self.pending: list[SimRequest] = []
        self.spans: list[dict] = []
        self.num_migrations = 0
        self.handoff_due: set[int] = set()
        self._span_bounds: np.ndarray | None = None
        self.all_replicas: list[SimReplica] = []  # id() of retired replicas to empty at their next step end
        interval = getattr(policy, "migration_interval_s", None)
        if interval is not None and not interval > 0:
            raise ConfigError(f"{policy.name}: migration_interval_s must be positive or None, got {interval}")
        self.migration_interval_s: float | None = interval if hasattr(policy, "plan_migrations") else None
        self.leaving: dict[int, list[Migration]] = {}  # id(source) -> moves to detach at its next step end

    def push(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, _PRIORITY[kind], self.seq, kind, payload))

    def schedule(self, rep: SimReplica, end: float | None) -> None:
        if end is not None:
            self.push(end, STEP_END, (rep, rep.step_token))

    def make_replica(self, spec: Replica, available_s: float) -> SimReplica:
        kv = kv_capacity_tokens(self.model, self.gpu, spec.shape, self.config.memory)
        rep = SimReplica(spec.replica_id, spec.shape, self.perf.timer(spec.shape), self.config.engine, kv,
                         self.config.memory.block_tokens, available_s, self.tbt)
        rep.gpu_ids = tuple(spec.gpu_ids)
        self.all_replicas.append(rep)
        return rep

    def dispatch(self, req: SimRequest, now: float) -> None:
        k = self.policy.route(req, self.replicas)
        if k is None or not self.replicas[k].accepting:
            accepting = np.array([r.accepting for r in self.replicas], dtype=bool)
            k = self.router.pick(req.type_index, accepting) if (self.router is not None and len(accepting)) else None
        if k is None:
            self.pending.append(req)  # no replica at all: wait for the next decision
            return
        rep = self.replicas[k]
        self.schedule(rep, rep.enqueue(req, now))

    def apply(self, new: Decision, now: float) -> bool:
        """Move to a new decision; True when any replica changed."""
        old_by_key = {(r.shape, tuple(sorted(r.gpu_ids))): r for r in self.replicas}
        new_reps = []
        for spec in new.deployment.replicas:
            rep = old_by_key.pop((spec.shape, tuple(sorted(spec.gpu_ids))), None)
            if rep is None:
                rep = self.make_replica(spec, now + new.switch_s)
                if new.switch_s > 0:
                    self.push(now + new.switch_s, ACTIVATE, rep)
            rep.replica_id = spec.replica_id
            new_reps.append(rep)
        leaving = list(old_by_key.values())
        switched = len(leaving) > 0 or len(new_reps) != len(self.replicas) or self.decision is None
        self.replicas = new_reps
        self.decision = new
        self.router = SmoothRouter(new.weights, [1.0] * len(new_reps))
        for rep in leaving:
            rep.accepting = False
            for req in rep.take_waiting():
                self.dispatch(req, now)
            if not new.drain_retired:
                self.push(now + new.switch_s, HANDOFF, rep)
        waiting, self.pending = self.pending, []
        for req in waiting:
            self.dispatch(req, now)
        return switched

    def hand_off(self, rep: SimReplica, now: float) -> None:
        """Move what a retired replica still runs to the current replicas (KV kept for long contexts)."""
        self.handoff_due.discard(id(rep))
        for req in rep.take_all():
            if req.ctx >= self.config.migrate_min_context_tokens:
                self.num_migrations += 1
                req.num_migrations += 1
                req.blocks = 0  # re-reserved on the target; its prefill progress and context stay
                if req.prefilled >= req.prompt_tokens:
                    # It was decoding: on the target its next step is a one-token chunk over the
                    # migrated context (as a decode step would be), so it is timed and emits a token.
                    req.prompt_tokens = req.prefilled + 1
            else:
                if req.ctx > 0:
                    req.drop_kv()
            self.dispatch(req, now)

    # --- live migration ---------------------------------------------------------------------------

    def on_migrate(self, now: float, arrivals_left: bool) -> None:
        """Ask the policy what to move, start those moves, and tick again while there is work."""
        for m in self.policy.plan_migrations(self.replicas, now):
            if not (0 <= m.src_index < len(self.replicas) and 0 <= m.dst_index < len(self.replicas)):
                raise ConfigError(f"{self.policy.name}: migration between replicas {m.src_index} -> {m.dst_index} "
                                  f"of {len(self.replicas)}")
            src, dst, req = self.replicas[m.src_index], self.replicas[m.dst_index], m.request
            if src is dst or not dst.accepting or not src.is_decoding(req) or req.request_id in src.migrating_out:
                continue  # not movable (any more): the policy's view was stale or it asked twice
            src.migrating_out.add(req.request_id)
            dst.incoming_kv_blocks += m.kv_blocks
            self.push(now + m.precopy_s, MIGRATE_OUT, (src, dst, m))
        busy = arrivals_left or self.pending or any(r.num_requests or r.migrating_out or r.incoming_kv_blocks
                                                    for r in self.all_replicas)
        if busy:
            self.push(now + self.migration_interval_s, MIGRATE, None)

    def cancel_migration(self, m_entry) -> None:
        src, dst, m = m_entry
        src.migrating_out.discard(m.request.request_id)
        dst.incoming_kv_blocks -= m.kv_blocks

    def migrate_out(self, entry, now: float) -> None:
        """The pre-copy is done: stop the request on its source at the next step boundary."""
        src, dst, m = entry
        if not src.is_decoding(m.request) or id(src) in self.handoff_due:
            self.cancel_migration(entry)  # it finished, was preempted or handed off meanwhile
            return
        if not src.busy:
            self.detach(src, [entry], now)
            self.schedule(src, src.wake(now))
            return
        self.leaving.setdefault(id(src), []).append(entry)
        token = src.step_token
        end = src.cut(now)
        if token != src.step_token:
            self.push(end, STEP_END, (src, src.step_token))

    def detach(self, src: SimReplica, entries: list, now: float) -> None:
        """Take the requests of `entries` off `src` (between its steps) and put them in flight."""
        for entry in entries:
            req = entry[2].request
            if not src.is_decoding(req):
                self.cancel_migration(entry)
                continue
            src.take_decoding(req)
            src.migrating_out.discard(req.request_id)
            self.num_migrations += 1
            req.num_migrations += 1
            req.blocks = 0  # re-reserved on the destination; context and tokens stay
            # on the destination its next step is a one-token chunk over the migrated context (as a
            # decode step would be), so it is timed and emits a token
            req.prompt_tokens = req.prefilled + 1
            self.push(now + entry[2].downtime_s, MIGRATE_IN, entry)

    def migrate_in(self, entry, now: float) -> None:
        """The last copy stage is done: the request resumes on its destination, first in the queue."""
        src, dst, m = entry
        dst.incoming_kv_blocks -= m.kv_blocks
        if dst.accepting and any(r is dst for r in self.replicas):
            self.schedule(dst, dst.enqueue(m.request, now, front=True))
        else:
            self.dispatch(m.request, now)  # the destination retired meanwhile: any current replica, KV kept

    def span_arrivals(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets from the span's start, types) of span i's arrivals; None outside the trace."""
        if not 0 <= i < self.num_spans:
            return None
        if self._span_bounds is None:
            edges = self.t0 + np.arange(self.num_spans + 1) * self.config.span_s
            edges[-1] = np.inf
            self._span_bounds = np.searchsorted(self.arrival_s, edges, side="left")
        lo, hi = int(self._span_bounds[i]), int(self._span_bounds[i + 1])
        return self.arrival_s[lo:hi] - (self.t0 + i * self.config.span_s), self.type_index[lo:hi]

    def on_span(self, i: int, now: float) -> None:
        span_s = self.config.span_s
        view = SpanView(i, now, span_s, self.true_counts[:i], self.true_counts[i] if i < self.num_spans else None,
                        self.decision, self.span_arrivals(i - 1), self.span_arrivals(i))
        new = self.policy.decide(view)
        switched = self.apply(new, now) if new is not None else False
        d = self.decision
        self.spans.append({
            "start_s": now - self.t0, "span_index": i,
            "deployment": [(r.replica_id, str(r.shape), list(r.gpu_ids)) for r in self.replicas],
            "forecast_rps": list(d.forecast_rps) if d else [], "counts": self.true_counts[i].tolist(),
            "switched": switched, "switch_s": d.switch_s if (d and switched and i > 0) else 0.0,
            "label": d.label if d else ""})
        if i + 1 < self.num_spans:
            self.push(self.t0 + (i + 1) * span_s, SPAN, i + 1)

    def run(self, progress: Callable[[float], None] | None) -> SimResult:
        n = len(self.reqs)
        arrival_s = self.arrival_s
        heap = self.heap
        self.push(self.t0, SPAN, 0)
        if self.migration_interval_s is not None:
            self.push(self.t0 + self.migration_interval_s, MIGRATE, None)
        next_arrival = 0
        num_events = 0
        report_every = max(1, n // 200)
        arrival_priority = _PRIORITY[ARRIVAL]
        while heap or next_arrival < n:
            if next_arrival < n and (not heap or arrival_s[next_arrival] < heap[0][0]
                                     or (arrival_s[next_arrival] == heap[0][0] and heap[0][1] > arrival_priority)):
                now = float(arrival_s[next_arrival])
                req = self.reqs[next_arrival]
                next_arrival += 1
                num_events += 1
                self.dispatch(req, now)
                if progress is not None and next_arrival % report_every == 0:
                    progress(next_arrival / n)
                continue
            now, _, _, kind, payload = heapq.heappop(heap)
            if now > self.horizon:
                break
            num_events += 1
            if kind == STEP_END:
                rep, token = payload
                if token != rep.step_token or not rep.busy:
                    continue
                if id(rep) in self.handoff_due:
                    rep.on_step_end(now, start_next=False)  # finish the step in progress, then empty it
                    for m in self.leaving.pop(id(rep), ()):
                        self.cancel_migration(m)
                    self.hand_off(rep, now)
                    continue
                if self.leaving and id(rep) in self.leaving:
                    rep.on_step_end(now, start_next=False)
                    self.detach(rep, self.leaving.pop(id(rep)), now)
                    self.schedule(rep, rep.wake(now))
                    continue
                out = rep.on_step_end(now)
                self.schedule(rep, out.next_end_s)
            elif kind == SPAN:
                self.on_span(payload, now)
            elif kind == ACTIVATE:
                self.schedule(payload, payload.wake(now))
            elif kind == HANDOFF:
                rep = payload
                if rep.busy:
                    self.handoff_due.add(id(rep))
                    token = rep.step_token
                    end = rep.cut(now)
                    if token != rep.step_token:
                        self.push(end, STEP_END, (rep, rep.step_token))
                else:
                    self.hand_off(rep, now)
            elif kind == MIGRATE:
                self.on_migrate(now, next_arrival < n)
            elif kind == MIGRATE_OUT:
                self.migrate_out(payload, now)
            elif kind == MIGRATE_IN:
                self.migrate_in(payload, now)
        if progress is not None:
            progress(1.0)
        reqs = self.reqs
        finish = np.array([r.finish_s for r in reqs])
        first = np.array([r.first_token_s for r in reqs])
        dropped = ~np.isfinite(finish)
        rejected = sum(len(r.rejected) for r in self.all_replicas)
        reasons = {"rejected": rejected, "horizon": int(dropped.sum()) - rejected}
        return SimResult(self.policy.name, self.arrival_s.copy(), self.type_index.copy(), first - self.arrival_s,
                         finish - self.arrival_s, finish, dropped, sum(r.num_preemptions for r in reqs),
                         self.num_migrations, self.tbt, self.output_tokens.copy(), self.spans, num_events,
                         {k: v for k, v in reasons.items() if v})
