"""Gateway/router worker: validates client requests, classifies, routes, and owns them until answered.

- A queue group (`GatewayConfig.queue_group`) on the submit subject shares the load among gateways.
- Validation at the edge (`decode_submit`): any bad input gets a structured `ErrorReply` naming the
  request when its id can be read, never a crash or a silence. The reply subject must be an inbox
  (`reply_error`, `GatewayConfig.reply_roots`): a request with another, or none, is dropped unanswered
  (`num_bad_reply`), as the engine would publish its answer there with a worker's permissions. On a
  user's own subject (`Subjects.user_submit`, which permissions let only that user publish on) the reply
  must be that user's inbox (`Subjects.user_inbox_root`), so an authenticated client's answers go to
  itself alone; cancels there may name only its own inboxes.
- Several gateways: an engine names the owner (`owner_of`: gateway and client) of each request in its
  `Completed` events, and a gateway clears, re-dispatches or migrates only what it holds for that client,
  so two clients that chose one request id on two gateways never touch each other's request.
- Classification at arrival by the online estimator (`oserve.online_types.OnlineTypes`, as fitted
  before serving: input length, the client's max tokens or output hint, its `client` tag), which keeps
  learning from the engines' completions (true lengths, known only then) with the same features. Routing by the one rule every plan is
  scored with (`oserve.routing.least_loaded`): the least loaded of the live, accepting replicas the
  assignment gives the request's class (all of them until an assignment arrives). A replica's load is
  its last heartbeat's KV load plus what this gateway dispatched to it since.
- A request whose input plus max tokens exceeds the model's context window is refused (`invalid`),
  as vLLM refuses it; without max tokens it may generate up to the window.
- The dispatch goes to the replica's subject with the client's inbox as reply subject: the engine
  answers the client directly.
- Nothing lost: every forwarded request stays in `pending` until a `Completed` event names it; a
  replica that misses heartbeats for `heartbeat_timeout_wall_s` is declared dead and its unanswered
  requests are re-dispatched (engines de-duplicate by inbox prefix and request id); one that finds no
  live replica waits until a replica becomes eligible (a new id or one come back), and is answered
  `no_replica` if the gateway drains first. A new request that finds no live replica is held the same
  way for up to `no_replica_wait_wall_s`, so a moment without replicas (all of them restarting, or
  silent through a stall) delays requests instead of refusing them. An engine's error replies are
  `released` in its `Completed` events, so the gateway forgets them too. A request id still in flight
  for another client (another inbox prefix) is refused `invalid`, never served with the first
  client's answer; one the same client reuses for another ask (`fingerprint`) is refused `invalid` while
  the first is in flight. The same request published again on the same inbox (the client heard
  nothing) is taken as the same: its dispatch goes again, the engine answers once.
- Ownership: a request that asks (`SubmitRequest.ack`) is told `Accepted` once it is dispatched or held;
  the client publishes again what no gateway confirmed, so one read by a gateway that crashed before
  owning it is not lost. With JetStream (`js`), the gateway journals what it owns (`Owned`, before the
  `Accepted`, on the same connection; `Settled` when it no longer does) and, restarted under the same
  `gateway_id`, takes back what it owned and no engine completed (`_recover`).
- Deadlines: each request's is its `timeout_s` (capped by `max_request_wall_s`) less a margin
  (`deadline_s`), carried to the engine in the `Dispatch`. A held request is answered `deadline_exceeded`
  at it; a dispatched one is its engine's to answer, and is forgotten silently a grace period later.
- Admission: a new request is refused `overloaded` when the replica it would go to is full (its KV load,
  as reported and sent since) and holds more waiting requests than it serves, at its measured service rate (completions per clock second
  while it was full, from `Heartbeat.saturated_s` and `busy_s`), before the request's deadline (or
  `max_queue_wall_s`); or when more than `max_waiting_per_replica` wait there. `max_pending` bounds what
  one gateway holds.
- Its own disconnection: while cut off from NATS the failure detector is paused (every replica would
  look silent), and every replica gets a fresh timeout once it is back.
- The failure detector does not count its own stalls: when the gateway's loop wakes late (a long
  garbage collection, a thread holding the interpreter, a paused process), the lateness is taken off
  every replica's silence, up to the longest time since the last check in which the gateway read no
  heartbeat of any replica. A loop that is only busy keeps reading the live replicas' heartbeats,
  so little is taken off and a dead replica is still found.
- Cancellation: every gateway hears `CancelRequest`s (no queue group); the one that holds the request,
  when the cancel names an inbox with the prefix the request was accepted under (`dedupe_key`: only its
  client knows it), forgets it and sends an `AbortRequest` to its replica's dispatch subject (after the
  dispatch, so the engine reads them in order). Any other cancel is ignored (`num_cancels_ignored`).
- Moving what outgrew its class (`move_outgrown`): a dispatch carries the answer's length at which the
  request outgrows its class (`Dispatch.move_after_tokens`); its engine then asks (`MoveAsk`, on
  `Subjects.gateway_moves`), and the gateway says go (`MoveAnswer`, on the replica's dispatch subject) only
  when a replica the assignment gives the class it grew into has room in its KV cache for its context, and
  reserves it; the handed-back request is continued there (`_redispatch(to=)`). Otherwise it stays where it
  is and its engine asks again later: moved onto a full replica it would queue behind that replica's own.
- Held requests are published in `Arrived` events with `replica_id` "" (none yet).
- Accepted requests are published as batched `Arrived` events (captured by the arrivals stream).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from oserve.correction import move_after_tokens, outgrown
from oserve.errors import ConfigError
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import extract, inject, messaging_attributes, messaging_span_name, trace_headers
from oserve.streams.schemas import (CLIENT_TAG, COPY_HEADER, EVENT_BATCH_ITEMS, UNACCEPTED_COPY, AbortRequest, Accepted,
                                    Arrival, Arrived, AssignmentSet, CancelRequest, Completed, Dispatch, ErrorCode,
                                    ErrorReply, Heartbeat, MoveAnswer, MoveAsk, Owned, Ping, Pong, SchemaError, Settled,
                                    SubmitRequest, decode, decode_submit, encode, fingerprint, request_id_of)
from oserve.streams.server import reconnects
from oserve.streams.subjects import Subjects, dedupe_key, owner_of, reply_error
from oserve.workers.base import Worker
from oserve.workers.clock import Clock
from oserve.online_types import OnlineTypes
from oserve.routing import beyond_plan, least_loaded
from oserve.traces import context_rule

log = logging.getLogger(__name__)


EARLY_CANCEL_WALL_S = 5.0
"""How long a cancel for a request not held here is kept, in case its submit is still on its way: each
subscription's callbacks run in a task of their own, so under a backlog of submits a cancel can be read
first (wall seconds)."""
RECOVERY_LOOKBACK_WALL_S = 10.0
"""A restarted gateway reads engines' completions from this long before its journal's last record (its
`Settled` flushes came at most `arrival_flush_wall_s` apart while it ran; the rest is clock skew)."""
RECOVERY_READ_WALL_S = 30.0
"""A restarted gateway gives up reading a stream for its recovery after this long without a message."""
RECOVERY_SKEW_WALL_S = 1.0
"""An engine's answer may be stored in the completions stream up to this long before the journal record of
its dispatch (the dispatch goes out first, on another connection): a restarted gateway still counts it."""
MAX_EARLY_CANCELS = 10_000
"""Early cancels kept at most (the oldest go first): every gateway hears every cancel."""
MAX_ANSWERED_KEPT = 16_384
"""Requests this gateway stopped holding, kept (the oldest go first) so that a client's unaccepted copy
(`COPY_HEADER`) that comes after the answer is recognised and not served again."""
MIN_RATE_SATURATED_S = 3.0
"""Clock seconds of saturated time (steps that ended with requests waiting) ..."""
MIN_RATE_BUSY_S = 10.0
"""... or, without them, of busy time, and ..."""
MIN_RATE_COMPLETIONS = 20
"""... completions a replica's service rate needs before admission goes by it."""


def deadline_s(timeout_s: float | None, max_s: float) -> float:
    """Seconds from its arrival until a request's deadline: its client's timeout (capped at `max_s`), less a
    margin (a tenth of it, at most a second) so the `deadline_exceeded` answer reaches the client before
    the client gives up on its own. Pure."""
    t = min(timeout_s or max_s, max_s)
    return t - min(1.0, 0.1 * t)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """One gateway/router worker."""

    gateway_id: str = "gateway-0"
    subjects: Subjects = field(default_factory=Subjects)
    queue_group: str = "gateway"
    """Queue group on the submit subject; gateways in one group share the requests."""
    max_context_tokens: int = 32768
    """The model's context window: input plus max tokens allowed for one request; a request without max
    tokens may generate up to it (vLLM's default)."""
    heartbeat_timeout_wall_s: float = 2.0
    """A replica silent for this long (wall seconds) is dead; its requests are re-dispatched."""
    no_replica_wait_wall_s: float = 15.0
    """A new request that finds no live replica waits this long (wall seconds, and at most until its
    deadline) for one, then is answered `no_replica`; 0 answers at once. An engine host's restart takes
    about 10 s (the switch planner's `restart_after_wall_s`, the process start, the modelled load)."""
    liveness_check_wall_s: float = 0.25
    arrival_flush_wall_s: float = 0.05
    """Accepted requests are batched into one `Arrived` event for at most this long."""
    surplus_window_s: float = 60.0
    """Clock seconds over which each class's arrivals are counted against the rate its assignment plans for
    it (the planning span; the count restarts with each assignment too): a class that came beyond its
    plan (`oserve.routing.beyond_plan`) is routed to the least loaded replica of any class."""
    plan_share: float = 1.0
    """This gateway's share of the cluster's arrivals: the plan's rates are for the whole cluster, so with
    several gateways behind a balancer each counts its own arrivals against this share of the plan (1/n for
    n gateways an even balancer feeds). Left at 1 with several gateways, a class is seen beyond its plan late."""
    max_attempts: int = 3
    """Dispatches of one request before it is answered with an error."""
    max_pending: int = 50_000
    """Requests this gateway owns at once (forwarded, not yet completed); beyond it new ones are refused
    `overloaded` (a backstop: admission by each replica's queue comes first, see `max_queue_wall_s`)."""
    max_request_wall_s: float = 600.0
    """Deadline of a request that gives no `timeout_s` (wall seconds from its arrival here); a request's
    own `timeout_s` is capped by it too."""
    max_queue_wall_s: float | None = None
    """A new request is refused `overloaded` when the replica it would go to is full (`min_waiting_to_refuse`)
    and holds more waiting requests than it serves in this many wall seconds at its service rate
    (`_Replica.service_rate`), so an overload is refused within seconds instead of queueing for minutes;
    None: the request's own deadline."""
    max_waiting_per_replica: int = 4096
    """Requests waiting (not running) at one replica, as its heartbeat reports plus what was sent since,
    beyond which new ones are refused `overloaded` whatever its rate (before any rate is measured)."""
    rate_window_busy_s: float = 60.0
    """Clock seconds of a replica's busy time its service rate is measured over (`Heartbeat.busy_s`)."""
    min_waiting_to_refuse: int = 16
    """A replica is refused for its rate only while its KV cache is full (its last heartbeat's load plus
    what was sent since: new requests would wait) and this many wait; with room in its batch a request
    starts at once, whatever a rate measured at low concurrency says."""
    reply_roots: tuple[str, ...] | None = None
    """First tokens a request's reply subject may start with (see `oserve.streams.subjects.reply_error`);
    None: the clients' prefix (`Subjects.reply_prefix()`) and nats-py's default `_INBOX`."""
    move_outgrown: bool = False
    """A request that outgrows the class it was routed as (its answer passes the class's bound) into a class its
    replica does not serve is moved: its engine asks (`MoveAsk`), and hands it back to be continued on a replica
    that serves that class only when the gateway finds one with room (`Dispatch.move_after_tokens`,
    `oserve.correction`), as the planner's twin scores it when
    `PlannerConfig.correction` is set (the simulator's default; the live system sets this from
    `SystemConfig.move_outgrown`, off by default: see the README, "Correcting after the fact"); False: it
    finishes where it was sent."""
    move_room_frac: float = 1.0
    """A request that outgrew its class moves only to a replica whose KV load (its last heartbeat's plus what was
    sent and reserved since) stays at or under this fraction with the request's context added."""
    max_client_tags: int = 256
    """Distinct `client` tags the estimator learns by (each one is a feature of its regressor); requests
    with a tag beyond them are classed as untagged, so a client minting tags cannot grow the model."""

    def __post_init__(self) -> None:
        self.subjects.ownership(self.gateway_id)  # one subject token: its journal's subject
        for name in ("max_context_tokens", "max_attempts", "max_pending", "max_client_tags"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GatewayConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("heartbeat_timeout_wall_s", "liveness_check_wall_s", "arrival_flush_wall_s",
                     "max_request_wall_s", "rate_window_busy_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"GatewayConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_queue_wall_s is not None and not self.max_queue_wall_s > 0:
            raise ConfigError(f"GatewayConfig.max_queue_wall_s must be > 0 or None, got {self.max_queue_wall_s}")
        if self.max_waiting_per_replica < 1:
            raise ConfigError(f"GatewayConfig.max_waiting_per_replica must be >= 1, got {self.max_waiting_per_replica}")
        if self.reply_roots is not None and not self.reply_roots:
            raise ConfigError("GatewayConfig.reply_roots must name at least one inbox root (or be None)")
        if not self.surplus_window_s > 0:
            raise ConfigError(f"GatewayConfig.surplus_window_s must be > 0, got {self.surplus_window_s}")
        if not 0 < self.plan_share <= 1:
            raise ConfigError(f"GatewayConfig.plan_share must be in (0, 1], got {self.plan_share}")
        if not 0 < self.move_room_frac <= 1:
            raise ConfigError(f"GatewayConfig.move_room_frac must be in (0, 1], got {self.move_room_frac}")
        if not self.no_replica_wait_wall_s >= 0:
            raise ConfigError(f"GatewayConfig.no_replica_wait_wall_s must be >= 0, got {self.no_replica_wait_wall_s}")


@dataclass(slots=True)
class _Replica:
    """A replica as the gateway knows it: liveness, and its load (`oserve.routing.ReplicaLoad`)."""

    last_seen_wall_s: float
    accepting: bool = True
    alive: bool = True
    reported_kv_frac: float = 0.0
    reported_requests: int = 0
    reported_waiting: int = 0
    num_running: int = 0
    kv_capacity_tokens: int = 0
    sent_tokens: int = 0
    """Tokens (input plus expected output) dispatched here since its last heartbeat."""
    sent_requests: int = 0
    incoming_kv_tokens: int = 0
    completed: int = 0
    """Requests it finished (its `Completed` events' items) since the gateway first heard of it."""
    busy_samples: collections.deque = field(default_factory=collections.deque)
    """(busy, saturated clock seconds, `completed`) at its heartbeats, over `rate_window_busy_s` of busy time."""
    rate: float | None = None
    """`service_rate()` as of its last heartbeat."""

    @property
    def ready(self) -> bool:
        """Always: the gateway knows a replica once its engine is up and sends heartbeats."""
        return True

    @property
    def kv_load_frac(self) -> float:
        return self.reported_kv_frac + (self.sent_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0)

    @property
    def num_requests(self) -> int:
        return self.reported_requests + self.sent_requests

    @property
    def num_waiting(self) -> int:
        return self.reported_waiting + self.sent_requests

    def note_busy(self, busy_s: float, saturated_s: float, window_busy_s: float) -> None:
        """Record a heartbeat's cumulative busy and saturated time (clock seconds) against the completions,
        and update `rate` (see `service_rate`)."""
        samples = self.busy_samples
        if samples and busy_s < samples[-1][0]:
            samples.clear()  # a restarted engine counts from 0 again
        samples.append((busy_s, saturated_s, self.completed))
        while len(samples) > 2 and busy_s - samples[1][0] >= window_busy_s:
            samples.popleft()
        self.rate = self.service_rate()

    def service_rate(self) -> float | None:
        """Requests it finishes per clock second when full, over its recent busy time: the completions of the
        heartbeat intervals it spent mostly saturated (at least half their busy time with requests waiting)
        per saturated second; before `MIN_RATE_SATURATED_S` of those, the completions per busy second (a low
        estimate where it ran below full batches); None before `MIN_RATE_BUSY_S` and
        `MIN_RATE_COMPLETIONS`. Idle spans and outages do not dilute it."""
        samples = self.busy_samples
        if len(samples) < 2:
            return None
        sat_s = sat_done = 0.0
        prev = samples[0]
        for cur in itertools.islice(samples, 1, None):
            db, ds = cur[0] - prev[0], cur[1] - prev[1]
            if db > 0 and ds >= 0.5 * db:
                sat_s += ds
                sat_done += cur[2] - prev[2]
            prev = cur
        if sat_s >= MIN_RATE_SATURATED_S and sat_done >= MIN_RATE_COMPLETIONS:
            return sat_done / sat_s
        (b0, _, d0), (b1, _, d1) = samples[0], samples[-1]
        if b1 - b0 >= MIN_RATE_BUSY_S and d1 - d0 >= MIN_RATE_COMPLETIONS:
            return (d1 - d0) / (b1 - b0)
        return None


@dataclass(slots=True)
class _Pending:
    dispatch: Dispatch
    reply: str
    headers: dict[str, str] | None
    replica_id: str | None  # None: waiting for a live replica
    est_output_tokens: int = 0
    """The answer's length as estimated at arrival (the gateway never knows the true one before it ends)."""
    tag: str | None = None
    """The client's tag (the request's `CLIENT_TAG` tag), as the estimator classed it by."""
    sent_max_tokens: int | None = None
    """The max tokens the client sent (None: none); with `tag`, what the estimator learns from at completion."""
    wait_until_wall_s: float | None = None
    """Set while a request never dispatched waits for a replica: answered `no_replica` after this time."""
    deadline_wall_s: float = float("inf")
    """Loop time past which nobody waits for the answer (its `timeout_s`, or `max_request_wall_s`)."""
    fingerprint: str = ""
    """What the request asks (`oserve.streams.schemas.fingerprint`): a reused id with other content is refused."""
    free_retry: bool = False
    """Held after a hand-back or a migration no replica could take at once: its next dispatch is no failed attempt."""
    move_to: str | None = None
    """The replica whose room was reserved for it when its engine was told to move it (`MoveAnswer.target`)."""
    move_class: int | None = None
    """The class it grew into, as judged when its engine was told to move it: it is continued in that class."""
    move_reserved: int = 0
    """The tokens reserved for it on `move_to` (taken off again when it is dispatched there)."""


class Gateway(Worker):
    """The gateway/router (see the module docstring)."""

    name = "gateway"

    def __init__(self, nc: NATS, config: GatewayConfig, clock: Clock, *, estimator: OnlineTypes | None = None,
                 tracer: Tracer | None = None, kv: KeyValue | None = None, metrics: Metrics | None = None,
                 js: JetStreamContext | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.kv = nc, config, clock, tracer, kv
        self.js = js
        """With JetStream (its streams set up), the gateway journals what it owns and takes it back after a
        restart (`_recover`); None: no journal."""
        self.metrics = metrics
        """Accepted / rejected / failed / re-dispatched requests and the ones in flight (None: no metrics)."""
        self.estimator = estimator
        """Classes requests at arrival and learns from completions; None: every request is class 0."""
        self._replicas: dict[str, _Replica] = {}
        self._eligible: list[str] = []
        self._weights: list[dict[str, float]] | None = None  # type index -> replica_id -> weight
        self._window_counts: dict[int, int] = {}  # type index -> arrivals since `_window_start_s`
        self._window_start_s = 0.0  # clock time the arrival counts against the plan restarted
        self.num_beyond_plan = 0  # requests accepted while their class was beyond its plan (routed to any replica)
        self.pending: dict[str, _Pending] = {}  # request_id -> what was forwarded and where
        self._arrivals: list[Arrival] = []
        self._replicas_changed = asyncio.Event()
        self._maybe_unrouted = False  # some pending request may wait for a live replica (replica_id None)
        self._last_heartbeat_read_wall_s = float("-inf")
        self._heartbeat_read_gap_s = 0.0  # longest gap between heartbeat reads since the last liveness check
        self.strategy_id = ""
        self._strategy_links: list[trace.Link] = []  # span links to the switch of the assignment in force
        self._client_tags: set[str] = set()  # client tags the estimator learns by (at most max_client_tags)
        # counters
        self.num_accepted = 0
        self.num_rejected = 0
        self.num_redispatched = 0
        self.num_failed = 0
        self.num_cancelled = 0  # requests forgotten because their client cancelled them
        self.num_cancels_ignored = 0  # cancels for a request not held here, or naming another client's inbox
        # (reply inbox, request id) of cancels that came before their submit -> wall time they came
        self._early_cancels: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.num_declared_dead = 0  # replicas declared dead for missing heartbeats (a replica may come back)
        self.num_errors = 0
        self.num_bad_reply = 0  # requests dropped for a reply subject that is not an inbox (nothing is sent there)
        self.num_expired = 0  # requests answered `deadline_exceeded` here
        self.num_requeued = 0  # requests a fenced engine handed back (`Completed.requeue`)
        self.num_migrated = 0  # requests a retiring replica handed over mid-answer (`Completed.migrated`)
        self.num_moved_outgrown = 0  # of those, requests continued in the class they grew into (`move_outgrown`)
        self.num_move_asks = 0  # `MoveAsk`s about requests it holds
        self.num_move_stays = 0  # of those, answered "stay": no replica of the class grown into had room
        self.num_disconnects = 0  # liveness checks that found this gateway itself cut off from NATS
        self._reply_roots = config.reply_roots or (config.subjects.reply_prefix(), "_INBOX")
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline_wall_s, request_id) of pending ones
        self._disconnected = False
        self._settled: dict[str, None] = {}  # request ids no longer owned, for the journal's next `Settled`
        # request id -> (inbox, fingerprint, connection) of the last MAX_ANSWERED_KEPT requests it stopped holding
        self._let_go: collections.OrderedDict[str, tuple[str, str, int]] = collections.OrderedDict()
        self.num_late_copies = 0
        """A client's unaccepted copies (`COPY_HEADER`) that came after the request was answered: dropped."""
        self._recovery_buffer: list[Msg] | None = None  # completions read while `_recover` runs
        self.num_recovered = 0
        """Requests taken back from the journal when this gateway started (`_recover`)."""

    # --- lifecycle ---------------------------------------------------------------------------------

    async def _subscribe(self) -> list:
        s = self.config.subjects
        if self.metrics is not None:
            self.metrics.track_inflight(self.config.gateway_id, lambda: len(self.pending))
        if self.kv is not None:  # a (re)started router follows the assignment in force
            try:
                self._set_assignment((await self.kv.get(Subjects.ASSIGNMENT_KEY)).value or b"")
            except KeyNotFoundError:
                pass
        subs = [await self.nc.subscribe(s.heartbeats(), cb=self._on_heartbeat)]
        if self.js is not None:  # before any new request: what it owned before it stopped
            # completions from now on are kept while the streams are read, so none falls between the two
            self._recovery_buffer = []
            subs.append(await self.nc.subscribe(s.completions(), cb=self._on_completed))
            try:
                await self._recover()
            except Exception:  # a gateway that cannot read its journal still serves: say so, loudly
                log.exception("%s: could not take back what it owned before it stopped", self.config.gateway_id)
            buffered, self._recovery_buffer = self._recovery_buffer, None
            for msg in buffered:
                await self._on_completed(msg)
            await self._flush_settled()
        else:
            subs.append(await self.nc.subscribe(s.completions(), cb=self._on_completed))
        return subs + [
            await self.nc.subscribe(s.plan_event("assignment"), cb=self._on_assignment),
            await self.nc.subscribe(s.gateway_moves(self.config.gateway_id), cb=self._on_move_ask),
            await self.nc.subscribe(s.cancel(), cb=self._on_cancel),  # all gateways: the owner acts
            await self.nc.subscribe(s.users_cancel(), cb=self._on_cancel),
            # last, both: a drain unsubscribes them first
            await self.nc.subscribe(s.users_submit(), queue=self.config.queue_group, cb=self._on_submit),
            await self.nc.subscribe(s.submit(), queue=self.config.queue_group, cb=self._on_submit),
        ]

    def _loops(self):
        return [self._liveness_loop, self._arrivals_loop]

    async def _on_stop(self) -> None:
        if self.metrics is not None:
            self.metrics.untrack_inflight(self.config.gateway_id)

    async def _drain(self) -> None:
        # stop taking requests (the two submit subscriptions, last); what was forwarded is the engines' to answer
        for _ in range(2):
            if self._subs:
                await self._subs.pop().unsubscribe()
        await self._answer_unrouted()
        await self._flush_arrivals()
        await self._flush_settled()

    @property
    def live_replicas(self) -> list[str]:
        return list(self._eligible)

    async def wait_for_replicas(self, num_replicas: int, timeout_s: float) -> None:
        """Wait until at least `num_replicas` live, accepting replicas are known (raises TimeoutError)."""
        async def wait() -> None:
            while len(self._eligible) < num_replicas:
                self._replicas_changed.clear()
                await self._replicas_changed.wait()
        await asyncio.wait_for(wait(), timeout_s)

    # --- membership and assignment -------------------------------------------------------------------

    def _refresh_eligible(self) -> None:
        self._eligible = sorted(rid for rid, r in self._replicas.items() if r.alive and r.accepting)
        self._replicas_changed.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except SchemaError:
            self.num_errors += 1
            return
        assert isinstance(hb, Heartbeat)
        now = asyncio.get_running_loop().time()
        self._heartbeat_read_gap_s = max(self._heartbeat_read_gap_s, now - self._last_heartbeat_read_wall_s)
        self._last_heartbeat_read_wall_s = now
        r = self._replicas.get(hb.replica_id)
        if r is None:
            r = self._replicas[hb.replica_id] = _Replica(now, hb.accepting)
            self._report_load(r, hb)
            self._refresh_eligible()
        else:
            r.last_seen_wall_s = now
            self._report_load(r, hb)
            if r.accepting == hb.accepting and r.alive:
                return
            r.accepting, r.alive = hb.accepting, True
            self._refresh_eligible()
        if hb.replica_id in self._eligible:  # new, back, or accepting again: it can take what waits
            await self._retry_unrouted()

    async def _on_assignment(self, msg: Msg) -> None:
        self._set_assignment(msg.data, msg.headers)

    def _set_assignment(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            a = decode(data, AssignmentSet)
        except SchemaError:
            self.num_errors += 1
            return
        assert isinstance(a, AssignmentSet)
        self._weights = [dict(w) for w in a.weights]
        self._window_counts, self._window_start_s = {}, self.clock.now_s()
        self.strategy_id = a.strategy_id
        # the switch that put this assignment in force: every request routed by it links to its trace
        parent = extract(headers)
        ctx = trace.get_current_span(parent).get_span_context() if parent is not None else None
        self._strategy_links = [trace.Link(ctx, {"oserve.strategy_id": a.strategy_id})] \
            if ctx is not None and ctx.is_valid else []

    def _report_load(self, r: _Replica, hb: Heartbeat) -> None:
        """A heartbeat's load replaces what the gateway had estimated since the last one."""
        r.reported_kv_frac, r.reported_requests = hb.kv_load_frac, hb.num_waiting + hb.num_running
        r.reported_waiting = hb.num_waiting
        r.note_busy(hb.busy_s, hb.saturated_s, self.config.rate_window_busy_s)
        r.num_running, r.kv_capacity_tokens = hb.num_running, hb.kv_capacity_tokens
        r.sent_tokens = r.sent_requests = 0

    def _count_arrival(self, type_index: int) -> None:
        """Count a new request of the class against its plan, in windows of `surplus_window_s` clock seconds."""
        now = self.clock.now_s()
        if now - self._window_start_s >= self.config.surplus_window_s:
            self._window_counts, self._window_start_s = {}, now
        self._window_counts[type_index] = self._window_counts.get(type_index, 0) + 1

    def _beyond_plan(self, type_index: int) -> bool:
        """Whether the class came beyond its plan in this window (`oserve.routing.beyond_plan`)."""
        if self._weights is None or type_index >= len(self._weights):
            return False
        return beyond_plan(self._window_counts.get(type_index, 0),
                           self.config.plan_share * sum(self._weights[type_index].values()),
                           self.clock.now_s() - self._window_start_s)

    def _route(self, type_index: int, avoid: str | None = None) -> str | None:
        """The least loaded eligible replica for the class (`oserve.routing.least_loaded`); any replica's when
        the class came beyond its plan in this window (`_beyond_plan`), as the simulator routes. A replica
        to `avoid` (one that just handed the request back) is taken only when no other accepts."""
        if not self._eligible:
            return None
        eligible = None
        if self._weights is not None and type_index < len(self._weights) and not self._beyond_plan(type_index):
            w = self._weights[type_index]
            eligible = [w.get(rid, 0.0) for rid in self._eligible]
        if avoid is not None and avoid in self._eligible and len(self._eligible) > 1:
            others = [rid for rid in self._eligible if rid != avoid]
            k = least_loaded([self._replicas[rid] for rid in others],
                             None if eligible is None else [e for rid, e in zip(self._eligible, eligible)
                                                             if rid != avoid])
            if k is not None:
                return others[k]
        k = least_loaded([self._replicas[rid] for rid in self._eligible], eligible)
        return self._eligible[k] if k is not None else None

    def _sent(self, replica_id: str, p: _Pending) -> None:
        """Count a dispatch into the replica's load until its next heartbeat reports it: its prompt's KV and
        half its estimated answer's (what it holds on average while it decodes)."""
        r = self._replicas.get(replica_id)
        if r is not None:
            r.sent_tokens += p.dispatch.input_tokens + p.est_output_tokens // 2
            r.sent_requests += 1

    def _known_tag(self, tag: str | None) -> str | None:
        """The tag the estimator may learn by: one already known, or a new one while there is room."""
        if tag is None or tag in self._client_tags:
            return tag
        if len(self._client_tags) >= self.config.max_client_tags:
            return None
        self._client_tags.add(tag)
        return tag

    def _move_after(self, type_index: int, replica_id: str | None, input_tokens: int, max_tokens: int) -> int | None:
        """`Dispatch.move_after_tokens` for a request of class `type_index` sent to `replica_id`: the answer's
        length at which it outgrows its class into one that replica does not serve and another live one does
        (`oserve.correction.move_after_tokens`, on the estimator's centroids now); None when never, or when
        moving is off or there is no plan."""
        weights = self._weights
        if not self.config.move_outgrown or self.estimator is None or weights is None or replica_id is None:
            return None

        def moves_for(j: int) -> bool:
            w = weights[j] if j < len(weights) else {}
            return w.get(replica_id, 0.0) <= 0 and any(v > 0 and rid != replica_id and rid in self._eligible
                                                       for rid, v in w.items())

        return move_after_tokens(self.estimator.centroids_log, input_tokens, type_index, moves_for, max_tokens)

    async def _on_move_ask(self, msg: Msg) -> None:
        """An engine asks whether to move a request that outgrew its class (`MoveAsk`): go, with room reserved on
        the replica that will continue it, when one the assignment gives the class it grew into has room for its
        context (`_move_target`); else stay. Answered on the asking replica's dispatch subject."""
        try:
            a = decode(msg.data, MoveAsk)
        except SchemaError:
            self.num_errors += 1
            return
        assert isinstance(a, MoveAsk)
        p = self.pending.get(a.request_id)
        if p is None or p.reply != a.inbox or p.replica_id != a.replica_id or a.replica_id not in self._replicas:
            return  # not ours, answered, or moved already: the engine's request finishes where it is
        self.num_move_asks += 1
        target = None
        if p.move_to is not None and p.move_to in self._eligible:
            target = p.move_to  # asked again before the answer arrived: the same answer, no second reservation
        elif self.config.move_outgrown and self.estimator is not None and self._weights is not None:
            d = p.dispatch
            grown = self._class_so_far(d.type_index, d.input_tokens, a.generated_tokens)
            w = self._weights[grown] if grown < len(self._weights) else {}
            if grown != d.type_index and w.get(a.replica_id, 0.0) <= 0:  # (its replica may serve it by now)
                target = self._move_target(grown, a.replica_id, d.input_tokens + a.generated_tokens)
                if target is not None:
                    p.move_to, p.move_class = target, grown
                    p.move_reserved = d.input_tokens + a.generated_tokens + 1
                    self._replicas[target].sent_tokens += p.move_reserved  # its room, held until its next heartbeat
        if target is None:
            self.num_move_stays += 1
            p.move_to, p.move_class, p.move_reserved = None, None, 0
        await self.nc.publish(self.config.subjects.replica(a.replica_id), encode(MoveAnswer(
            request_id=a.request_id, inbox=a.inbox, go=target is not None, target=target or "")))

    def _move_target(self, grown: int, source: str, context_tokens: int) -> str | None:
        """The least loaded replica, other than `source`, that the assignment gives class `grown` and that has room
        for `context_tokens` more in its KV cache (`move_room_frac`); None when none has. Like the simulator's
        mover (`oserve.correction.OutgrownMover.plan`), it never moves a request onto a full replica."""
        weights = self._weights
        w = weights[grown] if weights is not None and grown < len(weights) else {}
        best, best_key = None, None
        for rid in self._eligible:
            r = self._replicas[rid]
            if rid == source or w.get(rid, 0.0) <= 0 or not r.accepting or r.kv_capacity_tokens <= 0:
                continue
            if r.kv_load_frac + (context_tokens + 1) / r.kv_capacity_tokens > self.config.move_room_frac:
                continue
            key = (r.kv_load_frac, r.num_requests, rid)
            if best_key is None or key < best_key:
                best, best_key = rid, key
        return best

    def _class_so_far(self, type_index: int, input_tokens: int, generated_tokens: int) -> int:
        """The class of a request handed back mid-answer: the one its answer so far puts it in when it has
        outgrown `type_index` (`oserve.correction.outgrown`), else `type_index`."""
        if self.estimator is None or generated_tokens < 1:
            return type_index
        grown = self.estimator.classify_one(input_tokens, generated_tokens)
        return grown if outgrown(grown, type_index, self.estimator.centroids_log[:, 1]) else type_index

    def _classify(self, input_tokens: int, max_tokens: int | None, hint_tokens: int | None,
                  tag: str | None) -> tuple[int, int]:
        """(class, estimated output tokens) of an arrival, from what the gateway knows of it now."""
        if self.estimator is None:
            return 0, hint_tokens or 0
        cls = self.estimator.predict_one(input_tokens, output_hint=hint_tokens, tag=tag, max_tokens=max_tokens)
        est = hint_tokens if hint_tokens is not None else \
            round(self.estimator.estimate_output_one(input_tokens, tag=tag, max_tokens=max_tokens))
        return cls, est

    # --- the request path --------------------------------------------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        try:
            await self._handle_submit(msg)
        except Exception as exc:  # the outermost handler: answer, log, keep serving
            self.num_errors += 1
            log.exception("%s: submit handler failed", self.config.gateway_id)
            if self.metrics is not None:
                self.metrics.rejected.labels(ErrorCode.INTERNAL).inc()
            if msg.reply and reply_error(msg.reply, self._reply_roots) is None and \
                    self._not_users_inbox(msg.subject, msg.reply) is None:
                await self.nc.publish(msg.reply, encode(ErrorReply(request_id=request_id_of(msg.data),
                                                                   code=ErrorCode.INTERNAL,
                                                                   message=type(exc).__name__)))

    def _not_users_inbox(self, subject: str, inbox: str) -> str | None:
        """Why `inbox` may not take answers to what came on `subject`: on a user's own subject
        (`Subjects.user_submit`) it must be that user's inbox, so what a client sends is answered to itself
        alone. None when it may (any inbox on the shared subject: `reply_error` checks it)."""
        user = self.config.subjects.user_of(subject)
        if user is None or inbox.startswith(self.config.subjects.user_inbox_root(user) + "."):
            return None
        return f"on {subject} the reply must be {user}'s own inbox ({self.config.subjects.user_inbox_root(user)}.…)"

    async def _reject(self, msg: Msg, request_id: str, code: str, message: str) -> None:
        self.num_rejected += 1
        if self.metrics is not None:
            self.metrics.rejected.labels(code).inc()
        if msg.reply and reply_error(msg.reply, self._reply_roots) is None:
            await self.nc.publish(msg.reply, encode(ErrorReply(request_id=request_id, code=code, message=message)))

    async def _accepted(self, req: SubmitRequest, reply: str) -> None:
        """Confirm ownership to a client that asked (`SubmitRequest.ack`)."""
        if req.ack:
            await self.nc.publish(reply, encode(Accepted(request_id=req.request_id, gateway_id=self.config.gateway_id)))

    def _overloaded(self, replica_id: str, deadline_s: float, now: float) -> str | None:
        """Why a new request may not join the replica's queue, or None (see `GatewayConfig.max_queue_wall_s`)."""
        r = self._replicas[replica_id]
        waiting = r.num_waiting
        if waiting >= self.config.max_waiting_per_replica:
            return f"{waiting} requests wait at replica {replica_id}; retry later"
        if r.kv_load_frac < 1.0 or waiting < self.config.min_waiting_to_refuse:
            return None  # room in its batch for what was sent: nothing waits there yet
        per_clock_s = r.rate
        if per_clock_s is None:
            return None
        rate = per_clock_s * self.clock.speedup  # per wall second, while it is full
        limit_s = self.config.max_queue_wall_s if self.config.max_queue_wall_s is not None else deadline_s
        if waiting > rate * limit_s:
            return (f"{waiting} requests wait at replica {replica_id}, which serves {rate:.1f} per second: the "
                    f"request would wait longer than {limit_s:g} s; retry later")
        return None

    async def _handle_submit(self, msg: Msg) -> None:
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span(messaging_span_name("process", msg.subject), context=extract(msg.headers),
                                          kind=SpanKind.CONSUMER, links=self._strategy_links,
                                          attributes={"oserve.step": "gateway.route",
                                                      "oserve.strategy_id": self.strategy_id,
                                                      **messaging_attributes(msg.subject, "process", "process",
                                                                             body_size_bytes=len(msg.data))})
        try:
            bad_reply = reply_error(msg.reply, self._reply_roots) or self._not_users_inbox(msg.subject, msg.reply)
            if bad_reply is not None:
                # never publish to it: it could be a control subject, a stream, another client's inbox
                self.num_bad_reply += 1
                self.num_rejected += 1
                if self.metrics is not None:
                    self.metrics.rejected.labels(ErrorCode.INVALID).inc()
                if span is not None:
                    span.add_event("invalid_reply_subject", {"reason": bad_reply})
                    span.set_status(Status(StatusCode.ERROR, "invalid reply subject"))
                log.debug("%s: dropped a request: %s", self.config.gateway_id, bad_reply)
                return
            try:
                req = decode_submit(msg.data)
            except SchemaError as exc:
                if span is not None:
                    span.add_event("invalid_request", {"code": exc.code})
                    span.set_status(Status(StatusCode.ERROR, exc.code))
                await self._reject(msg, request_id_of(msg.data), exc.code, exc.message)
                return
            if isinstance(req, Ping):
                await self.nc.publish(msg.reply, encode(Pong(gateway_id=self.config.gateway_id,
                                                             num_replicas=len(self._eligible))))
                return
            assert isinstance(req, SubmitRequest)
            cancelled_at = self._early_cancels.pop((msg.reply, req.request_id), None) if self._early_cancels else None
            if cancelled_at is not None and asyncio.get_running_loop().time() - cancelled_at <= EARLY_CANCEL_WALL_S:
                # cancelled by its client before it got here (the exact inbox: a resend of the id is served)
                self.num_cancelled += 1
                await self._reject(msg, req.request_id, ErrorCode.CANCELLED, "cancelled by its client")
                return
            cfg = self.config
            input_tokens = req.prompt_tokens()
            refused, cap = context_rule(input_tokens, req.max_tokens or 0, cfg.max_context_tokens)
            if refused:
                await self._reject(msg, req.request_id, ErrorCode.INVALID,
                                   f"this model's maximum context length is {cfg.max_context_tokens} tokens; the "
                                   f"request has {input_tokens} input tokens and asks for "
                                   f"{req.max_tokens or 'at least 1'} more")
                return
            max_tokens = int(cap)
            tag = self._known_tag(req.tags.get(CLIENT_TAG))
            type_index, est = self._classify(input_tokens, req.max_tokens, req.output_hint_tokens, tag)
            if span is not None:
                span.set_attributes({"oserve.request_id": req.request_id, "oserve.type_index": type_index,
                                     "oserve.input_tokens": input_tokens, "messaging.message.id": req.request_id,
                                     "gen_ai.operation.name": "text_completion",
                                     "gen_ai.request.max_tokens": max_tokens})
            ask = fingerprint(req)
            existing = self.pending.get(req.request_id)
            # the client's copy of a request no gateway confirmed in time, on a connection that did not drop
            # (`COPY_HEADER`): what was sent to its inbox reached it, or is on its way
            unaccepted_copy = bool(msg.headers) and msg.headers.get(COPY_HEADER) == UNACCEPTED_COPY
            if existing is None and unaccepted_copy and \
                    self._let_go.get(req.request_id) == (msg.reply, ask, reconnects(self.nc)):
                # it crossed its answer (a stalled loop read the answer after the client's timer fired):
                # served again, it would be answered twice
                self.num_late_copies += 1
                if span is not None:
                    span.add_event("late_copy_dropped")
                return
            if existing is not None:
                if dedupe_key(msg.reply, "") != dedupe_key(existing.reply, ""):
                    # another client (another inbox) chose the same id: it must never get the first one's answer
                    await self._reject(msg, req.request_id, ErrorCode.INVALID,
                                       "request id already in flight for another client; choose a unique id")
                    return
                if ask != existing.fingerprint:
                    # the same client reusing an id for another ask: neither answer may stand for the other
                    await self._reject(msg, req.request_id, ErrorCode.INVALID,
                                       "request id already in flight with other content; choose a unique id")
                    return
                if msg.reply == existing.reply:
                    # the client published it again (it heard nothing: a lost confirmation, a reconnect):
                    # the answer comes once, on that inbox, wherever the request is. An unaccepted copy goes
                    # marked `recovered`: an engine that answered it already (its `Completed` not read here
                    # yet) sent that answer to a client whose connection did not drop, and does not send it
                    # a second time; one that never got the dispatch (lost with its connection) serves it
                    if existing.replica_id is not None:
                        headers = inject(span, existing.headers) if span is not None else existing.headers
                        d = msgspec.structs.replace(existing.dispatch, recovered=True) if unaccepted_copy \
                            else existing.dispatch
                        await self.nc.publish(cfg.subjects.replica(existing.replica_id), encode(d),
                                              reply=msg.reply, headers=headers)
                    await self._accepted(req, msg.reply)
                    return
                if existing.wait_until_wall_s is not None:
                    # a retry of a request held since it came in: answered on the retry's inbox, in time
                    existing.reply = msg.reply
                    await self._own(existing)
                    await self._accepted(req, msg.reply)
                    return
                if existing.replica_id is None:
                    await self._reject(msg, req.request_id, ErrorCode.NO_REPLICA,
                                       "no live replica to serve the request yet; retry later")
                    return
                # a client retry of a request still in flight: same replica, same answer
                headers = inject(span, existing.headers) if span is not None else existing.headers
                await self.nc.publish(cfg.subjects.replica(existing.replica_id), encode(existing.dispatch),
                                      reply=msg.reply, headers=headers)
                await self._accepted(req, msg.reply)
                return
            if len(self.pending) >= cfg.max_pending:
                await self._reject(msg, req.request_id, ErrorCode.OVERLOADED,
                                   f"{len(self.pending)} requests in flight at this gateway; retry later")
                return
            now = asyncio.get_running_loop().time()
            timeout_s = deadline_s(req.timeout_s, cfg.max_request_wall_s)
            self._count_arrival(type_index)
            surplus = self._beyond_plan(type_index)
            replica_id = self._route(type_index)
            if replica_id is None and cfg.no_replica_wait_wall_s == 0:
                await self._reject(msg, req.request_id, ErrorCode.NO_REPLICA, "no live replica to serve the request")
                return
            if replica_id is not None:
                why = self._overloaded(replica_id, timeout_s, now)
                if why is not None:
                    await self._reject(msg, req.request_id, ErrorCode.OVERLOADED, why)
                    return
            d = Dispatch(request_id=req.request_id, input_tokens=input_tokens, max_tokens=max_tokens,
                         type_index=type_index, gateway_id=cfg.gateway_id, sim_output_tokens=req.sim_output_tokens,
                         stream=req.stream, detokenize=req.prompt is not None, temperature=req.temperature,
                         top_p=req.top_p, seed=req.seed, stop=req.stop, prompt=req.prompt, fingerprint=ask,
                         deadline_unix_s=time.time() + timeout_s, dispatch_no=0,
                         move_after_tokens=self._move_after(type_index, replica_id, input_tokens, max_tokens),
                         # a copy this gateway never held may be one a gateway answered before a restart: the
                         # engine that answered it does not answer again (another replica would serve it anew)
                         recovered=unaccepted_copy)
            headers = inject(span) if span is not None else trace_headers(msg.headers)
            if replica_id is None:  # held until a replica becomes eligible or the wait runs out
                if span is not None:
                    span.add_event("waiting_for_replica")
                self.pending[req.request_id] = _Pending(d, msg.reply, headers, None, est, tag, req.max_tokens,
                                                        wait_until_wall_s=now + min(cfg.no_replica_wait_wall_s,
                                                                                    timeout_s),
                                                        deadline_wall_s=now + timeout_s, fingerprint=ask)
                self._maybe_unrouted = True
            else:
                if span is not None:
                    span.set_attribute("oserve.replica_id", replica_id)
                # owned only once forwarded: a failed publish is answered INTERNAL by the outer handler
                # and must never be re-dispatched later
                await self.nc.publish(cfg.subjects.replica(replica_id), encode(d), reply=msg.reply,
                                      headers=dict(headers) if headers else None)
                self.pending[req.request_id] = pending = _Pending(d, msg.reply, headers, replica_id, est, tag,
                                                                  req.max_tokens, deadline_wall_s=now + timeout_s,
                                                                  fingerprint=ask)
                self._sent(replica_id, pending)
            heapq.heappush(self._deadlines, (now + timeout_s, req.request_id))
            await self._own(self.pending[req.request_id])  # journaled before the client hears it is accepted
            await self._accepted(req, msg.reply)
            self.num_accepted += 1
            self.num_beyond_plan += surplus
            if self.metrics is not None:
                self.metrics.accepted.inc()
            self._arrivals.append(Arrival(request_id=req.request_id, at_s=self.clock.now_s(),
                                          input_tokens=input_tokens, est_output_tokens=est,
                                          type_index=type_index, replica_id=replica_id or ""))
        finally:
            if span is not None:
                span.end()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            await self._handle_cancel(msg)
        except Exception:  # the outermost handler: log, keep serving
            self.num_errors += 1
            log.exception("%s: cancel handler failed", self.config.gateway_id)

    async def _handle_cancel(self, msg: Msg) -> None:
        try:
            c = decode(msg.data, CancelRequest)
        except SchemaError:
            self.num_errors += 1
            return
        assert isinstance(c, CancelRequest)
        if self._not_users_inbox(msg.subject, c.inbox) is not None:  # a user cancels only its own requests
            self.num_cancels_ignored += 1
            return
        p = self.pending.get(c.request_id)
        if p is None and "." in c.inbox:  # perhaps before its submit: kept a while (EARLY_CANCEL_WALL_S)
            now = asyncio.get_running_loop().time()
            early = self._early_cancels
            early[(c.inbox, c.request_id)] = now
            while early and (len(early) > MAX_EARLY_CANCELS
                             or now - next(iter(early.values())) > EARLY_CANCEL_WALL_S):
                early.popitem(last=False)
        if (p is None or not p.reply or "." not in c.inbox
                or dedupe_key(c.inbox, "") != dedupe_key(p.reply, "")):
            # answered already, another gateway's, or another client's request: nothing of ours to cancel
            self.num_cancels_ignored += 1
            return
        del self.pending[c.request_id]
        self._settle(c.request_id, p.reply, p.fingerprint)
        self.num_cancelled += 1
        if p.replica_id is not None:
            await self.nc.publish(self.config.subjects.replica(p.replica_id), encode(AbortRequest(
                request_id=c.request_id, inbox=p.reply, gateway_id=self.config.gateway_id, reason=c.reason)))

    async def _on_completed(self, msg: Msg) -> None:
        if self._recovery_buffer is not None:  # read again once the journal is taken back (`_recover`)
            self._recovery_buffer.append(msg)
            return
        try:
            c = decode(msg.data, Completed)
        except SchemaError:
            self.num_errors += 1
            return
        assert isinstance(c, Completed)
        pending = self.pending
        r = self._replicas.get(c.replica_id)
        if r is not None:
            r.completed += len(c.items)
        for item in c.items:
            p = self._held(item.request_id, item.owner)
            if p is not None:
                del pending[item.request_id]
                self._settle(item.request_id, p.reply, p.fingerprint)
            if self.estimator is not None:  # learned from what it was classed by (unknown: another gateway's)
                self.estimator.learn_one(item.input_tokens, item.output_tokens, tag=p.tag if p else None,
                                         max_tokens=p.sent_max_tokens if p else None)
        # answered with an error, or from the cache: not to be re-dispatched
        for request_id, owner in _with_owners(c.released, c.released_owners):
            if (p := self._held(request_id, owner)) is not None:
                del pending[request_id]
                self._settle(request_id, p.reply, p.fingerprint)
        for request_id, owner in _with_owners(c.requeue, c.requeue_owners):  # dropped unanswered by a fenced engine: dispatched again
            p = self._held(request_id, owner)
            if p is not None and p.replica_id == c.replica_id:
                self.num_requeued += 1
                await self._redispatch(request_id, p, handed_back=True)
        for m in c.migrated:  # handed over mid-answer by a retiring replica: continued on a new one
            p = self._held(m.request_id, m.owner)
            if p is not None and p.replica_id == c.replica_id:
                self.num_migrated += 1
                d = p.dispatch
                # the class it was told to move for (the estimator's centroids may have moved since)
                grown = p.move_class if p.move_class is not None else \
                    self._class_so_far(d.type_index, d.input_tokens, m.resume.num_tokens)
                if grown != d.type_index:
                    self.num_moved_outgrown += 1
                p.dispatch = msgspec.structs.replace(d, resume=m.resume, type_index=grown)
                # one that outgrew its class left a replica that does not serve the class it grew into: not
                # back there (as when its class came beyond its plan) while another replica takes it
                await self._redispatch(m.request_id, p, migrated=True,
                                       avoid=c.replica_id if grown != d.type_index else None,
                                       to=p.move_to if grown != d.type_index else None)

    def _held(self, request_id: str, owner: str) -> _Pending | None:
        """The request this gateway holds under `request_id`, if a `Completed` entry naming `owner` is about it:
        the entry names this gateway and that request's client (`owner_of`), or no owner at all (an older
        engine). Another gateway's request, or another client's under the same id, is not ours to touch."""
        p = self.pending.get(request_id)
        if p is None or (owner and owner != owner_of(self.config.gateway_id, p.reply)):
            return None
        return p

    # --- nothing lost --------------------------------------------------------------------------------

    async def _redispatch(self, rid: str, p: _Pending, *, migrated: bool = False,
                          handed_back: bool = False, avoid: str | None = None, to: str | None = None) -> None:
        """Dispatch a held request again: its replica died (a failed attempt), or it was `handed_back` by a
        replica that fenced itself (it stalled: a slow host, not a request that kills engines), or `migrated`
        in a switch; neither of the last two is a failed attempt, and the request's deadline still bounds how
        often it can come back. A replica to `avoid` (`_route`) besides the one that handed it back; one to send it
        `to` (where room was reserved for it) while that one accepts."""
        first = p.wait_until_wall_s is not None  # held since it came in: this is its first dispatch
        free = first or migrated or handed_back or p.free_retry
        attempt = p.dispatch.attempt + (0 if free else 1)
        if attempt >= self.config.max_attempts:
            del self.pending[rid]
            self._settle(rid, p.reply, p.fingerprint)
            self.num_failed += 1
            if self.metrics is not None:
                self.metrics.failed.labels(ErrorCode.NO_REPLICA).inc()
            if p.reply:
                await self.nc.publish(p.reply, encode(ErrorReply(
                    request_id=rid, code=ErrorCode.NO_REPLICA,
                    message=f"no replica answered after {attempt} dispatches")))
            return
        # a hand-back comes from a replica that stalled: another one takes it when any accepts
        reserved = p.move_reserved if to is not None and to == p.move_to else 0
        p.move_to, p.move_class, p.move_reserved = None, None, 0
        if to is not None and to in self._eligible and self._replicas[to].accepting:
            target = to
            r = self._replicas[to]
            r.sent_tokens = max(0, r.sent_tokens - reserved)  # the reservation becomes this dispatch's load (`_sent`)
        else:
            target = self._route(p.dispatch.type_index, avoid=p.replica_id if handed_back else avoid)
        if target is None:
            p.replica_id = None  # retried when a replica becomes eligible, and on liveness ticks
            p.free_retry = free and not first
            self._maybe_unrouted = True
            await self._own(p)  # held now, not where it was
            return
        d = p.dispatch
        p.dispatch = msgspec.structs.replace(d, attempt=attempt,
                                             dispatch_no=(d.dispatch_no or 0) + (0 if first else 1),
                                             move_after_tokens=self._move_after(d.type_index, target, d.input_tokens,
                                                                                d.max_tokens))
        p.replica_id, p.wait_until_wall_s, p.free_retry = target, None, False
        if not first:
            self.num_redispatched += 1
            if self.metrics is not None:
                self.metrics.redispatched.inc()
        await self.nc.publish(self.config.subjects.replica(target), encode(p.dispatch), reply=p.reply,
                              headers=dict(p.headers) if p.headers else None)
        self._sent(target, p)
        await self._own(p)  # where it is now

    async def _retry_unrouted(self) -> None:
        for rid, p in list(self.pending.items()):
            if p.replica_id is None and self.pending.get(rid) is p:
                await self._redispatch(rid, p)

    async def _answer_unrouted(self, expired_at: float | None = None) -> None:
        """Answer `no_replica` to the requests waiting for a live replica: all of them (the gateway is going
        away), or with `expired_at`, the new ones whose `no_replica_wait_wall_s` ran out by then."""
        for rid, p in list(self.pending.items()):
            if p.replica_id is not None or self.pending.get(rid) is not p:  # publishing may yield meanwhile
                continue
            if expired_at is None:
                message = "no live replica took the request before the gateway shut down"
            elif p.wait_until_wall_s is not None and expired_at >= p.wait_until_wall_s:
                message = (f"no live replica to serve the request within {self.config.no_replica_wait_wall_s:g} s; "
                           "retry later")
            else:
                continue
            del self.pending[rid]
            self._settle(rid, p.reply, p.fingerprint)
            self.num_failed += 1
            if self.metrics is not None:
                self.metrics.failed.labels(ErrorCode.NO_REPLICA).inc()
            if p.reply:
                await self.nc.publish(p.reply, encode(ErrorReply(request_id=rid, code=ErrorCode.NO_REPLICA,
                                                                 message=message)))

    async def _expire(self, now: float) -> None:
        """Forget what nobody waits for any more. A request held here (no replica took it) is answered
        `deadline_exceeded` at its deadline. A dispatched one is its engine's to answer at the deadline (the
        engine has its `Dispatch.deadline_unix_s`): a grace period later the gateway forgets it without a
        word (its answer, or its `Completed`, may just have been lost with a connection: a second answer
        would be one too many), with an `AbortRequest` that frees it at an engine still holding it."""
        grace = self.config.heartbeat_timeout_wall_s + 1.0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            t, rid = heapq.heappop(heap)
            p = self.pending.get(rid)
            if p is None or t < p.deadline_wall_s:
                continue  # answered, or the id was reused later: a stale entry
            if p.replica_id is not None and t < p.deadline_wall_s + grace:
                heapq.heappush(heap, (p.deadline_wall_s + grace, rid))
                continue
            del self.pending[rid]
            self._settle(rid, p.reply, p.fingerprint)
            self.num_expired += 1
            if p.replica_id is not None:
                await self.nc.publish(self.config.subjects.replica(p.replica_id), encode(AbortRequest(
                    request_id=rid, inbox=p.reply, gateway_id=self.config.gateway_id, reason="deadline_exceeded",
                    answered=True)))
                continue
            self.num_failed += 1
            if self.metrics is not None:
                self.metrics.failed.labels(ErrorCode.DEADLINE_EXCEEDED).inc()
            await self.nc.publish(p.reply, encode(ErrorReply(
                request_id=rid, code=ErrorCode.DEADLINE_EXCEEDED,
                message="no replica answered before the request's deadline")))

    async def _liveness_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.liveness_check_wall_s
        while True:
            before = loop.time()
            await asyncio.sleep(interval)
            now = loop.time()
            if not self.nc.is_connected:
                # cut off itself: no replica's silence means anything now, and nothing can be answered
                if not self._disconnected:
                    self._disconnected = True
                    self.num_disconnects += 1
                    log.warning("%s: disconnected from NATS; failure detection paused", self.config.gateway_id)
                continue
            if self._disconnected:  # back: every replica gets a fresh timeout
                # (what was lost with the connection, a dispatch or an answer, comes again as the client's
                # retry: the gateway sends the dispatch again, the engine serves it once)
                self._disconnected = False
                for r in self._replicas.values():
                    r.last_seen_wall_s = now
                self._last_heartbeat_read_wall_s = now
                continue
            if self._deadlines and self._deadlines[0][0] <= now:
                await self._expire(now)
            # lateness during which no heartbeat (of any replica) was read: the gateway could not read
            # then, so it is not the replicas' silence; a loop that is only busy keeps reading
            read_gap = max(self._heartbeat_read_gap_s, now - self._last_heartbeat_read_wall_s)
            self._heartbeat_read_gap_s = 0.0
            stall = min(now - before - interval, read_gap)
            if stall > 0:
                for r in self._replicas.values():
                    r.last_seen_wall_s = min(now, r.last_seen_wall_s + stall)
            dead = [rid for rid, r in self._replicas.items()
                    if r.alive and now - r.last_seen_wall_s > self.config.heartbeat_timeout_wall_s]
            for rid in dead:
                self._replicas[rid].alive = False
                self.num_declared_dead += 1
                log.warning("%s: replica %s missed heartbeats; re-dispatching its requests",
                            self.config.gateway_id, rid)
            if dead:
                self._refresh_eligible()
            elif not self._maybe_unrouted:
                continue  # nothing died and nothing waits: no scan of `pending`
            if self._maybe_unrouted and not self._eligible:
                await self._answer_unrouted(expired_at=now)
            gone = set(dead)
            for req_id, p in list(self.pending.items()):
                if self.pending.get(req_id) is not p:
                    continue  # answered or dropped while an earlier publish yielded
                if p.replica_id in gone or (p.replica_id is None and self._eligible):
                    await self._redispatch(req_id, p)
            self._maybe_unrouted = any(p.replica_id is None for p in self.pending.values())

    async def _flush_arrivals(self) -> None:
        items, self._arrivals = self._arrivals, []
        for i in range(0, len(items), EVENT_BATCH_ITEMS):
            await self.nc.publish(self.config.subjects.arrivals(), encode(Arrived(
                gateway_id=self.config.gateway_id, items=items[i:i + EVENT_BATCH_ITEMS], **self.clock.stamp())))

    async def _arrivals_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.arrival_flush_wall_s)
            await self._flush_arrivals()
            await self._flush_settled()

    # --- the journal: ownership that survives a crash ----------------------------------------------

    async def _own(self, p: _Pending) -> None:
        """Journal that this gateway owns `p`, held or where it was dispatched (`Owned`). An earlier request
        under the same id whose end is not journaled yet is journaled first: a `Settled` after this record
        would end this one."""
        if self.js is None:
            return
        if p.dispatch.request_id in self._settled:
            await self._flush_settled()
        await self.nc.publish(self.config.subjects.ownership(self.config.gateway_id), encode(Owned(
            gateway_id=self.config.gateway_id, dispatch=p.dispatch, reply=p.reply, replica_id=p.replica_id or "",
            headers=dict(p.headers) if p.headers else {})))

    def _settle(self, rid: str, reply: str = "", fingerprint: str = "") -> None:
        """`rid` is no longer this gateway's: journaled with the next `Settled`, and (its client's inbox and
        its fingerprint given) remembered a while (`MAX_ANSWERED_KEPT`) for the client's late copies, with the
        connection this gateway is on (an error it answered on an earlier one may have been lost)."""
        if self.js is not None:
            self._settled[rid] = None
        if reply:
            self._let_go.pop(rid, None)
            self._let_go[rid] = (reply, fingerprint, reconnects(self.nc))
            if len(self._let_go) > MAX_ANSWERED_KEPT:
                self._let_go.popitem(last=False)

    async def _flush_settled(self) -> None:
        """Journal the requests this gateway stopped owning since the last flush (`Settled`)."""
        if self.js is None or not self._settled:
            return
        ids, self._settled = list(self._settled), {}
        for i in range(0, len(ids), EVENT_BATCH_ITEMS):
            await self.nc.publish(self.config.subjects.ownership(self.config.gateway_id), encode(Settled(
                gateway_id=self.config.gateway_id, request_ids=ids[i:i + EVENT_BATCH_ITEMS])))

    async def _recover(self) -> None:
        """Take back what this gateway's journal says it owned before it stopped (a crash, a kill): every
        `Owned` request no `Settled` ended and no engine's `Completed` answered (read from the completions
        stream since shortly before the journal's last record), whose deadline has not passed. A held one waits
        for a replica again. A dispatched one is sent to its replica again, marked `recovered`: an engine that
        serves it goes on (its de-duplication), one that answered it already releases it without answering
        again, and one that never had it (a replica started again under the same id) serves it; a replica not
        heard within `heartbeat_timeout_wall_s` is declared dead and the request re-dispatched. A completion
        that migrated or handed back a request (after the journal placed it there) has it dispatched again.
        What turns out answered is journaled as settled, so a second restart does not take it back."""
        assert self.js is not None
        s, gid = self.config.subjects, self.config.gateway_id
        owned: dict[str, tuple[Owned, datetime.datetime]] = {}
        last: datetime.datetime | None = None
        journal = s.ownership(gid)
        try:
            await self.js.get_last_msg(s.stream_ownership(), journal)
        except NotFoundError:
            return  # never owned anything, or all of it aged out
        async for msg in _replay(self.js, journal, s.stream_ownership(), None):
            try:
                rec = decode(msg.data, Owned | Settled)
            except SchemaError:
                continue
            if isinstance(rec, Owned):
                owned[rec.dispatch.request_id] = (rec, msg.metadata.timestamp)
            else:
                for rid in rec.request_ids:
                    owned.pop(rid, None)
            last = msg.metadata.timestamp
        if not owned or last is None:
            return
        redo: set[str] = set()
        skew = datetime.timedelta(seconds=RECOVERY_SKEW_WALL_S)
        since = last - datetime.timedelta(seconds=RECOVERY_LOOKBACK_WALL_S)

        def mine(rid: str, owner: str, at: datetime.datetime, *, strictly_after: bool = False) -> bool:
            """Whether a completion entry at `at` is about the request the journal placed last: ours (owner),
            and not older than that placement (an answer may be stored just before its record, which follows
            the dispatch; a hand-back must come after it)."""
            if rid not in owned:
                return False
            rec, placed = owned[rid]
            return (not owner or owner == owner_of(gid, rec.reply)) and \
                (at > placed if strictly_after else at >= placed - skew)

        async for msg in _replay(self.js, s.completions(), s.stream_completions(), since):
            try:
                c = decode(msg.data, Completed)
            except SchemaError:
                continue
            assert isinstance(c, Completed)
            at = msg.metadata.timestamp
            for item in c.items:
                if mine(item.request_id, item.owner, at):
                    rec, _ = owned.pop(item.request_id)
                    self._settle(item.request_id, rec.reply, rec.dispatch.fingerprint)
            for rid, owner in _with_owners(c.released, c.released_owners):
                if mine(rid, owner, at):
                    rec, _ = owned.pop(rid)
                    self._settle(rid, rec.reply, rec.dispatch.fingerprint)
            for rid, owner in _with_owners(c.requeue, c.requeue_owners):
                if mine(rid, owner, at, strictly_after=True) and owned[rid][0].replica_id == c.replica_id:
                    redo.add(rid)
            for m in c.migrated:
                if mine(m.request_id, m.owner, at, strictly_after=True) and \
                        owned[m.request_id][0].replica_id == c.replica_id:
                    rec, placed = owned[m.request_id]
                    owned[m.request_id] = (msgspec.structs.replace(
                        rec, dispatch=msgspec.structs.replace(rec.dispatch, resume=m.resume)), placed)
                    redo.add(m.request_id)
        loop_now, unix_now = asyncio.get_running_loop().time(), time.time()
        resend: list[tuple[str, _Pending]] = []
        for rid, (rec, _) in owned.items():
            d = rec.dispatch
            left = (d.deadline_unix_s - unix_now) if d.deadline_unix_s is not None else self.config.max_request_wall_s
            if left <= 0:
                self._settle(rid)  # nobody waits for it any more
                continue
            held = not rec.replica_id or rid in redo
            p = _Pending(d, rec.reply, dict(rec.headers) or None, None if held else rec.replica_id,
                         deadline_wall_s=loop_now + left, fingerprint=d.fingerprint,
                         wait_until_wall_s=loop_now + min(self.config.no_replica_wait_wall_s, left)
                         if held and not rec.replica_id else None)
            self.pending[rid] = p
            heapq.heappush(self._deadlines, (p.deadline_wall_s, rid))
            if held:
                self._maybe_unrouted = True
                continue
            resend.append((rid, p))
            if rec.replica_id not in self._replicas:  # judged by its heartbeats from now on: silent, it is dead
                self._replicas[rec.replica_id] = _Replica(loop_now, accepting=False)
        self.num_recovered = len(self.pending)
        if self.pending:
            log.warning("%s: took back %d requests it owned before it stopped", gid, len(self.pending))
        for rid, p in resend:
            if self.pending.get(rid) is p and p.replica_id is not None:
                await self.nc.publish(self.config.subjects.replica(p.replica_id),
                                      encode(msgspec.structs.replace(p.dispatch, recovered=True)), reply=p.reply,
                                      headers=dict(p.headers) if p.headers else None)


def _with_owners(ids: list[str], owners: list[str]) -> list[tuple[str, str]]:
    """`Completed`'s id list paired with its owner list (`released_owners`, `requeue_owners`); an older engine
    sends no owners, and its entries match by id alone (owner ""). Pure."""
    return list(zip(ids, owners if len(owners) == len(ids) else [""] * len(ids)))


async def _replay(js: JetStreamContext, subject: str, stream: str, since: datetime.datetime | None):
    """The messages of `stream` on `subject` (all, or from `since`) up to the last one there now, in order,
    through an ordered consumer that is gone afterwards."""
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL) if since is None else \
        ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
            return  # nothing there from `since` on (none pending, none on its way)
        while True:
            try:
                msg = await sub.next_msg(timeout=RECOVERY_READ_WALL_S)
            except TimeoutError:  # nothing (more) from `since` on: the stream holds none
                return
            yield msg
            if msg.metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()
