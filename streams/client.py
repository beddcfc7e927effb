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

Errors are typed: `RequestRejected` (the system answered with a structured error: `code`, `message`),
`RequestTimeout` (no answer within the timeout), `NoGateway` (nobody listens on the submit subject).
It is part of the bus contract (`oserve.streams`), outside the pure core: it imports nats. It is also the
light client (`pip install oserve`, nats-py and msgspec alone): OpenTelemetry is imported only when a
`tracer` is given, and nothing here imports the system (numpy, torch, the workers).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Mapping, Sequence

import msgspec
import nats
import nats.errors
import nats.js.api
from nats.aio.client import Client as NATS

from oserve.errors import OServeError
from oserve.streams.schemas import (CancelRequest, ErrorReply, Ping, Pong, Reply, ReplyChunk, SchemaError,
                                    SubmitRequest, decode, decode_reply, encode)
from oserve.streams.server import redact_url
from oserve.streams.subjects import Subjects

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)
_NO_RESPONDERS = "503"  # the status NATS answers a request with when nobody subscribes to its subject


class ClientError(OServeError):
    """Base of the client's errors."""


class RequestRejected(ClientError):
    """The system answered with a structured error."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id or '?'} rejected: {code}: {message}")
        self.request_id, self.code, self.message = request_id, code, message


class RequestTimeout(ClientError):
    """No reply within the timeout."""


class NoGateway(ClientError):
    """No gateway is subscribed to the submit subject."""


class OServeClient:
    """Async client over one NATS connection; `connect()` makes one, or pass your own `nc`.

    Every answer, streamed or not, comes to an inbox under one prefix per client (`nc.new_inbox()`, taken
    once), so a `submit` and a `stream` with the same request id are the same client's to the gateway and
    the engines (`dedupe_key`): a retry by either gets the one answer. A request abandoned before its
    answer (a stream closed early, a timeout, a cancelled task) is cancelled: the client publishes a
    `CancelRequest` naming its inbox, and the system stops generating it. Sent again with the same id, a
    cancelled request is served anew."""

    def __init__(self, nc: NATS, subjects: Subjects = Subjects(), *, default_timeout_s: float = 60.0,
                 tracer: Tracer | None = None, owns_connection: bool = False) -> None:
        if not default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        self.nc, self.subjects, self.tracer = nc, subjects, tracer
        self.default_timeout_s = default_timeout_s
        self._owns = owns_connection
        self._inbox_prefix = ""  # one inbox prefix for all this client's answers (`dedupe_key` matches its retries)
        self._inbox_seq = itertools.count()
        # One subscription to `<prefix>.*` carries every answer (nats.py's request() does the same): a
        # subscription per request would cost a SUB and an UNSUB on the wire for each.
        self._answers: dict[str, asyncio.Queue] = {}  # inbox -> the messages answering it, until it closes
        self._mux = None
        self._mux_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: str, *, subjects: Subjects = Subjects(), user: str | None = None,
                      password: str | None = None, default_timeout_s: float = 60.0,
                      tracer: Tracer | None = None, connect_timeout_s: float = 5.0) -> OServeClient:
        """Connect to NATS; replies arrive under `<reply_prefix>.<user>`, which permissions can restrict."""
        try:
            nc = await nats.connect(url, user=user, password=password, connect_timeout=connect_timeout_s,
                                    inbox_prefix=f"{subjects.reply_prefix()}.{user or 'anon'}",
                                    max_reconnect_attempts=3)
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            raise ClientError(f"cannot connect to NATS at {redact_url(url)}: {exc}") from exc
        return cls(nc, subjects, default_timeout_s=default_timeout_s, tracer=tracer, owns_connection=True)

    async def submit(self, *, prompt: str | None = None, input_tokens: int | None = None,
                     max_tokens: int | None = None, output_hint_tokens: int | None = None,
                     tags: Mapping[str, str] | None = None, request_id: str | None = None,
                     timeout_s: float | None = None, sim_output_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     stop: Sequence[str] = ()) -> Reply:
        """Submit one request and await its reply; raises `RequestRejected`, `RequestTimeout`, `NoGateway`.

        `sim_output_tokens` is for simulated engines only (`SubmitRequest.sim_output_tokens`); the sampling
        fields are forwarded to the engine (see `SubmitRequest.temperature`)."""
        req = _request(prompt, input_tokens, max_tokens, output_hint_tokens, tags, request_id, sim_output_tokens,
                       temperature, top_p, seed, stop, stream=False)
        return await self.submit_raw(encode(req), req.request_id, timeout_s)  # type: ignore[return-value]

    def stream(self, *, prompt: str | None = None, input_tokens: int | None = None,
               max_tokens: int | None = None, output_hint_tokens: int | None = None,
               tags: Mapping[str, str] | None = None, request_id: str | None = None,
               timeout_s: float | None = None, sim_output_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] = ()) -> AsyncIterator[ReplyChunk | Reply]:
        """Submit one request with streaming: an iterator of its `ReplyChunk`s, then its final `Reply` (see
        `stream_raw`); the same arguments and errors as `submit`."""
        req = _request(prompt, input_tokens, max_tokens, output_hint_tokens, tags, request_id, sim_output_tokens,
                       temperature, top_p, seed, stop, stream=True)
        return self.stream_raw(encode(req), req.request_id, timeout_s)

    async def stream_raw(self, payload: bytes, request_id: str = "",
                         timeout_s: float | None = None) -> AsyncIterator[ReplyChunk | Reply]:
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
        Raises `RequestRejected`, `RequestTimeout`, `NoGateway`, `ClientError`."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        span = self._publish_span("client.stream", request_id, payload)
        ended = False  # the system is done with the request (answered, refused, or nobody took it)
        reason = "client_closed"
        inbox = ""
        try:
            inbox, answers = await self._send(payload, span)
            tokens, text = 0, ""  # what was yielded so far
            while True:
                left_s = deadline - loop.time()
                try:
                    if left_s <= 0:
                        raise nats.errors.TimeoutError
                    msg = await asyncio.wait_for(answers.get(), left_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    reason = "timeout"
                    raise RequestTimeout(f"request {request_id or '?'}: no full answer within {timeout} s") from None
                if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                    ended = True
                    raise NoGateway(f"no gateway listens on {self.subjects.submit()}")
                try:
                    answer = decode(msg.data, Reply | ErrorReply | ReplyChunk)
                except SchemaError as exc:
                    raise ClientError(f"request {request_id or '?'}: unreadable reply: {exc}") from None
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
            await self._close(request_id, inbox, span, reason if not ended else "")

    async def _open_inbox(self) -> tuple[str, asyncio.Queue]:
        """A fresh reply inbox under this client's one prefix, and the queue its answers arrive in (the
        caller pops it from `_answers` when done; later answers to it are dropped)."""
        if self._mux is None:
            async with self._mux_lock:
                if self._mux is None:
                    if not self._inbox_prefix:
                        self._inbox_prefix = self.nc.new_inbox()
                    self._mux = await self.nc.subscribe(f"{self._inbox_prefix}.*", cb=self._on_answer)
        inbox = f"{self._inbox_prefix}.{next(self._inbox_seq)}"
        answers: asyncio.Queue = asyncio.Queue()
        self._answers[inbox] = answers
        return inbox, answers

    async def _close(self, request_id: str, inbox: str, span, cancel_reason: str) -> None:
        """End one request's wait: forget its inbox, cancel it when `cancel_reason` says why, end its span."""
        self._answers.pop(inbox, None)  # first: nothing below may leave the queue behind
        try:
            if cancel_reason and inbox:
                if span is not None:
                    span.set_attribute("oserve.cancelled", cancel_reason)
                await self._cancel(request_id, inbox, cancel_reason)
        finally:
            if span is not None:
                span.end()

    async def _send(self, payload: bytes, span) -> tuple[str, asyncio.Queue]:
        """Publish `payload` on the submit subject with a fresh inbox as its reply (and `span`'s trace
        context); returns the inbox and the queue its answers arrive in."""
        inbox, answers = await self._open_inbox()
        headers = None
        if span is not None:
            from oserve.observability.tracing import inject

            headers = inject(span)
        try:
            await self.nc.publish(self.subjects.submit(), payload, reply=inbox, headers=headers)
        except BaseException:
            self._answers.pop(inbox, None)
            raise
        return inbox, answers

    async def _on_answer(self, msg) -> None:
        answers = self._answers.get(msg.subject)
        if answers is not None:  # else the request was given up: a late answer has nobody to go to
            answers.put_nowait(msg)

    async def _cancel(self, request_id: str, inbox: str, reason: str) -> None:
        """Publish a `CancelRequest` for an abandoned request (best effort: a closed connection cancels nothing)."""
        if not request_id or self.nc.is_closed:
            return
        try:
            await self.nc.publish(self.subjects.cancel(), encode(CancelRequest(request_id=request_id, inbox=inbox,
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

        subject = self.subjects.submit()
        return self.tracer.start_span(messaging_span_name("publish", subject), kind=SpanKind.CLIENT,
                                      attributes={"oserve.step": step, "oserve.request_id": request_id,
                                                  **messaging_attributes(subject, "send", "publish",
                                                                         message_id=request_id,
                                                                         body_size_bytes=len(payload))})

    async def _submit(self, payload: bytes, request_id: str, timeout_s: float | None, *, cancel: bool) -> Reply | Pong:
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        span = self._publish_span("client.submit", request_id, payload)
        ended = False  # an answer came (or nobody took the request): nothing to cancel
        reason = "client_closed"
        inbox = ""
        try:
            inbox, answers = await self._send(payload, span)
            try:
                msg = await asyncio.wait_for(answers.get(), timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                reason = "timeout"
                raise RequestTimeout(f"request {request_id or '?'}: no reply within {timeout} s") from None
            ended = True
            if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                raise NoGateway(f"no gateway listens on {self.subjects.submit()}")
            try:
                answer = decode_reply(msg.data)
            except SchemaError as exc:
                raise ClientError(f"request {request_id or '?'}: unreadable reply: {exc}") from None
            if isinstance(answer, ErrorReply):
                raise RequestRejected(answer.request_id or request_id, answer.code, answer.message)
            if isinstance(answer, ReplyChunk):
                raise ClientError(f"request {request_id or '?'}: the answer is streamed; use stream()")
            if span is not None and isinstance(answer, Reply):
                span.set_attributes({"gen_ai.operation.name": "text_completion",
                                     "gen_ai.usage.input_tokens": answer.input_tokens,
                                     "gen_ai.usage.output_tokens": answer.output_tokens})
            return answer
        except ClientError as exc:
            _failed(span, exc)
            raise
        finally:
            await self._close(request_id, inbox, span, reason if cancel and not ended else "")

    async def ping(self, timeout_s: float = 2.0) -> Pong:
        """Ask a gateway whether it is up and how many replicas it sees."""
        answer = await self._submit(encode(Ping()), "ping", timeout_s, cancel=False)
        assert isinstance(answer, Pong)
        return answer

    async def close(self) -> None:
        if self._owns and not self.nc.is_closed:
            await self.nc.drain()

    async def __aenter__(self) -> OServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


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
             stream: bool) -> SubmitRequest:
    """The `SubmitRequest` of `submit` / `stream` (the gateway validates it). Pure but for a fresh id."""
    if (prompt is None) == (input_tokens is None):
        raise ValueError("give exactly one of prompt (text) and input_tokens (a count)")
    return SubmitRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt, input_tokens=input_tokens,
                         max_tokens=max_tokens, output_hint_tokens=output_hint_tokens, tags=dict(tags or {}),
                         sim_output_tokens=sim_output_tokens, stream=stream, temperature=temperature, top_p=top_p,
                         seed=seed, stop=list(stop))
