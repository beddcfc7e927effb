"""The OServe client: submit a request over NATS and await its reply.

```python
async with await OServeClient.connect("nats://127.0.0.1:4222") as client:
    reply = await client.submit(prompt="Hello", max_tokens=64, timeout_s=30)
```

Streaming (`SubmitRequest.stream`): `stream()` yields the answer's `ReplyChunk`s as the engine produces
them, then the final `Reply`; the chunks' texts concatenate to the reply's text:

```python
async for part in client.stream(prompt="Hello", max_tokens=64, timeout_s=30):
    print(part.text, end="")  # ReplyChunks, then the Reply (its text is the whole answer)
```

Errors are typed, and each has a stable `code`: `RequestRejected` (the system answered with a structured
error: its `code`, `message`), `RequestTimeout` (`timeout`: no answer within the timeout), `NoGateway`
(`no_gateway`: nobody listens on the submit subject), `ConnectionLost` (`connection_lost`: the connection
to NATS is closed, or was down when the wait ended), `CannotConnect` (`cannot_connect`), `BadReply`
(`bad_reply`). No nats exception leaves `submit`, `stream` or `ping`.

Outages: a connection made by `connect()` reconnects with jittered exponential backoff for as long as
`ReconnectPolicy.give_up_after_s` allows (default: forever; each request still has its timeout).
Publishes made while it is down wait in nats-py's pending buffer (`ReconnectPolicy.pending_bytes`) and go
out on reconnect; a request that went out on the lost connection is published again, as a retry the
system de-duplicates (`dedupe_key`), so an answer lost in the outage is sent again. Extra answers to an
inbox after its first are counted (`num_duplicates`), as are answers after the client gave up
(`num_late`).
It is part of the bus contract (`oserve.streams`), outside the pure core: it imports nats. It is also the
light client (`pip install oserve`, nats-py and msgspec alone): OpenTelemetry is imported only when a
`tracer` is given, and nothing here imports the system (numpy, torch, the workers).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import random
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Mapping, Sequence

import msgspec
import nats
import nats.errors
import nats.js.api
from nats.aio.client import Client as NATS

from oserve.errors import ConfigError, OServeError
from oserve.streams.schemas import (ACCEPTED_PREFIX, COPY_HEADER, MAX_TIMEOUT_S, UNACCEPTED_COPY, Accepted,
                                    CancelRequest, ErrorReply, Ping, Pong, Reply, ReplyChunk, SchemaError,
                                    SubmitRequest, decode, decode_reply, encode)
from oserve.streams.server import reconnects, redact_url
from oserve.streams.subjects import Subjects

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)
_NO_RESPONDERS = "503"  # the status NATS answers a request with when nobody subscribes to its subject


_DONE_CAPACITY = 100_000  # finished inboxes remembered, to tell a duplicate or late answer from noise


class ClientError(OServeError):
    """Base of the client's errors; `code` names the failure (stable: reports count failures by it)."""

    code: str = "client_error"


class RequestRejected(ClientError):
    """The system answered with a structured error (`code`: the system's `ErrorCode`)."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id or '?'} rejected: {code}: {message}")
        self.request_id, self.code, self.message = request_id, code, message


class RequestTimeout(ClientError):
    """No reply within the timeout, while connected to NATS."""

    code = "timeout"


class NoGateway(ClientError):
    """No gateway is subscribed to the submit subject."""

    code = "no_gateway"


class ConnectionLost(ClientError):
    """The connection to NATS is closed (given up, or closed by its owner), could not take the request (its
    reconnect buffer is full), or was down when the request's wait ended: the answer may never come."""

    code = "connection_lost"


class CannotConnect(ClientError):
    """No connection to NATS could be made (`OServeClient.connect`)."""

    code = "cannot_connect"


class BadReply(ClientError):
    """An answer that cannot be read, or one of the wrong kind (a streamed answer to `submit`)."""

    code = "bad_reply"


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """How a client rides out a NATS outage."""

    give_up_after_s: float | None = None
    """Seconds disconnected after which the client gives up: the connection is closed (when the client owns
    it) and every waiting request fails with `ConnectionLost`. None: reconnect forever (each request still
    ends at its timeout)."""
    backoff_initial_s: float = 0.05
    """Wait before the first reconnect attempt; it doubles with each failed attempt ..."""
    backoff_max_s: float = 2.0
    """... up to this; each wait is drawn between half of it and all of it (jitter)."""
    pending_bytes: int = 32 * 1024 * 1024
    """Bytes of publishes buffered while disconnected (nats-py's pending buffer); a request that does not
    fit fails at once with `ConnectionLost`."""
    resend_on_reconnect: bool = True
    """After a reconnect, publish again every waiting request that went out on the lost connection (it, or
    its answer, may be lost); the system answers the retry once (`dedupe_key`)."""
    resend_delay_s: float = 1.0
    """How long after a reconnect the waiting requests are published again: answers that engines buffered
    while they were cut off come when the engines reconnect, and a request answered meanwhile is not
    resent (its resend would be answered again, from the engine's cache: a second answer on the wire)."""
    no_gateway_retry_s: float = 10.0
    """For this long after a reconnect, a request no gateway takes (NATS answers "no responders": the
    workers have not reconnected yet) is published again, every `no_gateway_retry_interval_s`, within its
    timeout; after it, or with no reconnect, it fails at once with `NoGateway`. 0: never retried."""
    no_gateway_grace_s: float = 5.0
    """A request no gateway takes is also published again, every `no_gateway_retry_interval_s`, for this
    long after its first "no responders" (within its timeout), reconnect or not: a gateway restarting (a
    crash, a rolling update) is back in seconds, and a request nobody took is safe to send again. 0: only
    after a reconnect."""
    no_gateway_retry_interval_s: float = 0.25
    accept_timeout_s: float = 2.0
    """A request (`submit`, `stream`) asks the gateway to confirm it owns it (`SubmitRequest.ack`); with
    neither the confirmation nor an answer within this long it is published again (same id, same inbox:
    the gateway takes a retry of what it holds as the same request), the wait doubling each time, within
    its timeout. It covers a gateway that crashed after reading the request and before owning it. 0:
    never published again for this."""
    poll_interval_s: float = 0.1
    """How often, while requests wait, the client looks at its connection (reconnected, given up, closed)."""

    def __post_init__(self) -> None:
        if self.give_up_after_s is not None and not self.give_up_after_s > 0:
            raise ConfigError(f"ReconnectPolicy.give_up_after_s must be > 0 or None, got {self.give_up_after_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError(f"ReconnectPolicy: need 0 < backoff_initial_s <= backoff_max_s, got "
                              f"{self.backoff_initial_s}, {self.backoff_max_s}")
        if self.pending_bytes < 1 or not self.poll_interval_s > 0 or not self.no_gateway_retry_interval_s > 0:
            raise ConfigError(f"ReconnectPolicy: pending_bytes must be >= 1, poll_interval_s and "
                              f"no_gateway_retry_interval_s > 0, got {self.pending_bytes}, {self.poll_interval_s}, "
                              f"{self.no_gateway_retry_interval_s}")
        if self.resend_delay_s < 0:
            raise ConfigError(f"ReconnectPolicy.resend_delay_s must be >= 0, got {self.resend_delay_s}")
        if self.accept_timeout_s < 0:
            raise ConfigError(f"ReconnectPolicy.accept_timeout_s must be >= 0, got {self.accept_timeout_s}")
        if self.no_gateway_grace_s < 0:
            raise ConfigError(f"ReconnectPolicy.no_gateway_grace_s must be >= 0, got {self.no_gateway_grace_s}")
        if self.no_gateway_retry_s < 0:
            raise ConfigError(f"ReconnectPolicy.no_gateway_retry_s must be >= 0, got {self.no_gateway_retry_s}")

    def backoff_s(self, failed_attempts: int, rng: random.Random) -> float:
        """The wait before the next reconnect attempt after `failed_attempts` failed ones. Pure but for `rng`."""
        full = min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** min(failed_attempts, 30))
        return full * (0.5 + 0.5 * rng.random())


class _Wait:
    """One request waiting for its answer: the queue its messages arrive in, and what to publish again
    after a reconnect (`gen`: the connection it last went out on; `sent_connected`: it went onto the wire
    rather than into the reconnect buffer)."""

    __slots__ = ("queue", "payload", "headers", "gen", "sent_connected", "no_gateway_since", "ack_due",
                 "ack_wait_s")

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.payload: bytes | None = None
        self.headers: dict | None = None
        self.gen = 0
        self.sent_connected = False
        self.no_gateway_since: float | None = None
        """Loop time of the first "no responders" to it (None: none yet)."""
        self.ack_due: float | None = None
        """Loop time by which a gateway's `Accepted` (or an answer) should have come; None: nothing awaited
        (not asked for, or come)."""
        self.ack_wait_s = 0.0


class _Lost:
    """Put in a waiting request's queue when the connection is given up or closed."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class OServeClient:
    """Async client over one NATS connection; `connect()` makes one, or pass your own `nc`.

    Every answer, streamed or not, comes to an inbox under one prefix per client (`nc.new_inbox()`, taken
    once), so a `submit` and a `stream` with the same request id are the same client's to the gateway and
    the engines (`dedupe_key`): a retry by either gets the one answer. A request abandoned before its
    answer (a stream closed early, a timeout, a cancelled task) is cancelled: the client publishes a
    `CancelRequest` naming its inbox, and the system stops generating it. Sent again with the same id, a
    cancelled request is served anew.

    While requests wait, the client watches its connection (`ReconnectPolicy`): after a reconnect it
    publishes again the requests that went out on the lost connection; past `give_up_after_s` disconnected,
    or once the connection is closed, the waiting requests fail with `ConnectionLost`. A connection passed
    in is reconnected (or not) as its owner configured it; the client never closes it."""

    def __init__(self, nc: NATS, subjects: Subjects = Subjects(), *, default_timeout_s: float = 60.0,
                 tracer: Tracer | None = None, owns_connection: bool = False,
                 reconnect: ReconnectPolicy = ReconnectPolicy(), user: str | None = None) -> None:
        if not default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        self.nc, self.subjects, self.tracer = nc, subjects, tracer
        # an authenticated user publishes on its own subjects, where the gateway answers only its own inbox
        # (`Subjects.user_submit`); without one, the shared subjects (a trusted identity, a server without auth)
        self.user = user
        if user and not nc.new_inbox().startswith(subjects.user_inbox_root(user) + "."):
            # the gateway would drop every request: answers on a user's subject go to that user's inbox only
            raise ConfigError(f"OServeClient(user={user!r}) needs a connection whose inbox prefix is "
                              f"{subjects.user_inbox_root(user)!r} (nats.connect(inbox_prefix=...); "
                              f"OServeClient.connect(user=...) makes one)")
        self.submit_subject = subjects.user_submit(user) if user else subjects.submit()
        self.cancel_subject = subjects.user_cancel(user) if user else subjects.cancel()
        self.default_timeout_s = default_timeout_s
        self.reconnect = reconnect
        self._owns = owns_connection
        self._inbox_prefix = ""  # one inbox prefix for all this client's answers (`dedupe_key` matches its retries)
        self._inbox_seq = itertools.count()
        # One subscription to `<prefix>.*` carries every answer (nats.py's request() does the same): a
        # subscription per request would cost a SUB and an UNSUB on the wire for each.
        self._answers: dict[str, _Wait] = {}  # inbox -> its waiting request, until it closes
        self._done: collections.OrderedDict[str, bool] = collections.OrderedDict()  # inbox -> an answer came
        self._mux = None
        self._mux_lock = asyncio.Lock()
        self._watcher: asyncio.Task | None = None
        self._down_since: float | None = None  # loop time the connection was first seen down
        self._seen_gen = 0  # the connection (`_generation`) the watcher last saw, and when it first saw it
        self._reconnected_at = -float("inf")
        self.num_duplicates = 0
        """Answers that came to an inbox after its first answer (a request answered twice)."""
        self.num_late_statuses = 0
        """NATS "no responders" statuses that came to an inbox after its answer (a resend that reached no
        gateway): not answers, so not duplicates."""
        self.num_late = 0
        """First answers that came after the client stopped waiting (timed out, cancelled, connection lost)."""
        self.num_resent = 0
        """Requests published again after a reconnect."""
        self.num_unaccepted_resent = 0
        """Requests published again because no gateway confirmed owning them in time."""

    @classmethod
    async def connect(cls, url: str, *, subjects: Subjects = Subjects(), user: str | None = None,
                      password: str | None = None, default_timeout_s: float = 60.0,
                      tracer: Tracer | None = None, connect_timeout_s: float = 5.0,
                      reconnect: ReconnectPolicy = ReconnectPolicy(), name: str | None = None) -> OServeClient:
        """Connect to NATS; replies arrive under `<reply_prefix>.<user>` (the user given, else the URL's, else
        `anon`), which permissions can restrict. With a user, requests and cancels go to that user's own
        subjects (`Subjects.user_submit`), where a gateway answers only that inbox. Waits up to `connect_timeout_s` for the first connection
        (raises `CannotConnect`, whose message carries no password); once connected, it reconnects as
        `reconnect` says."""
        if user is None:
            from urllib.parse import urlsplit

            user = urlsplit(url).username or None
        shown = redact_url(url)
        errors: list[BaseException] = []  # what the last connect attempts failed with
        rng = random.Random()

        refused = asyncio.Event()  # the server refused the credentials: no point in trying until the timeout
        denied: list[BaseException] = []  # the refusal itself: the reset of the connection that follows it is not why

        async def on_error(exc: Exception) -> None:
            errors[:] = [exc]
            # nats-py reports the server's -ERR as a plain nats.errors.Error carrying its text
            if not nc.is_connected and (isinstance(exc, nats.errors.AuthorizationError)
                                        or "authorization violation" in str(exc).lower()):
                denied[:] = [exc]
                refused.set()
            log.debug("client: NATS error: %s", exc)

        async def on_disconnected() -> None:
            if not nc.is_closed:  # nats-py calls this on close too
                log.warning("client: disconnected from NATS at %s; reconnecting", shown)

        made: list[OServeClient] = []  # the client, once made: told when a reconnect happens

        async def on_reconnected() -> None:
            log.warning("client: reconnected to NATS at %s", shown)
            for client in made:
                client._seen_gen, client._reconnected_at = client._generation(), asyncio.get_running_loop().time()

        def next_server(servers, _info):  # nats-py asks before each reconnect attempt: which server, how long to wait
            failed = min((s.reconnects for s in servers), default=0)
            return None, reconnect.backoff_s(failed, rng)

        nc = NATS()
        try:
            # nats-py retries a first connect forever when reconnects are unlimited: bound it here, and end it
            # at once when the server refuses the credentials
            connecting = asyncio.ensure_future(
                nc.connect(url, user=user, password=password, connect_timeout=connect_timeout_s, name=name,
                           inbox_prefix=f"{subjects.reply_prefix()}.{user or 'anon'}",
                           max_reconnect_attempts=-1, reconnect_to_server_handler=next_server,
                           pending_size=reconnect.pending_bytes, error_cb=on_error,
                           disconnected_cb=on_disconnected, reconnected_cb=on_reconnected))
            was_refused = asyncio.ensure_future(refused.wait())
            try:
                done, _ = await asyncio.wait({connecting, was_refused}, timeout=connect_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                was_refused.cancel()
            if connecting not in done:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                raise TimeoutError
            connecting.result()
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            await _abandon(nc)
            why = denied[0] if denied else errors[-1] if errors else exc
            raise CannotConnect(f"cannot connect to NATS at {shown}: {str(why) or type(why).__name__}") from None
        made.append(cls(nc, subjects, default_timeout_s=default_timeout_s, tracer=tracer, owns_connection=True,
                        reconnect=reconnect, user=user))
        return made[0]

    async def submit(self, *, prompt: str | None = None, input_tokens: int | None = None,
                     max_tokens: int | None = None, output_hint_tokens: int | None = None,
                     tags: Mapping[str, str] | None = None, request_id: str | None = None,
                     timeout_s: float | None = None, sim_output_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     stop: Sequence[str] = ()) -> Reply:
        """Submit one request and await its reply; raises a `ClientError` (`RequestRejected`, `RequestTimeout`,
        `NoGateway`, `ConnectionLost`, ...), never a nats exception.

        `sim_output_tokens` is for simulated engines only (`SubmitRequest.sim_output_tokens`); the sampling
        fields are forwarded to the engine (see `SubmitRequest.temperature`)."""
        timeout = self._timeout(timeout_s)
        req = _request(prompt, input_tokens, max_tokens, output_hint_tokens, tags, request_id, sim_output_tokens,
                       temperature, top_p, seed, stop, stream=False, timeout_s=timeout)
        return await self._submit(encode(req), req.request_id, timeout, cancel=True,  # type: ignore[return-value]
                                  ack=True)

    def stream(self, *, prompt: str | None = None, input_tokens: int | None = None,
               max_tokens: int | None = None, output_hint_tokens: int | None = None,
               tags: Mapping[str, str] | None = None, request_id: str | None = None,
               timeout_s: float | None = None, sim_output_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] = ()) -> AsyncIterator[ReplyChunk | Reply]:
        """Submit one request with streaming: an iterator of its `ReplyChunk`s, then its final `Reply` (see
        `stream_raw`); the same arguments and errors as `submit`."""
        timeout = self._timeout(timeout_s)
        req = _request(prompt, input_tokens, max_tokens, output_hint_tokens, tags, request_id, sim_output_tokens,
                       temperature, top_p, seed, stop, stream=True, timeout_s=timeout)
        return self.stream_raw(encode(req), req.request_id, timeout, ack=True)

    def _timeout(self, timeout_s: float | None) -> float:
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        return timeout

    async def stream_raw(self, payload: bytes, request_id: str = "", timeout_s: float | None = None, *,
                         ack: bool = False) -> AsyncIterator[ReplyChunk | Reply]:
        """Send an encoded streaming `SubmitRequest` and yield what comes back: chunks, then the `Reply`.

        The answer arrives on an inbox of its own under the client's prefix (one subscription carries
        every inbox), forgotten when the iteration ends (close the iterator, e.g. with
        `contextlib.aclosing`, to end it early). `timeout_s` bounds the whole
        answer, as in `submit`. Only chunks that extend what was yielded are passed on (a re-dispatched
        request streams again from its start); when the `Reply`'s text goes beyond them, one more chunk
        (`index` -1) with the rest comes before it, so the chunks' texts concatenate to the reply's text
        whenever they are a prefix of it (a re-dispatched sampling engine could answer differently: the
        `Reply` is the answer). A chunk that overlaps what was yielded (a re-dispatched request's new replica
        cuts its chunks elsewhere) is passed on with the part already given sliced off (`offset_chars`).
        Closing the iterator before the `Reply`, or a timeout, cancels the request (`CancelRequest`).
        `ack`: the payload asks for `Accepted` (`SubmitRequest.ack`), and is published again while no
        gateway confirms it (`ReconnectPolicy.accept_timeout_s`).
        Raises `RequestRejected`, `RequestTimeout`, `NoGateway`, `ConnectionLost`, `ClientError`."""
        timeout = self._timeout(timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        span = self._publish_span("client.stream", request_id, payload)
        ended = False  # the system is done with the request (answered, refused, or nobody took it)
        reason = "client_closed"
        inbox = ""
        try:
            inbox, wait = await self._send(payload, span, ack=ack)
            tokens, text = 0, ""  # what was yielded so far
            while True:
                try:
                    msg = await self._next(wait, deadline, request_id, timeout)
                except (RequestTimeout, ConnectionLost):
                    reason = "timeout"
                    raise
                if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                    if await self._retry_no_gateway(inbox, wait, deadline):
                        continue
                    ended = True
                    raise NoGateway(f"no gateway listens on {self.submit_subject}")
                try:
                    answer = decode(msg.data, Reply | ErrorReply | ReplyChunk)
                except SchemaError as exc:
                    raise BadReply(f"request {request_id or '?'}: unreadable reply: {exc}") from None
                if isinstance(answer, ErrorReply):
                    ended = True
                    raise RequestRejected(answer.request_id or request_id, answer.code, answer.message)
                if isinstance(answer, ReplyChunk):
                    part = new_part(answer, tokens, text)
                    if part is not None:
                        tokens, text = tokens + part.num_tokens, text + part.text
                        yield part
                    continue
                assert isinstance(answer, Reply)
                ended = True
                if not answer.text.startswith(text):
                    log.warning("request %s: the streamed chunks are not a prefix of the final answer",
                                request_id or "?")
                elif len(answer.text) > len(text) or answer.output_tokens > tokens:
                    yield ReplyChunk(request_id=answer.request_id, replica_id=answer.replica_id, index=-1,
                                     offset_tokens=tokens, num_tokens=max(0, answer.output_tokens - tokens),
                                     text=answer.text[len(text):], offset_chars=len(text))
                yield answer
                return
        except ClientError as exc:
            _failed(span, exc)
            raise
        finally:
            # closed early, timed out or cancelled: tell the system to stop generating
            await self._close(request_id, inbox, span, reason if not ended else "", answered=ended)

    async def _next(self, wait: _Wait, deadline: float, request_id: str, timeout: float):
        """The next message answering `wait` before `deadline` (loop time); raises `RequestTimeout` when none
        comes while connected, `ConnectionLost` when the connection is given up or closed, or was down as the
        wait ended."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            left_s = deadline - now
            ack_left_s = wait.ack_due - now if wait.ack_due is not None else math.inf
            try:
                if left_s <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(wait.queue.get(), max(0.0, min(left_s, ack_left_s)))
            except TimeoutError:
                if loop.time() < deadline and wait.ack_due is not None:
                    await self._resend_unaccepted(wait, request_id)
                    continue
                if not self.nc.is_connected:
                    raise ConnectionLost(f"request {request_id or '?'}: no answer within {timeout} s; the "
                                         f"connection to NATS is down") from None
                raise RequestTimeout(f"request {request_id or '?'}: no reply within {timeout} s") from None
            if isinstance(item, _Lost):
                raise ConnectionLost(f"request {request_id or '?'}: {item.reason}")
            if item.headers and item.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                return item  # nobody took it: still to be confirmed when it is published again
            wait.ack_due = None  # owned (or answered): nothing more to confirm
            if item.data.startswith(ACCEPTED_PREFIX):
                continue
            return item

    async def _resend_unaccepted(self, wait: _Wait, request_id: str) -> None:
        """Publish again a request no gateway confirmed owning in time (`ReconnectPolicy.accept_timeout_s`)."""
        wait.ack_wait_s *= 2
        wait.ack_due = asyncio.get_running_loop().time() + wait.ack_wait_s  # also when it cannot go now
        if wait.payload is None or not self.nc.is_connected:
            return  # down: the reconnect's resend covers it
        inbox = next((i for i, w in self._answers.items() if w is wait), None)
        if inbox is None or not wait.queue.empty():  # gone, or something for it came in meanwhile
            return
        # marked only while the connection it last went out on is the one up now (`COPY_HEADER`): after a
        # reconnect what was sent to its inbox may have been lost, and an unmarked copy gets it again
        unbroken = wait.sent_connected and wait.gen == self._generation()
        try:
            await self._publish(inbox, wait, wait.payload, wait.headers, unaccepted_copy=unbroken)
        except ClientError:
            return
        self.num_unaccepted_resent += 1
        log.debug("client: request %s not confirmed by a gateway; published again", request_id or "?")

    async def _retry_no_gateway(self, inbox: str, wait: _Wait, deadline: float) -> bool:
        """After "no responders" to `wait`'s request: publish it again (after a short wait) when time is left
        and either the client reconnected lately (the workers may not have reconnected yet) or the first
        "no responders" to it was less than `no_gateway_grace_s` ago (a gateway restarting); False: give up."""
        policy = self.reconnect
        loop = asyncio.get_running_loop()
        now = loop.time()
        if wait.no_gateway_since is None:
            wait.no_gateway_since = now
        gen = self._generation()
        recent = policy.no_gateway_retry_s > 0 and gen > 0 and (
            gen != self._seen_gen or now - self._reconnected_at < policy.no_gateway_retry_s)
        restarting = now - wait.no_gateway_since < policy.no_gateway_grace_s
        if not (recent or restarting) or deadline - now <= policy.no_gateway_retry_interval_s \
                or wait.payload is None:
            return False
        await asyncio.sleep(policy.no_gateway_retry_interval_s)
        try:
            await self._publish(inbox, wait, wait.payload, wait.headers)
        except ClientError:
            return False
        return True

    async def _open_inbox(self) -> tuple[str, _Wait]:
        """A fresh reply inbox under this client's one prefix, and its waiting request (the caller pops it
        from `_answers` when done, by `_close`; later answers to it are counted, not delivered)."""
        if self._mux is None:
            async with self._mux_lock:
                if self._mux is None:
                    if not self._inbox_prefix:
                        self._inbox_prefix = self.nc.new_inbox()
                    try:
                        self._mux = await self.nc.subscribe(f"{self._inbox_prefix}.*", cb=self._on_answer)
                    except (nats.errors.Error, OSError) as exc:
                        raise ConnectionLost(f"cannot subscribe to the reply inbox: {_describe(exc)}") from None
        inbox = f"{self._inbox_prefix}.{next(self._inbox_seq)}"
        wait = _Wait()
        self._answers[inbox] = wait
        return inbox, wait

    async def _close(self, request_id: str, inbox: str, span, cancel_reason: str, *, answered: bool) -> None:
        """End one request's wait: forget its inbox (counting answers that came after its first), cancel it
        when `cancel_reason` says why, end its span."""
        wait = self._answers.pop(inbox, None)  # first: nothing below may leave the wait behind
        try:
            if inbox:
                self._done[inbox] = answered
                if len(self._done) > _DONE_CAPACITY:
                    self._done.popitem(last=False)
                while wait is not None and not wait.queue.empty():  # came after the answer taken
                    item = wait.queue.get_nowait()
                    if not isinstance(item, _Lost):
                        self._count_extra(inbox, item)
            if cancel_reason and inbox:
                if span is not None:
                    span.set_attribute("oserve.cancelled", cancel_reason)
                await self._cancel(request_id, inbox, cancel_reason)
        finally:
            if span is not None:
                span.end()

    async def _send(self, payload: bytes, span, *, ack: bool = False) -> tuple[str, _Wait]:
        """Publish `payload` on the submit subject with a fresh inbox as its reply (and `span`'s trace
        context); returns the inbox and its waiting request. With `ack` (the request asks for `Accepted`)
        it is published again while no gateway confirms it (`ReconnectPolicy.accept_timeout_s`). Raises
        `ConnectionLost` when the connection cannot take it."""
        inbox, wait = await self._open_inbox()
        if ack and self.reconnect.accept_timeout_s > 0:
            wait.ack_wait_s = self.reconnect.accept_timeout_s
            wait.ack_due = asyncio.get_running_loop().time() + wait.ack_wait_s
        headers = None
        if span is not None:
            from oserve.observability.tracing import inject

            headers = inject(span)
        try:
            await self._publish(inbox, wait, payload, headers)
        except BaseException:
            self._answers.pop(inbox, None)
            raise
        self._ensure_watcher()
        return inbox, wait

    async def _publish(self, inbox: str, wait: _Wait, payload: bytes, headers: dict | None, *,
                       unaccepted_copy: bool = False) -> None:
        """Publish one request (again, after a reconnect), noting on which connection it went out; a
        confirmation awaited (`ReconnectPolicy.accept_timeout_s`) is awaited from now, so a request is never
        out twice at once for want of one. An `unaccepted_copy` goes out marked (`COPY_HEADER`), the mark
        not kept for a later resend."""
        wait.payload, wait.headers = payload, headers
        wait.gen, wait.sent_connected = self._generation(), self.nc.is_connected
        if wait.ack_due is not None:
            wait.ack_due = asyncio.get_running_loop().time() + wait.ack_wait_s
        try:
            # a copy of the headers: nats-py may keep what it is handed while the message waits in its buffer
            out = dict(headers) if headers else None
            if unaccepted_copy:
                out = {**(out or {}), COPY_HEADER: UNACCEPTED_COPY}
            await self.nc.publish(self.submit_subject, payload, reply=inbox, headers=out)
        except nats.errors.MaxPayloadError:
            raise BadReply(f"request of {len(payload)} bytes is over the server's max_payload") from None
        except nats.errors.OutboundBufferLimitError:
            raise ConnectionLost("the connection to NATS is down and its reconnect buffer "
                                 f"({self.reconnect.pending_bytes} bytes) is full") from None
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionLost(f"cannot publish the request: {_describe(exc)}") from None

    def _generation(self) -> int:
        """Which connection the client is on: nats-py's count of reconnects."""
        return reconnects(self.nc)

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="oserve-client-watch")

    async def _watch(self) -> None:
        """While requests wait: publish them again after a reconnect, give up past `give_up_after_s`, and fail
        them when the connection closes."""
        policy = self.reconnect
        loop = asyncio.get_running_loop()
        gen = self._generation()
        resend_at: float | None = None  # when the requests of the connection before `gen` go again
        while self._answers:
            nc = self.nc
            if nc.is_closed:
                self._fail_waiting("the connection to NATS is closed")
                return
            if nc.is_connected:
                self._down_since = None
                now_gen = self._generation()
                if now_gen != self._seen_gen:
                    self._seen_gen, self._reconnected_at = now_gen, loop.time()
                if now_gen != gen:
                    gen, resend_at = now_gen, loop.time() + policy.resend_delay_s
                if resend_at is not None and loop.time() >= resend_at:
                    resend_at = None
                    await self._resend(gen)
            else:
                if self._down_since is None:
                    self._down_since = loop.time()
                down_s = loop.time() - self._down_since
                if policy.give_up_after_s is not None and down_s >= policy.give_up_after_s:
                    why = f"disconnected from NATS for {down_s:.1f} s; gave up (give_up_after_s)"
                    log.warning("client: %s", why)
                    if self._owns:
                        await _abandon(self.nc)
                    self._fail_waiting(why)
                    return
            await asyncio.sleep(policy.poll_interval_s)

    async def _resend(self, gen: int) -> None:
        """After a reconnect (to connection `gen`): publish again what went out on an earlier connection."""
        for inbox, wait in list(self._answers.items()):
            if wait.payload is None or wait.gen >= gen:
                continue
            if wait.sent_connected and self.reconnect.resend_on_reconnect:
                try:
                    await self._publish(inbox, wait, wait.payload, wait.headers)
                except ClientError as exc:  # down again: the next reconnect tries again
                    log.debug("client: could not resend on %s: %s", inbox, exc)
                    return
                self.num_resent += 1
            else:  # it waited in the reconnect buffer, which went out on this connection
                wait.gen, wait.sent_connected = gen, True
        if self.num_resent:
            log.info("client: %d requests published again after reconnecting (total)", self.num_resent)

    def _fail_waiting(self, reason: str) -> None:
        lost = _Lost(reason)
        for wait in self._answers.values():
            wait.queue.put_nowait(lost)

    async def _on_answer(self, msg) -> None:
        wait = self._answers.get(msg.subject)
        if wait is not None:
            wait.queue.put_nowait(msg)
        elif msg.subject in self._done:  # the request's wait is over: a second answer, or one too late
            self._count_extra(msg.subject, msg)

    def _count_extra(self, inbox: str, msg) -> None:
        """Count a message that came to `inbox` after its wait took its answer, or after it gave up. NATS's
        "no responders" status after the answer is not a second answer (one of the request's publishes, a
        resend while no gateway listened, reached nobody): counted apart (`num_late_statuses`)."""
        if not _is_answer(msg):
            return
        if self._done.get(inbox) and msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
            self.num_late_statuses += 1
            return
        if self._done.get(inbox):
            self.num_duplicates += 1
            log.debug("client: %s answered again", inbox)
        else:
            self.num_late += 1
            self._done[inbox] = True

    async def _cancel(self, request_id: str, inbox: str, reason: str) -> None:
        """Publish a `CancelRequest` for an abandoned request (best effort: a closed connection cancels nothing)."""
        if not request_id or self.nc.is_closed:
            return
        try:
            await self.nc.publish(self.cancel_subject, encode(CancelRequest(request_id=request_id, inbox=inbox,
                                                                               reason=reason)))
        except (nats.errors.Error, OSError):  # connection closing: the gateway will see no answer come back
            log.debug("request %s: could not publish its cancel", request_id, exc_info=True)

    async def submit_raw(self, payload: bytes, request_id: str = "", timeout_s: float | None = None) -> Reply | Pong:
        """Send already-encoded bytes to the gateway and decode the answer (tests send malformed ones).

        The answer comes to an inbox under the client's one prefix (as a stream's does); on a timeout, or
        when the awaiting task is cancelled, the request is cancelled (`CancelRequest`)."""
        return await self._submit(payload, request_id, timeout_s, cancel=True)

    def _publish_span(self, step: str, request_id: str, payload: bytes):
        """The client span of one request's publish on the submit subject (None for an untraced client;
        only a traced client imports OpenTelemetry, which the light install lacks)."""
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        from oserve.observability.tracing import messaging_attributes, messaging_span_name

        subject = self.submit_subject
        return self.tracer.start_span(messaging_span_name("publish", subject), kind=SpanKind.CLIENT,
                                      attributes={"oserve.step": step, "oserve.request_id": request_id,
                                                  **messaging_attributes(subject, "send", "publish",
                                                                         message_id=request_id,
                                                                         body_size_bytes=len(payload))})

    async def _submit(self, payload: bytes, request_id: str, timeout_s: float | None, *, cancel: bool,
                      ack: bool = False) -> Reply | Pong:
        timeout = self._timeout(timeout_s)
        deadline = asyncio.get_running_loop().time() + timeout
        span = self._publish_span("client.submit", request_id, payload)
        ended = False  # an answer came (or nobody took the request): nothing to cancel
        reason = "client_closed"
        inbox = ""
        try:
            inbox, wait = await self._send(payload, span, ack=ack)
            while True:
                try:
                    msg = await self._next(wait, deadline, request_id, timeout)
                except (RequestTimeout, ConnectionLost):
                    reason = "timeout"
                    raise
                if not (msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS
                        and await self._retry_no_gateway(inbox, wait, deadline)):
                    break
            ended = True
            if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                raise NoGateway(f"no gateway listens on {self.submit_subject}")
            try:
                answer = decode_reply(msg.data)
            except SchemaError as exc:
                raise BadReply(f"request {request_id or '?'}: unreadable reply: {exc}") from None
            if isinstance(answer, ErrorReply):
                raise RequestRejected(answer.request_id or request_id, answer.code, answer.message)
            if isinstance(answer, ReplyChunk):
                raise BadReply(f"request {request_id or '?'}: the answer is streamed; use stream()")
            if span is not None and isinstance(answer, Reply):
                span.set_attributes({"gen_ai.operation.name": "text_completion",
                                     "gen_ai.usage.input_tokens": answer.input_tokens,
                                     "gen_ai.usage.output_tokens": answer.output_tokens})
            return answer
        except ClientError as exc:
            _failed(span, exc)
            raise
        finally:
            await self._close(request_id, inbox, span, reason if cancel and not ended else "", answered=ended)

    async def ping(self, timeout_s: float = 2.0) -> Pong:
        """Ask a gateway whether it is up and how many replicas it sees."""
        answer = await self._submit(encode(Ping()), "ping", timeout_s, cancel=False)
        assert isinstance(answer, Pong)
        return answer

    async def close(self) -> None:
        """Stop watching the connection; drain it when the client made it (waiting requests then fail with
        `ConnectionLost`). Idempotent."""
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
        self._watcher = None
        if self._owns and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except (nats.errors.Error, OSError, TimeoutError) as exc:  # down: closing is all that is left
                log.debug("client: drain failed (%s); closing", _describe(exc))
                await _abandon(self.nc)
        if self._owns:
            self._fail_waiting("the client was closed")

    async def __aenter__(self) -> OServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _is_answer(msg) -> bool:
    """Whether `msg` is a final answer (a reply, an error reply, a pong, or NATS's no-responders status),
    not a streamed chunk or noise."""
    if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
        return True
    try:
        answer = decode_reply(msg.data)
    except SchemaError:
        return False
    return not isinstance(answer, (ReplyChunk, Accepted))


async def _abandon(nc: NATS) -> None:
    """Close `nc` without waiting on a server that is gone (best effort, bounded)."""
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except (nats.errors.Error, OSError, TimeoutError, AttributeError, AssertionError):
        log.debug("client: closing the connection failed", exc_info=True)


def _failed(span, exc: Exception) -> None:
    """Mark a request's span (if traced) as failed with `exc`."""
    if span is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(exc)))


def new_part(chunk: ReplyChunk, tokens: int, text: str) -> ReplyChunk | None:
    """What of `chunk` extends an answer of which `tokens` tokens (`text`) were yielded, or None. Pure.

    A chunk that starts where the answer is passes whole; one that overlaps it (it starts before and ends
    after) passes with its first part sliced off, when it says where its text starts (`offset_chars`) and
    the overlap agrees with what was yielded; anything else (old, a gap ahead, other text) is dropped."""
    end = chunk.offset_tokens + chunk.num_tokens
    if chunk.num_tokens <= 0 or end <= tokens or chunk.offset_tokens > tokens:
        return None
    if chunk.offset_tokens == tokens:
        return chunk
    if chunk.offset_chars is None:
        return None
    skip = len(text) - chunk.offset_chars  # characters of the chunk already yielded
    if not 0 <= skip <= len(chunk.text) or chunk.text[:skip] != text[chunk.offset_chars:]:
        return None
    return msgspec.structs.replace(chunk, offset_tokens=tokens, num_tokens=end - tokens, text=chunk.text[skip:],
                                   offset_chars=len(text))


def _request(prompt: str | None, input_tokens: int | None, max_tokens: int | None, output_hint_tokens: int | None,
             tags: Mapping[str, str] | None, request_id: str | None, sim_output_tokens: int | None,
             temperature: float | None, top_p: float | None, seed: int | None, stop: Sequence[str],
             stream: bool, timeout_s: float | None = None) -> SubmitRequest:
    """The `SubmitRequest` of `submit` / `stream` (the gateway validates it). Pure but for a fresh id.

    `timeout_s`, how long the client will wait, is the request's deadline (`SubmitRequest.timeout_s`, at
    most `MAX_TIMEOUT_S`); the request asks the gateway to confirm it owns it (`SubmitRequest.ack`)."""
    if (prompt is None) == (input_tokens is None):
        raise ValueError("give exactly one of prompt (text) and input_tokens (a count)")
    return SubmitRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt, input_tokens=input_tokens,
                         max_tokens=max_tokens, output_hint_tokens=output_hint_tokens, tags=dict(tags or {}),
                         sim_output_tokens=sim_output_tokens, stream=stream, temperature=temperature, top_p=top_p,
                         seed=seed, stop=list(stop), ack=True,
                         timeout_s=min(timeout_s, MAX_TIMEOUT_S) if timeout_s is not None else None)



