"""Engine worker: owns one replica, serves `Dispatch`es from the gateway and replies to the client.

- Requests arrive on `Subjects.replica(replica_id)` with the client's inbox as reply subject; the
  worker answers there directly (the gateway is not on the reply path).
- Exactly once: requests are de-duplicated by reply-inbox prefix and request id (`dedupe_key`: one
  client's retries match, another client reusing the id does not) and served once. A duplicate of one still
  in flight is not served again: to the same inbox it is dropped, to a new inbox (a client's retry)
  the one answer is sent there too; a duplicate of one already answered, asking the same
  (`Dispatch.fingerprint`), gets the stored reply (the last `dedupe_capacity` answers are kept) and is
  released; one asking something else is served anew. A dispatch whose reply subject is not an inbox
  is dropped (`reply_error`): it came from no gateway.
- Completions (`Completed`, ids and numbers) go out on the completions subject, which a JetStream stream
  captures, before the replies they name and in the same write (a crash loses both or neither); the
  gateway uses them to forget what it forwarded, the forecaster to learn true output lengths.
- Deadlines: a dispatch past its `deadline_unix_s` is refused `deadline_exceeded`, and one in flight is
  aborted at it (its KV freed) with that answer. Beyond `max_waiting` waiting, a dispatch is refused
  `overloaded`.
- Fencing: a replica whose own loop went `fence_after_wall_s` without a heartbeat (a pause, a long
  collection) may have been declared dead and its requests re-dispatched; it drops what it holds
  unanswered and hands it back (`Completed.requeue`) before it answers anything else. A later copy of a
  dispatch it handed back (`Dispatch.dispatch_no` no higher than the one it held) is dropped: the gateway's
  own dispatch after the hand-back answers it, here too when this is the only replica.
- Requests answered with an error are listed in `Completed.released` (no numbers), so the gateway
  forgets them too.
- `stop()` is as good as a crash (the gateway re-dispatches); `fail_inflight()` after it answers what
  was left with `shutting_down` errors instead (an engine host's orderly stop).
- Migration in a switch (`drain_migrating`): a retiring replica finishes requests in place for
  `DrainReplica.migrate_after_s`, then hands over what still runs: each request leaves the backend (its KV
  freed), its client first gets every token generated so far, and `Completed.migrated` carries the token
  ids, the text and what the client was sent; the gateway dispatches it to a new replica with
  `Dispatch.resume`, which prefills the prompt plus those tokens, generates the rest and streams on from
  where the client stands. The answer comes once, from the new replica: a copy of a handed-over request that
  reaches the retiring replica afterwards without a resume (a client's retry its gateway forwarded before it
  heard of the hand-over) is dropped there. With greedy sampling on replicas that compute alike it is token
  for token the answer without a switch (`tests/test_live_switch.py`).
- Moving what outgrew its class (`Dispatch.move_after_tokens`): once a request's answer reaches that count
  the engine asks its gateway whether to move it (`MoveAsk`, on the gateway's own subject) and goes on
  serving it. Told to (`MoveAnswer.go`: a replica of the class it grew into has room), it hands it back the
  same way at once (`_move_outgrown`) and its gateway continues it there (`oserve.correction`); told to stay,
  or unanswered, it asks again `move_check_interval_s` later, while the request runs.
- Liveness: a `Heartbeat` every `heartbeat_interval_wall_s`, with the load and the backend's cumulative
  busy and saturated seconds (what the scheduler learns capacity from); load and latency as `Telemetry`
  every `telemetry_interval_s` of clock time.
- Streaming (`Dispatch.stream`): `ReplyChunk`s go to the reply inbox as the backend produces tokens (the
  first as soon as a step end shows it, then at most one per `stream_interval_s` of clock time, and the
  rest just before the final `Reply`, which carries the whole text and alone ends the answer). Only the
  first inbox gets chunks; duplicates get the final `Reply` as above, so exactly once still holds for it.
  Each chunk says where its text starts (`ReplyChunk.offset_chars`), so a client can splice a
  re-dispatched request's chunks onto what it has.
- Cancellation: an `AbortRequest` from the gateway (on the dispatch subject, after the dispatch it names;
  its client sent a `CancelRequest`) removes the request from the backend, freeing its KV; it gets no
  more chunks, its inboxes an `ErrorReply` code `cancelled`, and it is `released` in the next `Completed`
  and counted as `vllm:request_success{finished_reason="abort"}`. Its answer is not stored: the same id
  sent again is served anew.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from oserve.errors import ConfigError
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import (GEN_AI_PROVIDER, extract, genai_span_name, inject, messaging_attributes,
                                          trace_headers)
from oserve.streams.schemas import (EVENT_BATCH_ITEMS, MAX_MESSAGE_BYTES, MAX_RESUME_TOKENS, AbortRequest, Completed,
                                    Completion, Dispatch, ErrorCode, ErrorReply, Heartbeat, Migration, MoveAnswer,
                                    MoveAsk, Reply, ReplyChunk, Resume, SchemaError, Telemetry, decode, encode)
from oserve.streams.subjects import Subjects, dedupe_key, gateway_of, owner_of, reply_error
from oserve.workers.backends import Backend, EchoBackend, Finished, Job, SimBackend, SimBackendConfig
from oserve.workers.base import Worker
from oserve.workers.clock import Clock

log = logging.getLogger(__name__)
MAX_HANDED_KEYS = 100_000
"""Requests handed over in a switch, or handed back by a fence, whose later copies a replica recognises (and
drops), at most (each kind)."""
CONFIRM_WAIT_WALL_S = 3600.0
"""How long a heartbeat's confirmation (a flush) may wait for its PONG: in effect forever, as giving up on one
would stop the connection's reading (`EngineWorker._heartbeat_loop`); a stall is judged by `_stalled` meanwhile."""


def _remember(keys: collections.OrderedDict, key: str, value) -> None:
    """Record `key` (with `value`) as the newest of `keys`, which keeps the last `MAX_HANDED_KEYS`."""
    keys[key] = value
    keys.move_to_end(key)
    while len(keys) > MAX_HANDED_KEYS:
        keys.popitem(last=False)


@dataclass(frozen=True, slots=True)
class EngineWorkerConfig:
    """One engine worker."""

    replica_id: str
    """This replica's id; one subject token."""
    subjects: Subjects = field(default_factory=Subjects)
    backend: Literal["sim", "echo", "vllm"] = "sim"
    """`sim`: SimReplica timed by the performance model on the clock; `echo`: answers at once; `vllm`: a real
    vLLM engine (`oserve.workers.vllm_backend.VllmBackend`, started by the caller and handed in)."""
    served_model: str = ""
    """The model's name in spans and metrics; empty: the simulated model's (`sim.model`)."""
    sim: SimBackendConfig = field(default_factory=SimBackendConfig)
    heartbeat_interval_wall_s: float = 0.5
    completion_flush_wall_s: float = 0.02
    """Releases (requests answered with an error, or from the cache, outside a step's end) are batched for
    at most this long (wall seconds); completions go out with their replies. Deadlines are checked as often."""
    telemetry_interval_s: float = 5.0
    """Clock seconds between telemetry messages."""
    dedupe_capacity: int = 100_000
    """Answered request ids remembered (with their replies) for de-duplication."""
    dedupe_max_bytes: int = 64 * 1024 * 1024
    """Bytes of stored replies the de-duplication cache holds at most (the oldest go first): with answers'
    text in them a reply is about 5 bytes a token, so 100,000 answers of 2,048 tokens would be 1 GB."""
    drain_timeout_wall_s: float = 30.0
    stream_interval_s: float = 0.05
    """Clock seconds between two chunks of a streamed answer (a few decode steps of a 7B model)."""
    move_check_interval_s: float = 1.0
    """Clock seconds between two looks at the answers' lengths of requests that may outgrow their class
    (`Dispatch.move_after_tokens`; the simulator's gateway looks as often, `oserve.correction.CorrectionConfig`),
    and between two asks to move the same request (`MoveAsk`). Step ends between them look too."""
    max_waiting: int = 8192
    """Requests waiting (not yet running) in the backend beyond which a new dispatch is refused `overloaded`
    (the gateway refuses earlier, by the replica's measured rate; this bounds what a stale view lets in)."""
    fence_after_wall_s: float = 1.5
    """A replica with no heartbeat confirmed by the server for this long (a paused process, a long
    collection, a connection down or too slow) may have been declared dead and its requests re-dispatched:
    it fences itself, dropping what it holds unanswered and handing it back (`Completed.requeue`), so a
    re-dispatched request is not answered by both replicas. Keep it under the gateways'
    `heartbeat_timeout_wall_s` minus a heartbeat interval."""
    reply_roots: tuple[str, ...] | None = None
    """Inbox roots a dispatch's reply may start with (`oserve.streams.subjects.reply_error`); None: the
    clients' prefix and `_INBOX`. A dispatch with another reply is dropped (it never came from a gateway)."""

    def __post_init__(self) -> None:
        self.subjects.replica(self.replica_id)  # validates the id as a subject token
        if self.backend not in ("sim", "echo", "vllm"):
            raise ConfigError(f"EngineWorkerConfig.backend must be sim, echo or vllm, got {self.backend!r}")
        for name in ("heartbeat_interval_wall_s", "completion_flush_wall_s", "telemetry_interval_s",
                     "drain_timeout_wall_s", "stream_interval_s", "fence_after_wall_s", "move_check_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"EngineWorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.dedupe_capacity < 1:
            raise ConfigError(f"EngineWorkerConfig.dedupe_capacity must be >= 1, got {self.dedupe_capacity}")
        if self.max_waiting < 1:
            raise ConfigError(f"EngineWorkerConfig.max_waiting must be >= 1, got {self.max_waiting}")
        if self.fence_after_wall_s <= self.heartbeat_interval_wall_s:
            raise ConfigError(f"EngineWorkerConfig.fence_after_wall_s ({self.fence_after_wall_s}) must exceed "
                              f"heartbeat_interval_wall_s ({self.heartbeat_interval_wall_s})")
        if self.dedupe_max_bytes < 1:
            raise ConfigError(f"EngineWorkerConfig.dedupe_max_bytes must be >= 1, got {self.dedupe_max_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model or self.sim.model


@dataclass(slots=True)
class _InFlight:
    job: Job
    reply: str
    span: Span | None
    headers: dict[str, str] | None
    also_reply: list[str] = field(default_factory=list)
    """Other reply subjects that asked for the same request while it ran (a client's retry)."""
    key: str = ""
    """The de-duplication key (`dedupe_key`)."""
    owner: str = ""
    """`owner_of` its gateway and inbox: named beside it in `Completed` so only that gateway acts on it."""
    fingerprint: str = ""
    """`Dispatch.fingerprint`: its stored answer is resent only to the same ask."""
    deadline_unix_s: float | None = None
    dispatch_no: int | None = None
    """`Dispatch.dispatch_no` of the dispatch it runs from."""
    sent_tokens: int = 0
    """Streamed requests: tokens already sent in chunks."""
    sent_chars: int = 0
    """Streamed requests: characters of text already sent in chunks."""
    num_chunks: int = 0
    last_chunk_s: float = float("-inf")
    """Clock time of the last chunk sent."""


class EngineWorker(Worker):
    """One replica on the bus (see the module docstring)."""

    name = "engine"

    def __init__(self, nc: NATS, config: EngineWorkerConfig, clock: Clock, *, tracer: Tracer | None = None,
                 backend: Backend | None = None, metrics: Metrics | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer = nc, config, clock, tracer
        self.metrics = metrics
        """vLLM's engine metrics, labelled with this replica as `engine` (None: no metrics)."""
        if backend is None:
            if config.backend == "vllm":
                raise ConfigError("EngineWorker: the vllm backend is started by the caller and handed in (backend=)")
            backend = SimBackend(config.replica_id, config.sim) if config.backend == "sim" else EchoBackend()
        self.backend = backend
        self._seq = 0
        self._inflight: dict[int, _InFlight] = {}  # seq -> request being served
        self._by_id: dict[str, int] = {}  # dedupe key -> seq, while in flight
        # dedupe key + " " + fingerprint -> reply
        self._answered: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._answered_bytes = 0  # sum of len() of the replies in _answered
        self._released: list[tuple[str, str]] = []  # (request id, owner) answered with an error since the last flush
        # the outbox of this turn of the event loop (`_finish`): completions and releases, then the replies
        self._out_completions: list[Completion] = []
        self._out_released: list[tuple[str, str]] = []
        self._out_replies: list[tuple[str, bytes, dict[str, str] | None]] = []
        self._out_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        if hasattr(backend, "notify"):
            backend.notify = self._wake.set  # a backend that finishes on its own (vLLM) wakes the step loop
        self._waiting_for_s: float | None = None  # the backend event time the step loop sleeps towards
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._streams: set[int] = set()  # seqs of in-flight requests whose client streams the answer
        self._chunk_tick_s: float | None = None  # clock time of the next chunk pass, while any streams
        # counters
        self.num_received = 0
        self.num_answered = 0
        self.num_duplicates = 0
        self.num_cancelled = 0
        self.num_errors = 0
        self.num_bad_reply = 0  # dispatches dropped for a reply subject that is not an inbox
        self.num_expired = 0  # requests answered `deadline_exceeded` (refused or aborted at their deadline)
        self.num_overloaded = 0
        self.num_fenced = 0  # times this replica fenced itself after a stall
        self.num_migrated = 0  # requests handed over mid-answer to a switch's new replicas
        self.num_moved_outgrown = 0  # requests handed back mid-answer for outgrowing their class (`_move_outgrown`)
        self.num_move_asks = 0  # `MoveAsk`s sent (a request told to stay asks again later)
        self._move_asked: dict[int, float] = {}  # seq -> clock time before which it is not asked about again
        self._move_go: set[int] = set()  # seqs whose gateway said to move them (`MoveAnswer.go`)
        self._move_after: dict[int, int] = {}  # seq -> `Dispatch.move_after_tokens` of requests in flight
        self._move_tick_s: float | None = None  # next look at their lengths (`move_check_interval_s`)
        self.num_stale_handed = 0  # copies of handed-over or handed-back requests that came after, dropped
        # dedupe keys of the requests handed over (`_migrate`), the last MAX_HANDED_KEYS
        self._handed_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        # dedupe keys of the requests a fence handed back (`_fence`), the last MAX_HANDED_KEYS, with the
        # `Dispatch.dispatch_no` each was handed back at: a copy numbered no higher is stale
        self._fenced_keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._migrate_after_wall_s: float | None = None  # set by `drain_migrating`
        self._window_e2e: list[float] = []
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline_unix_s, seq) of in-flight requests
        self._reply_roots = config.reply_roots or (config.subjects.reply_prefix(), "_INBOX")
        self._last_beat_wall_s: float | None = None  # loop time of the last heartbeat the server confirmed
        self._confirming: asyncio.Task | None = None  # the flush confirming the heartbeats sent (`_confirm`)

    # --- lifecycle ---------------------------------------------------------------------------------

    async def _subscribe(self) -> list:
        return [await self.nc.subscribe(self.config.subjects.replica(self.config.replica_id), cb=self._on_dispatch)]

    def _loops(self):
        return [self._step_loop, self._flush_loop, self._heartbeat_loop, self._telemetry_loop]

    async def drain_migrating(self, migrate_after_wall_s: float | None) -> None:
        """Drain, handing over to the new replicas of a switch what still runs after `migrate_after_wall_s`
        (None: a plain `drain`, everything finishes here). See `_migrate`."""
        self._migrate_after_wall_s = migrate_after_wall_s
        await self.drain()

    async def _drain(self) -> None:
        self._accepting = False
        await self._send_heartbeat()
        if self._migrate_after_wall_s is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), self._migrate_after_wall_s)
            except TimeoutError:
                await self._migrate()
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_wall_s)
        except TimeoutError:
            log.warning("%s: drain timed out with %d requests in flight", self.config.replica_id, len(self._inflight))
        if self._out_task is not None:
            await self._out_task  # the last answers go out
        await self._flush_completions()

    async def _on_stop(self) -> None:
        if self._out_task is not None and not self._out_task.done():
            self._out_task.cancel()  # a stop is as good as a crash: answers not yet sent are lost with it
        if self.metrics is not None:
            self.metrics.engine_stopped(self.config.model_name, self.config.replica_id)
        for item in self._inflight.values():
            if item.span is not None:
                item.span.set_attribute("oserve.abandoned", True)
                item.span.end()

    async def fail_inflight(self) -> None:
        """Answer every request still in flight with a `shutting_down` error and tell the gateway to forget it.

        For an orderly stop (an engine host shutting down): a client gets an error rather than silence,
        and the gateway does not re-dispatch what was already answered. A plain `stop()` stays as good as
        a crash (the gateway re-dispatches).
        """
        inflight, self._inflight = self._inflight, {}
        self._by_id.clear()
        self._streams.clear()
        self._idle.set()
        for item in inflight.values():
            job = item.job
            payload = encode(ErrorReply(request_id=job.request_id, code=ErrorCode.SHUTTING_DOWN,
                                        message=f"replica {self.config.replica_id} stopped before answering"))
            self._released.append((job.request_id, item.owner))
            self._remember(f"{item.key} {item.fingerprint}", payload)
            if self.metrics is not None:
                self.metrics.request_aborted(self.config.model_name, self.config.replica_id)
            try:
                for reply in ([item.reply] if item.reply else []) + item.also_reply:
                    await self.nc.publish(reply, payload)
            except Exception:  # connection already closed: nobody left to tell
                log.debug("%s: could not answer %s at stop", self.config.replica_id, job.request_id, exc_info=True)
            if item.span is not None and item.span.is_recording():
                item.span.set_attribute("oserve.abandoned", True)
                item.span.end()
        try:
            await self._flush_completions()
        except Exception:  # connection already closed
            log.debug("%s: could not flush completions at stop", self.config.replica_id, exc_info=True)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # --- the request path --------------------------------------------------------------------------

    async def _on_dispatch(self, msg: Msg) -> None:
        try:
            await self._handle(msg)
        except Exception:  # the outermost handler: log and keep serving
            self.num_errors += 1
            log.exception("%s: dispatch handler failed", self.config.replica_id)

    async def _handle(self, msg: Msg) -> None:
        self.num_received += 1
        try:
            d = decode(msg.data, Dispatch | AbortRequest | MoveAnswer)
        except SchemaError as exc:
            self.num_errors += 1
            if msg.reply:
                await self.nc.publish(msg.reply, encode(ErrorReply(code=exc.code, message=exc.message)))
            return
        if isinstance(d, AbortRequest):
            await self._abort(d)
            return
        if isinstance(d, MoveAnswer):
            self._move_answer(d)
            return
        assert isinstance(d, Dispatch)
        if msg.reply and reply_error(msg.reply, self._reply_roots) is not None:
            self.num_bad_reply += 1  # not a gateway's dispatch: nothing is published to that subject
            return
        key = dedupe_key(msg.reply, d.request_id)
        owner = owner_of(d.gateway_id, msg.reply)
        cached = self._answered.get(f"{key} {d.fingerprint}")
        if cached is not None or key in self._by_id:
            self.num_duplicates += 1
            if cached is not None:
                # answered before: the gateway that sent it again holds a new entry, which no completion
                # will clear unless it is released (it would be re-dispatched and served again); released
                # before the resend, as `_finish` does
                await self._publish_completed([], [(d.request_id, owner)])
            if cached is not None:
                if msg.reply and not d.recovered:  # a recovered one's client had it already
                    await self.nc.publish(msg.reply, cached)
            elif msg.reply:
                item = self._inflight[self._by_id[key]]
                if msg.reply != item.reply and msg.reply not in item.also_reply:
                    item.also_reply.append(msg.reply)  # a retry from a new inbox: answer it too, once
            return
        if d.resume is None and key in self._handed_keys:
            # a copy of a request this replica handed over, sent before its gateway heard of the hand-over (a
            # client's retry the gateway forwarded here): the new replica answers it on the same inbox, with
            # what it generated here; serving it again here would answer it twice
            self.num_stale_handed += 1
            return
        if d.dispatch_no is not None and d.dispatch_no <= self._fenced_keys.get(key, -1):
            # a copy of a dispatch this replica handed back when it fenced itself, sent before its gateway heard
            # of the hand-back (a client's retry it forwarded here): the gateway's own dispatch after the
            # hand-back, numbered higher, answers it (here too, when this is the only replica)
            self.num_stale_handed += 1
            return
        if d.deadline_unix_s is not None and time.time() >= d.deadline_unix_s:
            self.num_expired += 1
            await self._refuse(msg.reply, d.request_id, owner, ErrorCode.DEADLINE_EXCEEDED,
                               "the request's deadline passed before it reached its replica")
            return
        load = self.backend.load()
        if load.num_waiting >= self.config.max_waiting:
            self.num_overloaded += 1
            await self._refuse(msg.reply, d.request_id, owner, ErrorCode.OVERLOADED,
                               f"replica {self.config.replica_id} has {load.num_waiting} requests waiting; retry later")
            return
        now_s = self.clock.now_s()
        self._seq += 1
        resume = d.resume
        job = Job(self._seq, d.request_id, d.input_tokens, d.max_tokens, d.type_index, now_s,
                  d.sim_output_tokens or 0, stream=d.stream, detokenize=d.detokenize, prompt=d.prompt,
                  temperature=d.temperature, top_p=d.top_p, seed=d.seed, stop=tuple(d.stop),
                  resumed_tokens=resume.num_tokens if resume else 0,
                  resumed_ids=tuple(resume.token_ids) if resume else (), resumed_text=resume.text if resume else "")
        span = None
        if self.tracer is not None:
            # the GenAI inference span ("text_completion llama2-7b"), consuming the dispatch message
            model = self.config.model_name
            span = self.tracer.start_span(genai_span_name("text_completion", model), context=extract(msg.headers),
                                          kind=SpanKind.CONSUMER,
                                          attributes={"oserve.step": "engine.serve", "oserve.request_id": d.request_id,
                                                      "oserve.replica_id": self.config.replica_id,
                                                      "oserve.attempt": d.attempt,
                                                      "oserve.input_tokens": d.input_tokens,
                                                      "gen_ai.operation.name": "text_completion",
                                                      "gen_ai.provider.name": GEN_AI_PROVIDER,
                                                      "gen_ai.request.model": model,
                                                      "gen_ai.request.max_tokens": d.max_tokens,
                                                      **messaging_attributes(msg.subject, "process", "process",
                                                                             message_id=d.request_id,
                                                                             body_size_bytes=len(msg.data))})
        self._inflight[job.seq] = _InFlight(job, msg.reply, span, None if span else trace_headers(msg.headers),
                                            key=key, owner=owner, fingerprint=d.fingerprint, deadline_unix_s=d.deadline_unix_s,
                                            dispatch_no=d.dispatch_no,
                                            sent_tokens=resume.sent_tokens if resume else 0,
                                            sent_chars=resume.sent_chars if resume else 0)
        if resume is not None and span is not None:
            span.set_attributes({"oserve.resumed_tokens": resume.num_tokens, "oserve.migrated_from": resume.from_replica})
        self._by_id[key] = job.seq
        if d.move_after_tokens is not None:
            self._move_after[job.seq] = d.move_after_tokens
            if self._move_tick_s is None:
                self._move_tick_s = now_s + self.config.move_check_interval_s
                self._wake.set()  # the step loop must wake to look at the answers' lengths too
        if d.deadline_unix_s is not None:
            heapq.heappush(self._deadlines, (d.deadline_unix_s, job.seq))
        self._idle.clear()
        if d.stream:
            self._streams.add(job.seq)
            if self._chunk_tick_s is None:
                self._chunk_tick_s = now_s + self.config.stream_interval_s
                self._wake.set()  # the step loop must wake for chunk passes too
        done = self.backend.add(job, now_s)
        if done:
            await self._finish(done)
        if self.backend.next_event_s() != self._waiting_for_s:
            self._wake.set()  # the step loop sleeps towards a stale time

    async def _refuse(self, reply: str, request_id: str, owner: str, code: str, message: str) -> None:
        """Answer a dispatch with an error without serving it, and release it (the gateway forgets it): the
        release first, in the same write, as `_finish` does."""
        await self._publish_completed([], [(request_id, owner)])
        if reply:
            await self.nc.publish(reply, encode(ErrorReply(request_id=request_id, code=code, message=message)))

    async def _expire(self) -> None:
        """Abort the in-flight requests whose deadline passed (nobody waits for them), answering
        `deadline_exceeded` and releasing them."""
        if self._stalled():  # what it holds may be another replica's by now: hand it back, answer nothing
            await self._fence()
            return
        now_unix = time.time()
        heap = self._deadlines
        while heap and heap[0][0] <= now_unix:
            _, seq = heapq.heappop(heap)
            item = self._inflight.get(seq)
            if item is None:
                continue  # answered already
            self.num_expired += 1
            payload = encode(ErrorReply(request_id=item.job.request_id, code=ErrorCode.DEADLINE_EXCEEDED,
                                        message="the request's deadline passed before its answer was ready"))
            await self._publish_completed([], [(item.job.request_id, item.owner)])  # before the answer, as `_finish` does
            await self._drop(item, reason="deadline_exceeded", payload=payload)

    async def _drop(self, item: _InFlight, *, reason: str, payload: bytes | None) -> None:
        """Take one in-flight request out of the backend (freeing its KV) and end it; `payload` goes to its
        inboxes (None: silence). Its answer is not stored: the same id sent again is served anew."""
        job = item.job
        self._inflight.pop(job.seq, None)
        self._by_id.pop(item.key, None)
        self._streams.discard(job.seq)
        done = self.backend.cancel(job.seq, self.clock.now_s())
        if self.metrics is not None:
            self.metrics.request_aborted(self.config.model_name, self.config.replica_id)
        if payload is not None:
            for reply in ([item.reply] if item.reply else []) + item.also_reply:
                await self.nc.publish(reply, payload)
        if item.span is not None:
            item.span.set_attributes({"oserve.cancelled": reason, "gen_ai.response.finish_reasons": ("abort",),
                                      "oserve.output_tokens": item.sent_tokens})
            item.span.end()
        if done:
            await self._finish(done)
        if not self._inflight:
            self._idle.set()
        if self.backend.next_event_s() != self._waiting_for_s:
            self._wake.set()

    async def _migrate(self) -> None:
        """Hand every request still in flight over to the new replicas of a switch (`_hand_over`)."""
        if self._stalled():
            return
        handed = await self._hand_over(list(self._inflight.values()), self.clock.now_s())
        self.num_migrated += handed
        if handed:
            log.info("%s: %d requests handed over to the new deployment", self.config.replica_id, handed)

    async def _move_outgrown(self, now_s: float) -> None:
        """Requests whose answers reached their `Dispatch.move_after_tokens` outgrew the class they were routed as
        into one this replica does not serve: ask their gateway whether to move each (`MoveAsk`), at most once
        per `move_check_interval_s`, and hand back those it said to move (`_hand_over`; it continues them)."""
        due, asks = [], []
        for seq, after in list(self._move_after.items()):
            item = self._inflight.get(seq)
            if item is None:
                self._forget_move(seq)
            elif seq in self._move_go:
                due.append(item)
            elif self._move_asked.get(seq, float("-inf")) <= now_s and \
                    (generated := self.backend.generated_tokens(seq, now_s)) >= after:
                self._move_asked[seq] = now_s + self.config.move_check_interval_s
                asks.append((item, generated))
        if due and not self._stalled():  # a stalled replica keeps them marked, and hands them back once it is not
            self.num_moved_outgrown += await self._hand_over(due, now_s)
            for item in due:  # handed back, or finishing here (`_hand_over`'s limits): either way, not asked about again
                self._forget_move(item.job.seq)
        for item, generated in asks:
            try:
                subject = self.config.subjects.gateway_moves(gateway_of(item.owner))
            except ConfigError:  # no gateway named (an older one), or an id that is no subject token
                self._forget_move(item.job.seq)  # it finishes here
                continue
            self.num_move_asks += 1
            await self.nc.publish(subject, encode(MoveAsk(
                request_id=item.job.request_id, inbox=item.reply, replica_id=self.config.replica_id,
                generated_tokens=max(1, generated))))

    def _forget_move(self, seq: int) -> None:
        self._move_after.pop(seq, None)
        self._move_asked.pop(seq, None)
        self._move_go.discard(seq)

    def _move_answer(self, a: MoveAnswer) -> None:
        """Its gateway's answer to a `MoveAsk`: `go` marks the request to be handed back at once (the step loop
        wakes for it); otherwise it stays, and is asked about again later. One not in flight here is ignored."""
        seq = self._by_id.get(dedupe_key(a.inbox, a.request_id))
        if seq is None or seq not in self._move_after or not a.go:
            return
        self._move_go.add(seq)
        self._move_tick_s = self.clock.now_s()
        self._wake.set()

    async def _hand_over(self, items: list[_InFlight], now_s: float) -> int:
        """Hand `items` over to their gateway to be continued elsewhere: each is dropped here, its KV freed, and
        listed in `Completed.migrated` with what it generated (token ids and text) and what its client was
        sent; the gateway dispatches it to another replica, which continues it (`Dispatch.resume`). Nothing is
        answered here. A request past `MAX_RESUME_TOKENS`, or one already complete, finishes in place. Returns
        how many were handed over."""
        handed: list[Migration] = []
        for item in items:
            job = item.job
            if self._inflight.get(job.seq) is not item:
                continue  # answered or dropped meanwhile
            tokens = self.backend.generated_tokens(job.seq, now_s)
            ids = self.backend.token_ids(job.seq)[:tokens]
            if tokens > MAX_RESUME_TOKENS or tokens >= job.answer_tokens:
                continue
            text = self.backend.text(job.seq, 0, tokens) if job.detokenize else ""
            if len(text.encode()) > MAX_MESSAGE_BYTES // 2:
                continue
            # out of flight before anything is awaited: from here on nothing answers it on this replica
            self._inflight.pop(job.seq, None)
            self._by_id.pop(item.key, None)
            self._forget_move(job.seq)
            _remember(self._handed_keys, item.key, None)
            chunk = None
            if job.seq in self._streams and tokens > item.sent_tokens:  # the client gets all of it before it moves
                chunk = ReplyChunk(request_id=job.request_id, replica_id=self.config.replica_id, index=item.num_chunks,
                                   offset_tokens=item.sent_tokens, num_tokens=tokens - item.sent_tokens,
                                   text=text[item.sent_chars:], offset_chars=item.sent_chars)
                item.sent_tokens, item.sent_chars = tokens, len(text)
            self._streams.discard(job.seq)
            handed.append(Migration(request_id=job.request_id, owner=item.owner, resume=Resume(
                num_tokens=tokens, token_ids=ids, text=text, sent_tokens=min(item.sent_tokens, tokens),
                sent_chars=min(item.sent_chars, len(text)) if job.detokenize else 0,
                from_replica=self.config.replica_id)))
            done = self.backend.cancel(job.seq, now_s)
            if chunk is not None and item.reply:
                await self.nc.publish(item.reply, encode(chunk))
            if item.span is not None:
                item.span.set_attributes({"oserve.cancelled": "migrated", "oserve.output_tokens": tokens})
                item.span.end()
            if done:
                await self._finish(done)
        if not self._inflight:
            self._idle.set()
        self._wake.set()
        for i in range(0, len(handed), EVENT_BATCH_ITEMS):
            await self.nc.publish(self.config.subjects.completions(), encode(Completed(
                replica_id=self.config.replica_id, items=[], migrated=handed[i:i + EVENT_BATCH_ITEMS],
                **self.clock.stamp())))
        return len(handed)

    def _stalled(self) -> bool:
        """Whether this replica went longer than `fence_after_wall_s` without a heartbeat the server confirmed
        having (its loop stalled, or its connection was down or too slow: the gateways heard nothing)."""
        last = self._last_beat_wall_s
        return last is not None and asyncio.get_running_loop().time() - last > self.config.fence_after_wall_s

    async def _fence(self) -> None:
        """After a stall (`fence_after_wall_s`): drop everything in flight unanswered and hand it back to the
        gateway (`Completed.requeue`), then announce this replica alive again. What a gateway re-dispatched
        while it was silent is served by the other replica alone; the rest is dispatched again."""
        self.num_fenced += 1
        items = list(self._inflight.values())
        log.warning("%s: stalled for more than %.1f s; fencing: %d requests handed back", self.config.replica_id,
                    self.config.fence_after_wall_s, len(items))
        self._last_beat_wall_s = asyncio.get_running_loop().time()  # one fence per stall
        self._inflight, self._streams, self._deadlines = {}, set(), []
        self._by_id.clear()
        now_s = self.clock.now_s()
        for item in items:  # what the backend finishes meanwhile names no request in flight: ignored
            self.backend.cancel(item.job.seq, now_s)
            if item.dispatch_no is not None:
                _remember(self._fenced_keys, item.key, max(item.dispatch_no, self._fenced_keys.get(item.key, -1)))
            if item.span is not None:
                item.span.set_attribute("oserve.cancelled", "fenced")
                item.span.end()
        requeue = [item.job.request_id for item in items]
        owners = [item.owner for item in items]
        self._idle.set()
        self._wake.set()
        for i in range(0, len(requeue), EVENT_BATCH_ITEMS):
            await self.nc.publish(self.config.subjects.completions(), encode(Completed(
                replica_id=self.config.replica_id, items=[], requeue=requeue[i:i + EVENT_BATCH_ITEMS],
                requeue_owners=owners[i:i + EVENT_BATCH_ITEMS],
                **self.clock.stamp())))
        await self._send_heartbeat()

    async def _send_chunk(self, item: _InFlight, tokens: int, now_s: float) -> None:
        """Send the tokens of a streamed answer produced since its last chunk, up to `tokens`."""
        job = item.job
        text = self.backend.text(job.seq, item.sent_tokens, tokens) if job.detokenize else ""
        chunk = ReplyChunk(request_id=job.request_id, replica_id=self.config.replica_id, index=item.num_chunks,
                           offset_tokens=item.sent_tokens, num_tokens=tokens - item.sent_tokens, text=text,
                           offset_chars=item.sent_chars)
        item.sent_tokens, item.sent_chars, item.last_chunk_s = tokens, item.sent_chars + len(text), now_s
        item.num_chunks += 1
        if item.reply:
            await self.nc.publish(item.reply, encode(chunk))

    async def _abort(self, a: AbortRequest) -> None:
        """Drop a request its client cancelled (see the module docstring); one not in flight here is ignored.

        Not in `_released`: the gateway that sent the abort forgot the request already, and a release
        arriving after the client sent the same id again would make it forget the new one. With
        `AbortRequest.answered` (the gateway answered its deadline) the inboxes get nothing more."""
        seq = self._by_id.get(dedupe_key(a.inbox, a.request_id))
        if seq is None:
            return  # answered already, or never here
        self.num_cancelled += 1
        payload = None if a.answered else encode(ErrorReply(
            request_id=a.request_id, code=ErrorCode.CANCELLED,
            message=f"cancelled by its client ({a.reason or 'no reason given'})"))
        await self._drop(self._inflight[seq], reason=a.reason or "cancelled", payload=payload)

    async def _send_chunks(self, now_s: float) -> None:
        """One chunk pass: each streamed request with new tokens gets them, at most once per interval
        after its first chunk (which goes as soon as a token shows)."""
        interval_s = self.config.stream_interval_s
        for seq in list(self._streams):
            item = self._inflight.get(seq)
            if item is None:
                self._streams.discard(seq)
                continue
            if item.num_chunks and now_s - item.last_chunk_s < interval_s * 0.999:
                continue
            tokens = self.backend.generated_tokens(seq, now_s)
            if tokens > item.sent_tokens:
                await self._send_chunk(item, tokens, now_s)
        self._chunk_tick_s = now_s + interval_s if self._streams else None

    def _remember(self, key: str, payload: bytes) -> None:
        """Keep an answer for de-duplication, within `dedupe_capacity` answers and `dedupe_max_bytes`."""
        old = self._answered.pop(key, None)
        if old is not None:
            self._answered_bytes -= len(old)
        self._answered[key] = payload
        self._answered_bytes += len(payload)
        while self._answered and (len(self._answered) > self.config.dedupe_capacity
                                  or self._answered_bytes > self.config.dedupe_max_bytes):
            _, dropped = self._answered.popitem(last=False)
            self._answered_bytes -= len(dropped)

    async def _finish(self, done: list[Finished]) -> None:
        """Answer what the backend finished. The answers go to an outbox that `_send_out` empties at the end
        of this turn of the event loop: one `Completed` naming every answer of the turn, then the replies,
        with no await in between that could let anything run (nats-py queues them in one write), so a crash
        loses both or neither: the gateway never re-dispatches an answered request, nor forgets an
        unanswered one. After a stall the replica fences itself first (`fence_after_wall_s`)."""
        if self._stalled():
            await self._fence()
            return
        ended: list[tuple[_InFlight, Finished, bytes]] = []
        completions: list[Completion] = []
        released: list[tuple[str, str]] = []
        for f in done:
            item = self._inflight.pop(f.seq, None)
            if item is None:
                continue
            job = item.job
            del self._by_id[item.key]
            streamed = job.seq in self._streams
            self._streams.discard(job.seq)
            if f.error:
                payload = encode(ErrorReply(request_id=job.request_id, code=ErrorCode.INVALID, message=f.error))
                released.append((job.request_id, item.owner))
            else:
                ttft_s, e2e_s = f.first_token_s - job.arrival_s, f.finish_s - job.arrival_s
                if streamed and f.output_tokens > item.sent_tokens:  # the rest before the final reply
                    await self._send_chunk(item, f.output_tokens, f.finish_s)
                payload = encode(Reply(request_id=job.request_id, replica_id=self.config.replica_id,
                                       input_tokens=job.input_tokens, output_tokens=f.output_tokens,
                                       type_index=job.type_index, ttft_s=ttft_s, e2e_s=e2e_s,
                                       text=self.backend.text(job.seq, 0, f.output_tokens) if job.detokenize else ""))
                completions.append(Completion(
                    request_id=job.request_id, replica_id=self.config.replica_id, input_tokens=job.input_tokens,
                    output_tokens=f.output_tokens, type_index=job.type_index, ttft_s=ttft_s, e2e_s=e2e_s,
                    finished_at_s=f.finish_s, owner=item.owner))
                self._window_e2e.append(e2e_s)
            self._remember(f"{item.key} {item.fingerprint}", payload)
            ended.append((item, f, payload))
        self._out_completions.extend(completions)
        self._out_released.extend(released)
        for item, f, payload in ended:
            job = item.job
            if item.reply:
                headers = inject(item.span) if item.span is not None else item.headers
                self._out_replies.append((item.reply, payload, headers))
            self._out_replies.extend((reply, payload, None) for reply in item.also_reply)
            reason = "length" if f.output_tokens >= job.max_tokens else "stop"
            if self.metrics is not None and not f.error:
                self.metrics.request_finished(self.config.model_name, self.config.replica_id,
                                              input_tokens=job.input_tokens, output_tokens=f.output_tokens,
                                              ttft_s=f.first_token_s - job.arrival_s, e2e_s=f.finish_s - job.arrival_s,
                                              finished_reason=reason)
            if item.span is not None:
                item.span.set_attributes({"oserve.output_tokens": f.output_tokens,
                                          "gen_ai.response.model": self.config.model_name,
                                          "gen_ai.usage.input_tokens": job.input_tokens,
                                          "gen_ai.usage.output_tokens": f.output_tokens,
                                          "gen_ai.response.finish_reasons": ("error",) if f.error else (reason,)})
                if f.error:
                    item.span.set_status(Status(StatusCode.ERROR, "refused"))
                item.span.end()
            self.num_answered += 1
        if self._out_replies or self._out_completions or self._out_released:
            self._schedule_out()
        if not self._inflight:
            self._idle.set()

    def _schedule_out(self) -> None:
        if self._out_task is None or self._out_task.done():
            self._out_task = asyncio.get_running_loop().create_task(self._send_out())

    async def _send_out(self) -> None:
        """Empty the outbox: the `Completed` first, then the replies, in one write (see `_finish`)."""
        await asyncio.sleep(0)  # the rest of this turn's answers join the batch
        completions, self._out_completions = self._out_completions, []
        released, self._out_released = self._out_released, []
        replies, self._out_replies = self._out_replies, []
        try:
            if completions or released:
                await self._publish_completed(completions, released)
            for reply, payload, headers in replies:
                await self.nc.publish(reply, payload, headers=headers)
        except Exception:  # the connection is gone: the gateway re-dispatches what was not released
            log.warning("%s: could not publish %d answers", self.config.replica_id, len(replies), exc_info=True)

    # --- background loops ------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        """Advance the backend at each of its step ends, computed from the clock (no polling)."""
        while True:
            self._wake.clear()
            next_s = self._waiting_for_s = self.backend.next_event_s()
            for tick_s in (self._chunk_tick_s, self._move_tick_s):  # None unless streamed / movable requests are in flight
                if tick_s is not None and (next_s is None or tick_s < next_s):
                    next_s = tick_s
            if next_s is None:
                await self._wake.wait()
                continue
            wait_s = self.clock.wall_seconds_until(next_s)
            if wait_s > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                    continue  # an arrival changed the schedule
                except TimeoutError:
                    pass
            now_s = self.clock.now_s()
            done = self.backend.advance(now_s)
            if done:
                await self._finish(done)
            if self._move_after:
                await self._move_outgrown(now_s)
            # a go that came while this pass awaited is acted on at once, not an interval later
            self._move_tick_s = (now_s if self._move_go else now_s + self.config.move_check_interval_s) \
                if self._move_after else None
            if self._streams:
                await self._send_chunks(now_s)
            else:
                self._chunk_tick_s = None

    async def _flush_completions(self) -> None:
        """Publish the releases gathered since the last flush (answers are published with their replies)."""
        released, self._released = self._released, []
        await self._publish_completed([], released)

    async def _publish_completed(self, items: list[Completion], released: list[tuple[str, str]]) -> None:
        """`released`: (request id, `owner_of`) pairs."""
        for i in range(0, max(len(items), len(released)), EVENT_BATCH_ITEMS):
            part = released[i:i + EVENT_BATCH_ITEMS]
            await self.nc.publish(self.config.subjects.completions(), encode(Completed(
                replica_id=self.config.replica_id, items=items[i:i + EVENT_BATCH_ITEMS],
                released=[rid for rid, _ in part], released_owners=[o for _, o in part], **self.clock.stamp())))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.completion_flush_wall_s)
            if self._deadlines and self._deadlines[0][0] <= time.time():
                await self._expire()
            await self._flush_completions()

    async def _send_heartbeat(self) -> None:
        if self._stalled() and self._inflight:
            await self._fence()  # it sends the heartbeat
            return
        load = self.backend.load()
        if self.metrics is not None:
            self.metrics.engine_load(self.config.model_name, self.config.replica_id, num_running=load.num_running,
                                     num_waiting=load.num_waiting, kv_usage_frac=load.kv_usage_frac)
        await self.nc.publish(self.config.subjects.heartbeat(self.config.replica_id), encode(Heartbeat(
            replica_id=self.config.replica_id, at_s=self.clock.now_s(), num_waiting=load.num_waiting,
            num_running=load.num_running, accepting=self._accepting, kv_load_frac=load.kv_load_frac,
            kv_capacity_tokens=load.kv_capacity_tokens, busy_s=load.busy_s, saturated_s=load.saturated_s,
            **self.clock.stamp())))

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every interval; one counts for the fence (`_stalled`) only once the server confirms it
        has it (a flush's round trip, `_confirm`): one buffered through a disconnection, or stuck behind a slow
        link, reached no gateway. One confirmation is outstanding at a time, and it is never cut short: a
        flush given up on (its PONG future cancelled) makes nats-py 2.16's read loop stop on that PONG when it
        comes (`InvalidStateError`, "nats: encountered error"), and the connection, shared by the host's
        engines and maybe its other workers, then reads nothing more."""
        loop = asyncio.get_running_loop()
        while True:
            sent_at = loop.time()
            try:
                await self._send_heartbeat()
            except (nats.errors.Error, TimeoutError, OSError):
                pass  # not sent: the next one tries again
            else:
                if self._confirming is None or self._confirming.done():
                    self._confirming = loop.create_task(self._confirm(sent_at), name=f"{self.config.replica_id}-hb")
            await asyncio.sleep(self.config.heartbeat_interval_wall_s)

    async def _confirm(self, sent_at: float) -> None:
        """Wait for the server's PONG to the heartbeats sent so far, then count them as confirmed from `sent_at`.
        Not cancelled at stop (see `_heartbeat_loop`): it ends with the PONG or the connection."""
        try:
            await self.nc.flush(timeout=CONFIRM_WAIT_WALL_S)
        except (nats.errors.Error, TimeoutError, OSError, asyncio.CancelledError):
            return
        self._last_beat_wall_s = max(self._last_beat_wall_s or sent_at, sent_at)

    async def _telemetry_loop(self) -> None:
        window_s = self.config.telemetry_interval_s
        while True:
            await self.clock.sleep(window_s)
            e2e, self._window_e2e = sorted(self._window_e2e), []
            load = self.backend.load()
            await self.nc.publish(self.config.subjects.telemetry(self.config.replica_id), encode(Telemetry(
                source_id=self.config.replica_id, at_s=self.clock.now_s(), window_s=window_s,
                num_requests=len(e2e), num_errors=self.num_errors, requests_per_s=len(e2e) / window_s,
                p50_e2e_s=_quantile(e2e, 0.5), p99_e2e_s=_quantile(e2e, 0.99), num_waiting=load.num_waiting,
                num_running=load.num_running, kv_load_frac=load.kv_load_frac, **self.clock.stamp())))


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


