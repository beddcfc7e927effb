"""Message schemas of the bus: typed, versioned msgspec Structs, decoded strictly at the edge. Pure.

Every payload carries its version in the `type` field (`"submit.v1"`); a breaking change is a new tag
published beside the old one until consumers move, and new fields only ever get defaults. Golden JSON
files under `tests/data/bus/` keep decoding. Decoding failures become a `SchemaError` with a stable
`code` that the gateway turns into an `ErrorReply`.

Time: every `at_s` (and `span_start_s`, `finished_at_s`) is on the workers' `Clock`, which may run
`speedup` times faster than wall time. Messages a telemetry consumer reads carry the clock itself:
`clock_epoch_unix_s` (the Unix time at which the clock read 0) and `clock_speedup`, so

    wall_unix_s = clock_epoch_unix_s + at_s / clock_speedup

(the defaults, 0.0 and 1.0, are what a producer older than these fields means: no mapping known).
The JSON Schema of every message, grouped by subject, is `oserve schema` (`docs/bus-schema.json`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
from msgspec import Meta

# Hard limits of the wire format, whatever a deployment configures below them.
MAX_MESSAGE_BYTES = 256 * 1024
"""Largest payload accepted on any subject (bytes); the server's max_payload is set above this."""
MAX_TOKENS = 1 << 20
"""Largest token count (input, output, hint) a message may carry; more is absurd, not merely large."""
MAX_ID_CHARS = 128
MAX_TIMEOUT_S = 24 * 3600.0
"""Longest wait a request may ask for (`SubmitRequest.timeout_s`)."""
MAX_TAGS = 16
CLIENT_TAG = "client"
"""The `SubmitRequest.tags` key naming who sent a request (an application, an API customer): the gateway
classes by it, as length distributions are strongly per client (`oserve.planner.prior.client_tag`)."""
BYTES_PER_TOKEN = 4
"""Prompt text is counted at about 4 UTF-8 bytes per token; there is no tokenizer on the request path."""

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]
"""An id that names a subject (a replica's): one subject token, as `Subjects` checks it."""
MAX_STOP_SEQUENCES = 4
"""Stop sequences one request may carry (OpenAI's limit)."""
MAX_STOP_CHARS = 256
Tokens = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
PosTokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
Seconds = Annotated[float, Meta(ge=0.0)]
NumBytes = Annotated[int, Meta(ge=0)]
EVENT_BATCH_ITEMS = 500
"""Items per batched event (`Arrived`, `Completed`); about 100 KiB of JSON, well under the message limit."""

TagKey = Annotated[str, Meta(min_length=1, max_length=64)]
TagValue = Annotated[str, Meta(max_length=256)]

# Sampling, as OpenAI's API and vLLM's SamplingParams take it (the ranges are OpenAI's).
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
StopSequences = Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                          Meta(max_length=MAX_STOP_SEQUENCES)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base of every bus message; unknown fields are ignored so a newer producer can add defaults."""


# --- request path -----------------------------------------------------------------------------------


class SubmitRequest(_Msg, frozen=True, kw_only=True, tag="submit.v1"):
    """A client's request to the gateway: a prompt (text or a token count) and generation limits."""

    request_id: Id
    prompt: Annotated[str, Meta(max_length=MAX_MESSAGE_BYTES)] | None = None
    input_tokens: Tokens | None = None
    """Prompt length when the client sends a count instead of text."""
    max_tokens: PosTokens | None = None
    output_hint_tokens: PosTokens | None = None
    """The client's own estimate of the answer's length, used to classify before it is known."""
    tags: Annotated[dict[TagKey, TagValue], Meta(max_length=MAX_TAGS)] = {}
    sim_output_tokens: PosTokens | None = None
    """For the simulated engine only: how long the simulated model's answer is (a real engine decides
    that itself, at its end-of-sequence token). The gateway forwards it to the engine and never reads it
    to classify or route; a trace replay sets it to the trace's output length."""
    stream: bool = False
    """Stream the answer: the engine sends `ReplyChunk`s to the reply inbox as tokens are produced, then
    the final `Reply` (which ends the answer and carries its whole text)."""
    temperature: Temperature | None = None
    """Sampling fields (None / empty: the engine's defaults). They are validated here and forwarded to the
    engine in the `Dispatch` rather than refused, so an OpenAI client's request keeps its meaning on the
    way to an engine that samples (the vLLM backend); the `sim` and `echo` backends answer with
    placeholder text and cannot honour them, and say so in their docstrings."""
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopSequences = []
    timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    """How long (wall seconds, from its arrival at the gateway) the client waits for the answer. Past it,
    the gateway and the engine stop working on the request and answer `deadline_exceeded` (nobody would
    read a later answer); None: the gateway's `max_request_wall_s`."""
    ack: bool = False
    """Ask the gateway to confirm it owns the request: an `Accepted` to the reply inbox once it has
    dispatched or held it. A client that hears neither that nor an answer for a while sends the request
    again (same id): one a gateway took but lost in a crash before owning it is not lost."""

    def prompt_tokens(self) -> int:
        """Input length in tokens: the count given, else the text's approximate count. Pure."""
        if self.input_tokens is not None:
            return self.input_tokens
        return -(-len((self.prompt or "").encode()) // BYTES_PER_TOKEN)


class Ping(_Msg, frozen=True, kw_only=True, tag="ping.v1"):
    """A liveness probe on the submit subject; the gateway answers `Pong`."""

    request_id: Id = "ping"


class Accepted(_Msg, frozen=True, kw_only=True, tag="accepted.v1"):
    """The gateway owns a request (`SubmitRequest.ack`): it will be answered, or refused with an error,
    before its deadline; not an answer (the `Reply` or `ErrorReply` still comes)."""

    request_id: str
    gateway_id: str


class Pong(_Msg, frozen=True, kw_only=True, tag="pong.v1"):
    gateway_id: str
    num_replicas: int


MAX_RESUME_TOKENS = 16384
"""Generated tokens a migrating request may carry (`Resume.token_ids`: about 100 KiB of JSON); one that has
generated more finishes on its old replica instead."""


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request migrated in a switch stood on its old replica: the new replica continues from here
    (it prefills the prompt plus these tokens and generates the rest), so the client's answer carries on."""

    num_tokens: Tokens
    """Tokens generated so far (they count towards `max_tokens`)."""
    token_ids: Annotated[list[int], Meta(max_length=MAX_RESUME_TOKENS)] = []
    """Their ids (a real engine's; empty from a backend without a model, which counts them only)."""
    text: Annotated[str, Meta(max_length=MAX_MESSAGE_BYTES // 2)] = ""
    """Their text, when the answer has text."""
    sent_tokens: Tokens = 0
    """Of them, the tokens the client already got in `ReplyChunk`s: the new replica's chunks go on from here."""
    sent_chars: Annotated[int, Meta(ge=0)] = 0
    from_replica: str = ""
    """The replica it left."""


class Dispatch(_Msg, frozen=True, kw_only=True, tag="dispatch.v1"):
    """A validated request, forwarded by the gateway to one engine worker (reply goes to the client)."""

    request_id: Id
    input_tokens: Tokens
    max_tokens: PosTokens
    """Tokens to generate at most."""
    type_index: int
    """Workload class the gateway gave it at arrival (from what it knew then, never the output length)."""
    gateway_id: str
    attempt: int = 0
    """0 on first dispatch; +1 each time it is re-dispatched after its replica went silent."""
    dispatch_no: int | None = None
    """How many times its gateway dispatched it before (0: the first dispatch), whatever the reason, unlike
    `attempt`; a client's retry forwarded to the replica it is on carries the same number. A replica that fenced
    itself and handed the request back drops a later dispatch numbered no higher than the one it handed back: a
    copy sent before the gateway heard of the hand-back, which the gateway's own dispatch after it answers.
    None: from a gateway that does not number its dispatches (nothing is dropped for it)."""
    sim_output_tokens: int | None = None
    """The simulated model's answer length (`SubmitRequest.sim_output_tokens`); the `sim` backend generates
    that many tokens, capped at max_tokens (max_tokens when None)."""
    stream: bool = False
    """`SubmitRequest.stream`: send `ReplyChunk`s before the final `Reply`."""
    detokenize: bool = True
    """Answer with text (vLLM's `SamplingParams.detokenize`). False for a request whose prompt was a token
    count (`SubmitRequest.input_tokens`): it gets token counts and an empty `text`. A trace replay sends
    counts, and making text it never reads cost the sped-up demo 2.7 s of P99 (28.9 s against 26.2 s)."""
    temperature: Temperature | None = None
    """The sampling fields of the `SubmitRequest`, forwarded as given (see there)."""
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopSequences = []
    prompt: Annotated[str, Meta(max_length=MAX_MESSAGE_BYTES)] | None = None
    """The prompt's text (`SubmitRequest.prompt`), for an engine with a real model; None: the prompt was a
    token count (`input_tokens`), and a real engine makes that many deterministic token ids."""
    fingerprint: str = ""
    """What the request asks (`fingerprint`): the engine's stored answer is resent only for the same ask,
    so a client reusing a request id for another prompt is served anew, never given the old answer."""
    deadline_unix_s: float | None = None
    """Unix time (wall seconds) after which nobody waits for the answer (the gateway's arrival time plus the
    request's timeout): an engine refuses or aborts the request past it with `deadline_exceeded`."""
    resume: Resume | None = None
    """Set when the request migrated from a retiring replica in a switch (`Completed.migrated`): continue
    from what it generated there."""
    move_after_tokens: PosTokens | None = None
    """Once its answer has this many tokens it has outgrown the class it was routed as into one this replica
    does not serve (`oserve.correction.move_after_tokens`): the engine then asks its gateway whether to move it
    (`MoveAsk`), and hands it back (`Completed.migrated`, as in a switch) only when told to (`MoveAnswer.go`),
    for the gateway to continue it on a replica that serves that class and has room. None: it finishes here."""
    recovered: bool = False
    """Sent again by a gateway restarted after a crash, which took the request back from its journal: an engine
    that answered it already releases it without answering again (the answer went out in the same write as its
    `Completed`); one that serves it goes on; one that never had it serves it. Also set on a client's
    unaccepted copy (`COPY_HEADER`), which a gateway forwards or dispatches: the client's connection did not
    drop since it sent the request, so an answer sent to it reached it. Only the engine that answered knows:
    a copy another gateway dispatches to another replica is served there anew."""


class Reply(_Msg, frozen=True, kw_only=True, tag="reply.v1"):
    """The answer to a `SubmitRequest`."""

    request_id: str
    replica_id: str
    input_tokens: int
    output_tokens: int
    type_index: int
    ttft_s: float
    """Time to first token on the engine's clock (seconds from its arrival at the engine)."""
    e2e_s: float
    text: str = ""


class ReplyChunk(_Msg, frozen=True, kw_only=True, tag="reply_chunk.v1"):
    """Part of a streamed answer (`SubmitRequest.stream`), sent to the reply inbox before the final `Reply`.

    Chunks are progress, the `Reply` is the answer: it alone ends the stream and carries the whole text.
    `offset_tokens` lets a reader keep the chunks that extend what it has; a re-dispatched request
    (its replica died) streams again from offset 0, and a client's retry on a new inbox gets the final
    `Reply` only."""

    request_id: str
    replica_id: str
    index: int
    """0, 1, ... per serving of the request."""
    offset_tokens: Tokens
    """Tokens of the answer before this chunk."""
    num_tokens: Tokens
    """Tokens this chunk adds."""
    text: str = ""
    offset_chars: Annotated[int, Meta(ge=0)] | None = None
    """Characters of the answer's text before this chunk (None: a producer older than this field). With it a
    reader can take the new part of a chunk that overlaps what it has (a re-dispatched request's chunks
    rarely start where the first replica's stopped)."""


class CancelRequest(_Msg, frozen=True, kw_only=True, tag="cancel.v1"):
    """A client abandons a request (its stream was closed, it timed out): stop generating and forget it.

    Clients publish it on `Subjects.cancel()`; the gateway that owns the request checks that `inbox` has the
    prefix the request was accepted under (`dedupe_key`: only the client that sent a request can name its
    inbox, which holds a random token), forgets the request and sends an `AbortRequest` to the replica
    serving it, on that replica's dispatch subject (so it comes after the dispatch it aborts). The engine frees the
    request, sends no more chunks and answers the inbox, in case anyone still listens, with an
    `ErrorReply` code `cancelled`. A cancel for a request the gateway does not hold (answered already, or
    another client's) is ignored. A cancelled request's id is not spent: sent again, it is a new request."""

    request_id: Id
    inbox: Annotated[str, Meta(min_length=1, max_length=256)]
    """The reply inbox the request was sent with (or any inbox of the same client: only its prefix counts)."""
    reason: Annotated[str, Meta(max_length=64)] = ""
    """Why, for logs and spans: `client_closed` (the stream was closed before its reply), `timeout`."""


class AbortRequest(_Msg, frozen=True, kw_only=True, tag="abort.v1"):
    """The gateway tells the replica serving a request that its client cancelled it (`CancelRequest`).

    Sent on the replica's dispatch subject, so the engine reads it after the `Dispatch` it aborts. The
    engine finds the request by `dedupe_key(inbox, request_id)`, removes it from its backend (freeing its
    KV), sends no more chunks, lists it in `Completed.released` and counts it as finished by `abort`."""

    request_id: Id
    inbox: Annotated[str, Meta(min_length=1, max_length=256)]
    """The reply inbox the request was dispatched with."""
    gateway_id: str
    reason: Annotated[str, Meta(max_length=64)] = ""
    """The client's `CancelRequest.reason`."""
    answered: bool = False
    """The gateway answered the client itself (`deadline_exceeded`): the engine drops the request silently."""


class MoveAsk(_Msg, frozen=True, kw_only=True, tag="move_ask.v1"):
    """An engine asks the gateway that dispatched a request whether to hand it back: its answer passed
    `Dispatch.move_after_tokens`, so it outgrew the class it was routed as.

    Sent on the gateway's own subject (`Subjects.gateway_moves`). The gateway answers with a `MoveAnswer` on
    the replica's dispatch subject: `go` when a replica that serves the class the request grew into has room in
    its KV cache for its context (it reserves that room), else stay, and the engine asks again a clock second
    later while the request runs. A request moved to a full replica would queue there behind that replica's own
    (the simulator's mover waits for room too: `oserve.correction.OutgrownMover`)."""

    request_id: Id
    inbox: Annotated[str, Meta(min_length=1, max_length=256)]
    """The reply inbox the request was dispatched with (with `request_id`, which request)."""
    replica_id: str
    """The replica asking (the answer goes to its dispatch subject)."""
    generated_tokens: PosTokens
    """Tokens of the answer so far (with the input, its class so far and its context)."""


class MoveAnswer(_Msg, frozen=True, kw_only=True, tag="move_answer.v1"):
    """A gateway's answer to a `MoveAsk`, on the asking replica's dispatch subject (only gateways publish there).
    `go`: hand the request back now; the gateway continues it on `target`, whose room it reserved (on another
    replica should `target` have stopped accepting meanwhile). Not `go`: keep serving it, and ask again later."""

    request_id: Id
    inbox: Annotated[str, Meta(min_length=1, max_length=256)]
    go: bool
    target: str = ""
    """The replica it will be continued on (empty unless `go`)."""


class ErrorReply(_Msg, frozen=True, kw_only=True, tag="error.v1"):
    """A structured refusal: `code` is stable (see `ErrorCode`), `message` is for humans."""

    request_id: str = ""
    code: str
    message: str


class ErrorCode:
    BAD_JSON = "bad_json"
    BAD_VERSION = "bad_version"
    BAD_SCHEMA = "bad_schema"
    TOO_LARGE = "too_large"
    INVALID = "invalid"
    NO_REPLICA = "no_replica"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"
    SHUTTING_DOWN = "shutting_down"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The request's deadline (`SubmitRequest.timeout_s`, else the gateway's `max_request_wall_s`) passed
    before it was answered: whoever held it (gateway or engine) stopped and answered this instead."""


# --- events (JetStream) -----------------------------------------------------------------------------


class Arrival(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    at_s: float  # on the gateway's clock
    input_tokens: int
    est_output_tokens: int
    type_index: int
    replica_id: str


class Arrived(_Msg, frozen=True, kw_only=True, tag="arrived.v1"):
    """Requests the gateway accepted since its last event (ids and deltas, not state)."""

    gateway_id: str
    items: list[Arrival]
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class Owned(_Msg, frozen=True, kw_only=True, tag="owned.v1"):
    """A gateway's journal (`Subjects.ownership`, kept by the ownership stream): it owns this request, held or
    dispatched to `replica_id`. Published before the request's `Accepted`, on the same connection, so a request
    a client was told is accepted is in the journal; published again when the request moves (re-dispatched,
    migrated). A gateway restarted under the same id takes back what its journal says it owned and no
    `Settled` or completion ended (`Gateway._recover`)."""

    gateway_id: str
    dispatch: Dispatch
    reply: str
    """The client's inbox, where the answer goes."""
    replica_id: str = ""
    """Where it was dispatched; "" while held (no replica yet)."""
    headers: dict[str, str] = {}
    """Its trace context."""


class Settled(_Msg, frozen=True, kw_only=True, tag="settled.v1"):
    """Requests a gateway no longer owns (answered, refused, cancelled, expired, or completed by an engine),
    batched: what its journal's `Owned` said is over."""

    gateway_id: str
    request_ids: list[str]


class Completion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    request_id: str
    replica_id: str
    input_tokens: int
    output_tokens: int
    type_index: int
    ttft_s: float
    e2e_s: float
    finished_at_s: float  # on the engine's clock
    owner: str = ""
    """`owner_of(Dispatch.gateway_id, reply inbox)`: only that gateway, holding that client's request under this
    id, forgets it on this completion ("" from an older engine: matched by id alone)."""


class Migration(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One request handed over mid-answer by a retiring replica (`Completed.migrated`)."""

    request_id: str
    resume: Resume
    owner: str = ""
    """As `Completion.owner`: only the gateway and client named here continue it elsewhere."""


class Completed(_Msg, frozen=True, kw_only=True, tag="completed.v1"):
    """Requests one engine answered since its last event; true output lengths for the forecaster."""

    replica_id: str
    items: list[Completion]
    released: list[str] = []
    """Request ids answered with an error (no numbers for the forecaster); the gateway forgets them too."""
    requeue: list[str] = []
    """Request ids the engine dropped unanswered because it fenced itself (its loop stalled for longer
    than a gateway waits for a heartbeat, so they may be re-dispatched already): the gateway
    re-dispatches each one it still holds on this replica."""
    migrated: list[Migration] = []
    """Requests a retiring replica stopped mid-answer in a switch (`DrainReplica.migrate_after_s`), with what
    they generated: the gateway dispatches each one it still holds on this replica to a new replica, which
    continues it (`Dispatch.resume`). Unanswered here; answered once, there."""
    released_owners: list[str] = []
    """`Completion.owner` of each entry of `released`, in order (empty from an older engine: by id alone)."""
    requeue_owners: list[str] = []
    """`Completion.owner` of each entry of `requeue`, in order (empty from an older engine: by id alone)."""
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class Heartbeat(_Msg, frozen=True, kw_only=True, tag="heartbeat.v1"):
    """One replica is alive, and its load now (every `heartbeat_interval_wall_s` wall seconds)."""

    replica_id: TokenId
    at_s: float
    num_waiting: int
    num_running: int
    accepting: bool = True
    """False once draining: route nothing new here."""
    kv_load_frac: float = 0.0
    """KV blocks used plus demanded by the queue, over the replica's blocks: the load the router balances."""
    kv_capacity_tokens: int = 0
    """Tokens the replica's KV cache holds (0: unknown)."""
    busy_s: Seconds = 0.0
    """Seconds on the engine's clock, since the replica started, that it spent running steps (cumulative:
    a consumer differences two heartbeats); 0 from an engine that does not count them."""
    saturated_s: Seconds = 0.0
    """Of those, the seconds of steps that ended with requests still waiting (cumulative): the replica could
    not take all it was sent. The scheduler's learned capacity (`SelfCorrectingPlanner.observe`) reads it."""
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class Telemetry(_Msg, frozen=True, kw_only=True, tag="telemetry.v1"):
    """Per-source load and latency over the last window."""

    source_id: str
    at_s: float
    window_s: float
    num_requests: int
    num_errors: int = 0
    requests_per_s: float
    p50_e2e_s: float | None = None
    """None when nothing finished in the window (JSON has no NaN)."""
    p99_e2e_s: float | None = None
    num_waiting: int = 0
    num_running: int = 0
    kv_load_frac: float = 0.0
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class AssignmentSet(_Msg, frozen=True, kw_only=True, tag="assignment.v1"):
    """Which replicas may serve each class: `weights[j][replica_id]` is the requests/s of class j the plan
    gives that replica (a rate, not a share). The router sends a class-j request to the least loaded
    replica with a positive weight (`oserve.routing.least_loaded`); a class with no positive weight
    on a live replica goes to the least loaded replica of all. `shares[j][replica_id]` is the same plan as
    fractions of class j (summing to 1): the split the plan intends, which least-loaded routing keeps
    only approximately."""

    strategy_id: str
    weights: list[dict[str, float]]
    shares: list[dict[str, float]] = []
    """shares[j][replica_id]: the fraction of class j's requests the plan gives that replica, summing to 1
    over the replicas of each class (`weights[j]` normalised); `{}` for a class the plan gives no replica
    (no positive weight). Computed by the scheduler; empty from a producer older than this field."""


# --- control plane: forecast -> strategy -> switch ----------------------------------------------------


class ForecastMade(_Msg, frozen=True, kw_only=True, tag="forecast.v1"):
    """At a span boundary: the span's observed per-type arrivals and the next span's forecast."""

    span_index: int
    span_start_s: float
    span_s: float
    observed_counts: list[int]
    """Arrivals of the span that just ended, per type (as classified at arrival)."""
    forecast_rps: list[float]
    """Forecast per-type rates for the next span (requests/s on the clock)."""
    misclassified_frac: float = 0.0
    """Of the span's completions, the fraction whose true type differs from the one routed on."""
    forecaster: str = ""
    """Which forecaster produced `forecast_rps` (its kind, or `last_span` while it warms up)."""
    recent_rrmse: dict[str, float] = {}
    """Relative RMSE of each forecaster the stage runs over its recent spans (kind -> error; a kind not
    scored yet is absent): the evidence the forecaster in force was chosen on."""
    forecaster_note: str = ""
    """Why the LSTM is not in force, when it is not ('' when it is, or when the stage runs none)."""
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    tp: int
    pp: int
    gpu_ids: list[int]


class StrategyChosen(_Msg, frozen=True, kw_only=True, tag="strategy.v1"):
    """The scheduler's decision: a deployment and per-type routing weights over its replicas."""

    strategy_id: str
    span_index: int
    replicas: list[ReplicaSpec]
    weights: list[dict[str, float]]
    """weights[j][replica_id]: requests/s of class j the plan gives that replica (see `AssignmentSet`): a
    rate on the clock, not a share; `shares` holds the fractions."""
    switch_s: float
    """Clock seconds until the replicas new in this deployment can serve (modelled weight transfer)."""
    forecast_rps: list[float]
    label: str = ""
    scored_rps: list[float] = []
    """The rates the deployment was last scored at (the planner rescores when the forecast leaves them)."""
    deferred_spans: int = 0
    """Spans a better deployment's switch has been put off for its cost (`Decision.deferred_spans`)."""
    decide_wall_s: float = 0.0
    """Wall seconds the planner took for this decision."""
    budget_wall_s: float = 0.0
    """The decision budget it was given (wall seconds: a tenth of the span on the clock); 0 when none."""
    shares: list[dict[str, float]] = []
    """shares[j][replica_id]: the fraction of class j's requests the plan gives that replica, summing to 1
    over the replicas of each class (`weights[j]` normalised); `{}` for a class the plan gives no replica
    (no positive weight). Computed by the scheduler; empty from a producer older than this field."""
    capacity_scales: list[list[float]] = []
    """The learned capacity the decision was planned with: rows `[tp, pp, class_index, scale, sd]`, scale the
    times longer than the performance model a replica of that shape takes per request of that class (1: the
    model is right; `oserve.planner.learned`), sd its posterior sd; a row for every pair of a shape with
    evidence and every pair whose scale moved. Empty when the planner does not learn (or has learned nothing)."""
    guard_events: int = 0
    """Times so far the planner's guard returned to a deployment measured to serve better than the one in force."""
    underserved: bool = False
    """The deployment in force underserved in the span that just closed (a replica saturated below its planned
    load, or the queues grew): the guard's input."""
    clock_epoch_unix_s: float = 0.0
    """Unix time (wall seconds) at which the producer's clock read 0: wall = epoch + at_s / clock_speedup."""
    clock_speedup: float = 1.0
    """How many clock seconds pass per wall second on the producer's clock."""


class WeightSession(msgspec.Struct, frozen=True, kw_only=True):
    """A live switch's weight transfer as one replica takes part in it (`oserve.switch.transport`): where its
    processes meet (a `TCPStore` the switch planner serves) and which endpoint each of its ranks is; each
    rank fetches its own job (`oserve.switch.wire.EndpointJob`) there."""

    session_id: TokenId
    host: Annotated[str, Meta(min_length=1, max_length=253)]
    port: Annotated[int, Meta(ge=1, le=65535)]
    timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)]
    endpoints: Annotated[list[Annotated[str, Meta(max_length=2 * MAX_ID_CHARS)]], Meta(min_length=1, max_length=4096)]
    """`"<replica_id>/<rank>"` of each rank, by rank."""
    num_bytes: NumBytes = 0
    """Bytes these ranks receive (a new replica) or send (a source), as the plan sizes them."""


class StartReplica(_Msg, frozen=True, kw_only=True, tag="start_replica.v1"):
    """Command to an engine host: bring up a replica, serving after `ready_after_s` clock seconds."""

    strategy_id: str
    replica: ReplicaSpec
    ready_after_s: float
    weights: WeightSession | None = None
    """None: the replica loads its weights itself (from the model's files, or modelled: `ready_after_s`).
    Set: it starts without weights and receives its shards from the replicas that hold them (`SendWeights`
    goes to their hosts), and serves only once every byte is verified; else it reports `ReplicaFailed`."""
    command_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    """Set by a switch planner that wants the command acknowledged (`CommandAck` to the message's reply
    subject): it sends the command again, with the same id, until it is; a host runs each id once."""


class DrainReplica(_Msg, frozen=True, kw_only=True, tag="drain_replica.v1"):
    """Command to an engine host: finish a replica's requests, then release it."""

    strategy_id: str
    replica_id: str
    migrate_after_s: Annotated[float, Meta(ge=0.0)] | None = None
    """Wall seconds the replica finishes requests in place; what still runs then is handed over to the new
    replicas with what it generated (`Completed.migrated`). None: every request finishes in place."""
    command_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    """Set by a switch planner that wants the command acknowledged (`CommandAck` to the message's reply
    subject): it sends the command again, with the same id, until it is; a host runs each id once."""


class SendWeights(_Msg, frozen=True, kw_only=True, tag="send_weights.v1"):
    """Command to an engine host: a replica it serves sends weight shards to new replicas in a live switch,
    while it goes on serving (see `StartReplica.weights`); the host reports `WeightsSent`."""

    strategy_id: str
    replica_id: str
    weights: WeightSession
    command_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    """Set by a switch planner that wants the command acknowledged (`CommandAck` to the message's reply
    subject): it sends the command again, with the same id, until it is; a host runs each id once."""


class CommandAck(_Msg, frozen=True, kw_only=True, tag="command_ack.v1"):
    """An engine host has a command (`StartReplica`, `DrainReplica`, `SendWeights` with a `command_id`): sent to
    the command's reply subject (`Subjects.control_ack`) once it is queued to run. A command it already had
    (the planner sent it again: this acknowledgement was lost or late) is acknowledged again, `duplicate`, and
    not run twice."""

    host_id: str
    command_id: str
    duplicate: bool = False


class WeightsReceived(_Msg, frozen=True, kw_only=True, tag="weights_received.v1"):
    """A new replica's ranks received their shards in a live switch (verified: each op's bytes, where they
    landed, matched the sender's checksum) and put them in force, or failed (`error`)."""

    strategy_id: str
    replica_id: str
    verified: bool
    num_bytes: NumBytes = 0
    engine_start_wall_s: Seconds = 0.0
    """Starting the engine with dummy weights (process, memory profiling, KV cache)."""
    transfer_wall_s: Seconds = 0.0
    """Its slowest rank's transfer: first op to last, making the pair groups included."""
    install_wall_s: Seconds = 0.0
    """Putting the received weights in force (the layers' post-load processing)."""
    error: str = ""


class WeightsSent(_Msg, frozen=True, kw_only=True, tag="weights_sent.v1"):
    """A serving replica finished sending its part of a live switch (or failed: `error`)."""

    strategy_id: str
    replica_id: str
    verified: bool
    num_bytes: NumBytes = 0
    wall_s: Seconds = 0.0
    """From the command to its last op (waiting for the new replicas' engines to start included)."""
    error: str = ""


class ReplicaFailed(_Msg, frozen=True, kw_only=True, tag="replica_failed.v1"):
    """A replica could not be started (its engine did not come up, or its weights did not all arrive
    verified); nothing of it serves, and the switch that asked for it rolls back at once."""

    strategy_id: str
    replica_id: str
    reason: str


class ReplicaReady(_Msg, frozen=True, kw_only=True, tag="replica_ready.v1"):
    strategy_id: str
    replica_id: str


class ReplicaDrained(_Msg, frozen=True, kw_only=True, tag="replica_drained.v1"):
    strategy_id: str
    replica_id: str


class SwitchPlanned(_Msg, frozen=True, kw_only=True, tag="switch_planned.v1"):
    strategy_id: str
    start_ids: list[str]
    retire_ids: list[str]
    switch_s: float
    num_transfers: int = 0
    """GPU-to-GPU copies of the switch planner's transfer plan for the new replicas' weight shards."""
    transfer_bytes: int = 0
    """Bytes those copies move."""
    modelled_transfer_s: float = 0.0
    """The plan's modelled transfer time (seconds), before engine start."""


class SwitchCompleted(_Msg, frozen=True, kw_only=True, tag="switch_completed.v1"):
    strategy_id: str
    switch_wall_s: float
    moved_bytes: NumBytes = 0
    """Weight bytes the new replicas received from the serving ones (0: none moved; they loaded or were
    modelled)."""
    engine_start_wall_s: Seconds = 0.0
    """The slowest new replica's engine start (live switches)."""
    transfer_wall_s: Seconds = 0.0
    """The slowest new replica's weight transfer (live switches)."""
    install_wall_s: Seconds = 0.0


class SwitchRolledBack(_Msg, frozen=True, kw_only=True, tag="switch_rolled_back.v1"):
    strategy_id: str
    reason: str


class ReplicaRestarted(_Msg, frozen=True, kw_only=True, tag="replica_restarted.v1"):
    """A replica of the deployment in force fell silent (its engine host restarted empty, or lost it) and
    the switch planner started it again on its host; not a switch: the deployment is the same."""

    strategy_id: str
    replica_id: str
    silent_wall_s: float
    """How long it had sent no heartbeat (wall seconds)."""


HostCommand = StartReplica | DrainReplica | SendWeights
SwitchEvent = SwitchPlanned | SwitchCompleted | SwitchRolledBack | ReplicaRestarted
ReplicaEvent = ReplicaReady | ReplicaDrained | ReplicaFailed | WeightsReceived | WeightsSent


class SchemaError(Exception):
    """A message failed validation at the edge; `code` is an `ErrorCode` value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


_submit_decoder = msgspec.json.Decoder(SubmitRequest | Ping)
_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """JSON bytes of a message, with its version tag. Pure."""
    return _encoder.encode(msg)


def _edge_error(exc: msgspec.DecodeError) -> SchemaError:
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        if "`$.type`" in text or "Object missing required field `type`" in text:
            return SchemaError(ErrorCode.BAD_VERSION, text)
        if any(op in text for op in (">=", "<=", "` >", "` <", "length")):
            return SchemaError(ErrorCode.INVALID, text)
        if "Expected `" in text or "missing required field" in text or "unknown field" in text:
            return SchemaError(ErrorCode.BAD_SCHEMA, text)
        return SchemaError(ErrorCode.INVALID, text)
    return SchemaError(ErrorCode.BAD_JSON, text)


def fingerprint(req: SubmitRequest) -> str:
    """A short digest of what a request asks: everything but its id, streaming and timeout (a client's retry
    by `submit` or `stream`, or with a new timeout, is the same ask). Pure."""
    ask = (req.prompt, req.input_tokens, req.max_tokens, req.output_hint_tokens, sorted(req.tags.items()),
           req.sim_output_tokens, req.temperature, req.top_p, req.seed, req.stop)
    return hashlib.blake2b(msgspec.json.encode(ask), digest_size=8).hexdigest()


def _too_deep() -> SchemaError:
    """msgspec decodes nested JSON recursively: JSON nested past the interpreter's recursion limit (about a
    thousand levels, which no message of the bus has) is refused as malformed, not an internal error."""
    return SchemaError(ErrorCode.BAD_JSON, "JSON nested too deeply")


class _IdOnly(msgspec.Struct):
    request_id: Id


_id_decoder = msgspec.json.Decoder(_IdOnly)


def request_id_of(data: bytes) -> str:
    """The `request_id` of a message that failed to decode, when a top-level one can be read; "" otherwise.
    Pure. An error reply then names the request it refuses (the client matches answers by inbox anyway)."""
    if len(data) > MAX_MESSAGE_BYTES:
        return ""
    try:
        return _id_decoder.decode(data).request_id
    except (msgspec.DecodeError, RecursionError):
        return ""


def decode_submit(data: bytes) -> SubmitRequest | Ping:
    """Decode and validate a client's message strictly. Pure; raises `SchemaError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(ErrorCode.TOO_LARGE, f"message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    try:
        msg = _submit_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise _edge_error(exc) from None
    except RecursionError:
        raise _too_deep() from None
    if isinstance(msg, SubmitRequest):
        if (msg.prompt is None) == (msg.input_tokens is None):
            raise SchemaError(ErrorCode.INVALID, "give exactly one of `prompt` (text) and `input_tokens` (a count)")
        if msg.prompt is not None and msg.prompt_tokens() > MAX_TOKENS:
            raise SchemaError(ErrorCode.TOO_LARGE, "prompt too long")
    return msg


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(data: bytes, kind: type[msgspec.Struct] | object) -> msgspec.Struct:
    """Decode an internal message of type (or union) `kind` strictly. Pure; raises `SchemaError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(ErrorCode.TOO_LARGE, f"message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    dec = _decoders.get(kind)  # type: ignore[arg-type]
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)  # type: ignore[index]
    try:
        return dec.decode(data)
    except msgspec.DecodeError as exc:
        raise _edge_error(exc) from None
    except RecursionError:
        raise _too_deep() from None


def decode_reply(data: bytes) -> Reply | ErrorReply | Pong | ReplyChunk | Accepted:
    """Decode what comes back to a client. Pure; raises `SchemaError`."""
    return decode(data, Reply | ErrorReply | Pong | ReplyChunk | Accepted)  # type: ignore[return-value]


ACCEPTED_PREFIX = b'{"type":"accepted.v1"'
"""How an encoded `Accepted` starts (msgspec writes the tag first): a client tells it from an answer
without decoding."""

COPY_HEADER = "OServe-Copy"
"""A NATS header on a `SubmitRequest` a client publishes again. `UNACCEPTED_COPY`: no gateway confirmed the
request within `ReconnectPolicy.accept_timeout_s`, and the connection the request last went out on is still
up, so whatever was sent to its inbox reached it or is on its way. A gateway that let the request go (on its
current connection) drops such a copy; one that holds it forwards it to its replica as `Dispatch.recovered`,
so an engine that answered it already does not answer again: a copy that crossed its answer is not answered
twice. The first copy after a reconnect carries no mark (its answer may have been lost with the connection).
Across gateways nothing is promised: another gateway of the queue group serves a copy it never held anew."""
UNACCEPTED_COPY = "unaccepted"
