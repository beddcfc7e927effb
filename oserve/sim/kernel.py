"""The cluster simulator: a tiny discrete-event kernel over simulated replicas, and the policy interface.

Pure: virtual time only, no randomness. The kernel pops the earliest event — an arrival, a replica's
step end, a span boundary, a replica switching in, a hand-off — advances time to it and applies it.
Policies decide and route; the kernel applies what they return. It is honest by construction: a
policy is shown only what a gateway knows at that moment.

- An arrival is shown to the policy as an `ArrivalInfo` (input length, `max_tokens`, the client; never
  the output length) once, to `classify` it; then `route` picks a replica from their loads
  (`oserve.routing.ReplicaLoad`: no request, no length). A request whose input plus `max_tokens` (1 when
  none is given) exceeds the model's context window is refused there, as vLLM refuses it; one without
  `max_tokens` stops at the context window.
- At each span boundary the policy gets a `SpanView`: the time, the decision in force and the requests
  completed since the previous boundary (`CompletionInfo`, true lengths, as the engines report them).
  Nothing about the future: no counts, no arrivals, no trace length.
- A decision's deployment is applied at once: replicas present in both deployments (same shape on the
  same GPUs) keep serving untouched; retired replicas stop taking requests, their queued requests are
  re-routed, their running requests drain until the switch completes, and then what still runs moves
  to the new replicas: requests with at least `migrate_min_context_tokens` of context migrate with
  their KV cache, shorter ones are recomputed there; new replicas start serving `switch_s` after the
  boundary. Until then they are not ready: routers send them requests only when no ready replica
  accepts (`oserve.routing`), and those wait in their queue.
- Live migration, for a policy with a `migration_interval_s` (and `plan_migrations`): every interval
  the policy names running requests to move (`Migration`s). Each keeps decoding on its source for the
  move's `precopy_s` (the KV copied while it runs), leaves the source at the next step boundary, and
  after `downtime_s` (the last copy stage) is queued first on the destination with its KV, so it
  resumes without a recompute. Such a policy is a balancer inside the engines (Llumnix's llumlets):
  it sees each replica through a `BalancerView`: its KV accounting and the ids and contexts of the
  requests it decodes, never their output lengths.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from oserve.decision import Decision
from oserve.defaults import MIGRATE_MIN_CONTEXT_TOKENS, SPAN_S
from oserve.engine_model import SimReplica, SimRequest, TokenHistogram
from oserve.errors import ConfigError
from oserve.perfmodel import PerfModel
from oserve.routing import ReplicaLoad
from oserve.specs import (ClusterSpec, EngineConfig, GPUSpec, MemoryConfig, ModelSpec, Replica, ReplicaShape,
                          kv_capacity_tokens)
from oserve.traces import Trace

ARRIVAL, STEP_END, SPAN, ACTIVATE, HANDOFF, MIGRATE, MIGRATE_OUT, MIGRATE_IN = 0, 1, 2, 3, 4, 5, 6, 7
# Same-time order: a step ending frees room before a span boundary re-plans, which goes before arrivals;
# live migration's events come last (a balancer looks at the state after the arrivals of that instant).
_PRIORITY = {STEP_END: 0, HANDOFF: 1, ACTIVATE: 2, SPAN: 3, ARRIVAL: 4, MIGRATE_IN: 5, MIGRATE_OUT: 6, MIGRATE: 7}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the simulated cluster behaves."""

    span_s: float = SPAN_S
    """Re-planning period."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    migrate_min_context_tokens: int = MIGRATE_MIN_CONTEXT_TOKENS
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
class Migration:
    """A policy's order to live-migrate one running request, with the move's modelled times."""

    src_index: int
    """Index of the source in the replicas the policy was shown."""
    dst_index: int
    request_id: int
    """A request decoding on the source (`BalancerView.decoding_contexts`)."""
    kv_blocks: int
    """KV blocks the destination reserves for it while it is in flight."""
    precopy_s: float
    """Seconds the KV copy overlaps decoding on the source before the request stops there."""
    downtime_s: float
    """Seconds between leaving the source and being queued on the destination (last copy stage)."""

    def __post_init__(self) -> None:
        if self.precopy_s < 0 or self.downtime_s < 0 or self.kv_blocks < 0:
            raise ConfigError(f"Migration: negative time or blocks in {self}")


@dataclass(frozen=True, slots=True)
class ArrivalInfo:
    """What a gateway knows of a request when it arrives: never its output length."""

    request_index: int
    """Its index in the trace (its id in this run)."""
    arrival_s: float
    input_tokens: int
    max_tokens: int
    """The client's cap on the answer's length; 0 when none was given."""
    client_id: int
    """Who sent it (an application, an API customer); -1 when unknown."""


@dataclass(frozen=True, slots=True)
class CompletionInfo:
    """A finished request, as its engine reports it: now its output length is known."""

    request_index: int
    arrival_s: float
    finish_s: float
    input_tokens: int
    output_tokens: int
    max_tokens: int
    client_id: int
    routed_class: int
    """The class the policy gave it at arrival."""
    replica_gpus: tuple[int, ...] = ()
    """The GPUs of the replica that finished it (a replica's identity across decisions)."""
    first_token_s: float = math.nan
    """When its first token came (TTFT and time per output token follow, as engines report them)."""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's counters at a span boundary, as its engine's telemetry reports them (cumulative since
    it started, like Prometheus counters): never a request or a length."""

    gpu_ids: tuple[int, ...]
    shape: ReplicaShape
    busy_s: float
    """Seconds it spent running steps."""
    saturated_s: float
    """Seconds of steps that ended with requests still waiting (it could not take all it was sent)."""
    num_waiting: int
    num_running: int
    ready: bool


@dataclass(frozen=True, slots=True)
class SpanView:
    """What a policy may look at when a span starts: the past only."""

    span_index: int
    now_s: float
    span_s: float
    current: Decision | None
    """The decision in force (None before the first)."""
    completed: tuple[CompletionInfo, ...] = ()
    """Requests finished since the previous span boundary, in finish order."""
    replicas: tuple[ReplicaStats, ...] = ()
    """The telemetry of the replicas in force (`ReplicaStats`), in the decision's order."""


class Policy(Protocol):
    """A serving policy: what the gateway and the planner do, as the simulator drives them."""

    name: str

    def decide(self, view: SpanView) -> Decision | None:
        """At a span boundary: a new decision, or None to keep the current one."""

    def classify(self, arrival: ArrivalInfo) -> int:
        """The workload class of a request at its arrival (called once per request, in arrival order)."""

    def route(self, class_index: int, loads: Sequence[ReplicaLoad]) -> int | None:
        """Index of the replica (of the decision in force) that takes a request of this class, or None
        to hold it until the next decision."""

    # Optional, for live migration (the kernel checks with getattr):
    # migration_interval_s: float | None — seconds between two `plan_migrations` calls; None: never.
    # def plan_migrations(self, replicas: list[BalancerView], now_s: float) -> list[Migration]: ...


class _LoadView:
    """A replica's load as a router sees it (`oserve.routing.ReplicaLoad`), read live; not its requests."""

    __slots__ = ("_rep",)

    def __init__(self, rep: SimReplica) -> None:
        self._rep = rep

    @property
    def accepting(self) -> bool:
        return self._rep.accepting

    @property
    def ready(self) -> bool:
        return self._rep.ready

    @property
    def kv_load_frac(self) -> float:
        return self._rep.kv_load_frac()

    @property
    def num_requests(self) -> int:
        return self._rep.num_requests

    @property
    def num_running(self) -> int:
        return self._rep.num_running

    @property
    def kv_capacity_tokens(self) -> int:
        return self._rep.total_blocks * self._rep.block_tokens

    @property
    def incoming_kv_tokens(self) -> int:
        return self._rep.incoming_kv_blocks * self._rep.block_tokens


class BalancerView(_LoadView):
    """What a balancer inside the engines (Llumnix's llumlets) sees of a replica, read live: its load, KV
    accounting, batch, placement and the context of each request it decodes; never an output length."""

    __slots__ = ()

    @property
    def num_waiting(self) -> int:
        return len(self._rep.waiting)

    @property
    def max_num_seqs(self) -> int:
        """Requests its batch holds (the engine's limit times its pipeline stages)."""
        return self._rep.engine.max_num_seqs * self._rep.shape.pp

    @property
    def total_blocks(self) -> int:
        return self._rep.total_blocks

    @property
    def block_tokens(self) -> int:
        return self._rep.block_tokens

    @property
    def incoming_kv_blocks(self) -> int:
        return self._rep.incoming_kv_blocks

    @property
    def shape(self) -> ReplicaShape:
        return self._rep.shape

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return self._rep.gpu_ids

    def decoding_contexts(self) -> list[tuple[int, int]]:
        """(context tokens, request id) of each request decoding here and not already leaving."""
        leaving = self._rep.migrating_out
        return [(ctx, r.request_id) for ctx, r in self._rep.decoding_requests() if r.request_id not in leaving]


def latency_percentile(values: np.ndarray, q: float) -> float:
    """Percentile `q` of latencies where inf (or NaN) is a request that never finished, counting as infinitely
    late: linear interpolation when all finished, else the 'higher' order statistic (so inf when over 1 - q/100
    of them are unfinished). NaN for no values. Pure."""
    values = np.asarray(values, dtype=float)
    if not len(values):
        return math.nan
    return float(np.percentile(values, q, method="linear")) if np.isfinite(values).all() else \
        float(np.quantile(np.where(np.isfinite(values), values, np.inf), q / 100.0, method="higher"))


@dataclass
class SimResult:
    """Everything a run produced, per request (in arrival order) and over time."""

    policy: str
    arrival_s: np.ndarray
    routed_class: np.ndarray
    """The class the policy gave each request at arrival; -1 for a request refused at the gateway."""
    ttft_s: np.ndarray
    """Seconds to the first token; inf for a request that never got one."""
    e2e_s: np.ndarray
    """Seconds to the last token; inf for a request that never finished."""
    finish_s: np.ndarray
    refused: np.ndarray
    """Bool per request: refused at the gateway (its input plus max tokens exceed the context window),
    as vLLM refuses it; every policy refuses the same ones."""
    dropped: np.ndarray
    """Bool per admitted request: never finished (no replica's KV cache can hold it, or past the horizon)."""
    num_preemptions: int
    num_migrations: int
    tbt: TokenHistogram
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    """Tokens each request is to generate (its true length, capped by max tokens and the context window)."""
    generated_tokens: np.ndarray
    """Tokens each request did generate (all of `output_tokens` when it finished)."""
    spans: list[dict]
    """One dict per span: start_s, span_index, deployment (list of (replica_id, str(shape), gpu_ids)),
    forecast_rps, switched, switch_s, label, decide_s (the policy's wall seconds to decide: set by the
    caller's timer, NaN without one)."""
    num_events: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    """Why requests did not finish: 'refused_context' (refused at the gateway), 'rejected_kv' (the
    request fits no KV cache of the replica it went to), 'horizon' (unfinished
    `horizon_after_last_arrival_s` after the last arrival)."""
    policy_notes: dict = field(default_factory=dict)
    """What the caller recorded of the policy that ran (`oserve.evaluation.compare.run_policy`: OServe's
    `trial`, its trial on the history)."""

    @property
    def admitted(self) -> np.ndarray:
        return ~self.refused

    @property
    def finished(self) -> np.ndarray:
        return ~self.refused & ~self.dropped

    def span_counts(self, span_s: float, num_classes: int) -> np.ndarray:
        """(spans, classes) admitted arrivals per span (from the first arrival) and class given at arrival. Pure."""
        sel = self.admitted
        t = self.arrival_s[sel] - float(self.arrival_s.min())
        num_spans = int(t.max() // span_s) + 1 if len(t) else 0
        flat = np.bincount((t // span_s).astype(np.int64) * num_classes + self.routed_class[sel],
                           minlength=num_spans * num_classes)
        return flat.reshape(num_spans, num_classes)

    def percentile(self, what: str, q: float) -> float:
        """Percentile `q` of e2e, ttft or tbt (seconds). Over the admitted requests, an unfinished one
        counting as infinitely late: a policy that serves fewer requests is never faster by it."""
        if what == "tbt":
            return self.tbt.quantile(q / 100.0)
        return latency_percentile({"e2e": self.e2e_s, "ttft": self.ttft_s}[what][self.admitted], q)

    @property
    def duration_s(self) -> float:
        done = self.finish_s[self.finished]
        end = float(done.max()) if len(done) else float(self.arrival_s.max())
        return max(end - float(self.arrival_s.min()), 1e-9)

    @property
    def throughput_rps(self) -> float:
        """Finished requests per second, from the first arrival to the last finish."""
        return float(self.finished.sum()) / self.duration_s

    @property
    def token_throughput(self) -> float:
        return float(self.output_tokens[self.finished].sum()) / self.duration_s

    def summary(self) -> dict:
        decide = np.array([s.get("decide_s", math.nan) for s in self.spans], dtype=float)
        decide = decide[np.isfinite(decide)]
        return {
            "policy": self.policy,
            "requests": int(len(self.arrival_s)),
            "refused": int(self.refused.sum()),
            "finished": int(self.finished.sum()),
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
            "switches": sum(1 for s in self.spans[1:] if s["switched"]),
            "decide_s_median": float(np.median(decide)) if len(decide) else math.nan,
            "decide_s_max": float(decide.max()) if len(decide) else math.nan,
        }


def simulate(model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, trace: Trace, policy: Policy,
             config: SimConfig = SimConfig(), perf: PerfModel | None = None,
             progress: Callable[[float], None] | None = None,
             timer: Callable[[], float] | None = None) -> SimResult:
    """Run `policy` over a trace on the simulated cluster. Pure and deterministic (given `timer`'s use:
    it only measures how long each decision took, e.g. `time.perf_counter`).

    `progress`, when given, is called with the fraction of arrivals processed, now and then.
    """
    kernel = _Kernel(model, gpu, cluster, trace, policy, config,
                     perf or PerfModel(model, gpu, gpus_per_node=cluster.gpus_per_node), timer)
    return kernel.run(progress)


class _Kernel:
    """State of one simulation run; `simulate` is its only user."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, trace: Trace, policy: Policy,
                 config: SimConfig, perf: PerfModel, timer: Callable[[], float] | None) -> None:
        if len(trace) == 0:
            raise ConfigError("simulate: the trace has no requests")
        self.trace = trace
        self.arrival_s = trace.arrival_s
        self.model, self.gpu, self.cluster, self.policy, self.config, self.perf = model, gpu, cluster, policy, config, perf
        self.timer = timer
        self.t0 = float(self.arrival_s[0])
        self.last_arrival_s = float(self.arrival_s[-1])
        self.horizon = self.last_arrival_s + config.horizon_after_last_arrival_s
        # the context window, as vLLM enforces it
        self.refused, self.output_tokens = trace.served(model.max_context_tokens)
        inp = trace.input_tokens
        self.reqs = [SimRequest(i, -1, float(t), int(a), int(b))
                     for i, (t, a, b) in enumerate(zip(self.arrival_s.tolist(), inp.tolist(),
                                                       self.output_tokens.tolist()))]
        self.completed: list[CompletionInfo] = []  # since the last span boundary
        self.tbt = TokenHistogram()
        self.heap: list = []
        self.seq = 0
        self.replicas: list[SimReplica] = []
        self.loads: list[_LoadView] = []
        self.decision: Decision | None = None
        self.pending: list[SimRequest] = []
        self.spans: list[dict] = []
        self.num_migrations = 0
        self.handoff_due: set[int] = set()
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

    def arrive(self, req: SimRequest, now: float) -> None:
        """A request reaches the gateway: refused, or classified once and dispatched."""
        i = req.request_id
        if self.refused[i]:
            return
        trace = self.trace
        req.type_index = int(self.policy.classify(ArrivalInfo(i, now, req.input_tokens, int(trace.max_tokens[i]),
                                                              int(trace.client_ids[i]))))
        self.dispatch(req, now)

    def dispatch(self, req: SimRequest, now: float) -> None:
        k = self.policy.route(req.type_index, self.loads) if self.replicas else None
        if k is None or not 0 <= k < len(self.replicas) or not self.replicas[k].accepting:
            self.pending.append(req)  # no replica takes it: it waits for the next decision
            return
        rep = self.replicas[k]
        self.schedule(rep, rep.enqueue(req, now))

    def finish(self, finished: tuple[SimRequest, ...] | list[SimRequest], rep: SimReplica) -> None:
        """Record what a step of `rep` finished, for the policy's next view."""
        trace = self.trace
        gpus = tuple(rep.gpu_ids)
        for r in finished:
            i = r.request_id
            self.completed.append(CompletionInfo(i, r.arrival_s, r.finish_s, r.input_tokens, r.output_tokens,
                                                 int(trace.max_tokens[i]), int(trace.client_ids[i]), r.type_index,
                                                 gpus, r.first_token_s))

    def apply(self, new: Decision, now: float) -> bool:
        """Move to a new decision; True when any replica changed."""
        old_by_key = {(r.shape, tuple(sorted(r.gpu_ids))): r for r in self.replicas}
        new_reps = []
        for spec in new.deployment.replicas:
            rep = old_by_key.pop((spec.shape, tuple(sorted(spec.gpu_ids))), None)
            if rep is None:
                rep = self.make_replica(spec, now + new.switch_s)
                if new.switch_s > 0:
                    rep.ready = False
                    self.push(now + new.switch_s, ACTIVATE, rep)
            rep.replica_id = spec.replica_id
            new_reps.append(rep)
        leaving = list(old_by_key.values())
        switched = len(leaving) > 0 or len(new_reps) != len(self.replicas) or self.decision is None
        self.replicas = new_reps
        self.loads = [_LoadView(r) for r in new_reps]
        self.decision = new
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
        for m in self.policy.plan_migrations([BalancerView(r) for r in self.replicas], now):
            if not (0 <= m.src_index < len(self.replicas) and 0 <= m.dst_index < len(self.replicas)
                    and 0 <= m.request_id < len(self.reqs)):
                raise ConfigError(f"{self.policy.name}: migration of request {m.request_id} between replicas "
                                  f"{m.src_index} -> {m.dst_index} of {len(self.replicas)}")
            src, dst, req = self.replicas[m.src_index], self.replicas[m.dst_index], self.reqs[m.request_id]
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
        src.migrating_out.discard(m.request_id)
        dst.incoming_kv_blocks -= m.kv_blocks

    def migrate_out(self, entry, now: float) -> None:
        """The pre-copy is done: stop the request on its source at the next step boundary."""
        src, dst, m = entry
        if not src.is_decoding(self.reqs[m.request_id]) or id(src) in self.handoff_due:
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
            req = self.reqs[entry[2].request_id]
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
        req = self.reqs[m.request_id]
        if dst.accepting and any(r is dst for r in self.replicas):
            self.schedule(dst, dst.enqueue(req, now, front=True))
        else:
            self.dispatch(req, now)  # the destination retired meanwhile: any current replica, KV kept

    def on_span(self, i: int, now: float) -> None:
        stats = tuple(ReplicaStats(tuple(r.gpu_ids), r.shape, r.busy_s, r.saturated_s, len(r.waiting), r.num_running,
                                   r.ready) for r in self.replicas)
        view = SpanView(i, now, self.config.span_s, self.decision, tuple(self.completed), stats)
        self.completed = []
        start = self.timer() if self.timer is not None else math.nan
        new = self.policy.decide(view)
        decide_s = self.timer() - start if self.timer is not None else math.nan
        switched = self.apply(new, now) if new is not None else False
        d = self.decision
        self.spans.append({
            "start_s": now - self.t0, "span_index": i,
            "deployment": [(r.replica_id, str(r.shape), list(r.gpu_ids)) for r in self.replicas],
            "forecast_rps": list(d.forecast_rps) if d else [],
            "switched": switched, "switch_s": d.switch_s if (d and switched and i > 0) else 0.0,
            "label": d.label if d else "", "decide_s": decide_s})
        # spans run while requests arrive; the last boundary is at or before the last arrival
        if now + self.config.span_s <= self.last_arrival_s:
            self.push(now + self.config.span_s, SPAN, i + 1)

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
                self.arrive(req, now)
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
                    self.finish(rep.on_step_end(now, start_next=False).finished, rep)  # finish the step, then empty it
                    for m in self.leaving.pop(id(rep), ()):
                        self.cancel_migration(m)
                    self.hand_off(rep, now)
                    continue
                if self.leaving and id(rep) in self.leaving:
                    self.finish(rep.on_step_end(now, start_next=False).finished, rep)
                    self.detach(rep, self.leaving.pop(id(rep)), now)
                    self.schedule(rep, rep.wake(now))
                    continue
                out = rep.on_step_end(now)
                if out.finished:
                    self.finish(out.finished, rep)
                self.schedule(rep, out.next_end_s)
            elif kind == SPAN:
                self.on_span(payload, now)
            elif kind == ACTIVATE:
                payload.ready = True
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
        refused = self.refused
        dropped = ~np.isfinite(finish) & ~refused
        rejected = sum(len(r.rejected) for r in self.all_replicas)
        reasons = {"refused_context": int(refused.sum()), "rejected_kv": rejected,
                   "horizon": int(dropped.sum()) - rejected}
        e2e = np.where(np.isfinite(finish), finish - self.arrival_s, np.inf)
        ttft = np.where(np.isfinite(first), first - self.arrival_s, np.inf)
        return SimResult(self.policy.name, self.arrival_s.copy(), np.array([r.type_index for r in reqs]), ttft, e2e,
                         finish, refused.copy(), dropped, sum(r.num_preemptions for r in reqs), self.num_migrations,
                         self.tbt, self.trace.input_tokens.copy(), self.output_tokens.copy(),
                         np.array([r.generated for r in reqs]), self.spans, num_events,
                         {k: v for k, v in reasons.items() if v})
