"""The OpenAI-compatible HTTP front: FastAPI on uvicorn inside the worker's event loop, a client of the gateway.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`), `GET /v1/models`, `GET /v1/models/{id}`,
`GET /health` (200 only while a gateway answers a `Ping`).

- Every request goes through `OServeClient` to the submit subject: the gateway validates, classes and
  routes it as any other; the front only translates. Bodies are validated strictly here first
  (pydantic, unknown fields refused as OpenAI refuses them), so a bad one is a 400 in OpenAI's error
  shape `{"error": {"message", "type", "param", "code"}}` before anything is published.
- Chat messages become the prompt by one documented template (`chat_prompt`): each message on its own
  line as `role: content`, then `assistant:` for the answer to follow.
- What is honoured: `model` (only the served one; another is a 404 `model_not_found`), `prompt` /
  `messages`, `max_tokens` (`max_completion_tokens` for chat), `stream` and `stream_options.include_usage`,
  `n` = 1, `user` (as the request's `user` tag). Accepted and forwarded to the engine: `temperature`,
  `top_p`, `seed`, `stop` (validated on the bus, `SubmitRequest.temperature`); the `sim` and `echo`
  backends answer with placeholder text and cannot honour them, a vLLM backend will. Refused with a 400,
  never silently ignored: `n` > 1, `best_of` > 1, `echo`, `logprobs`, `suffix`, non-zero penalties,
  `logit_bias`, tools, non-text content parts, response formats other than text.
- `usage` counts prompt tokens as the gateway does (about 4 UTF-8 bytes a token: there is no tokenizer on
  the request path) and completion tokens as the engine produced them; `finish_reason` is "length" when
  the answer reached `max_tokens`, else "stop".
- Errors: bad bodies and anything the gateway refuses as invalid are 400; an unknown model 404; too many
  requests in flight at the front, or the gateway `overloaded`, 429; `no_replica`, `shutting_down` or no
  gateway 503; no answer within `request_timeout_s` 504.
- Authentication, as vLLM's `--api-key`: with `api_keys` set, every endpoint but `/health` wants
  `Authorization: Bearer <key>` with one of them (compared in constant time), else a 401 in OpenAI's shape
  (`invalid_api_key`). The keys are never logged nor put on a span.
- Cancellation, as vLLM aborts on a disconnect: a streamed answer whose HTTP client goes away, or that runs
  past `request_timeout_s`, closes its bus stream, which cancels the request (`CancelRequest`): the engine
  stops generating it and frees its KV. Such a call is recorded with status 499 and `error.type`
  `client_closed` (a timeout: 504 `timeout`); a stream that fails mid-way, with its error's status.
- Extension for the simulated engines: `sim_output_tokens` (as `SubmitRequest.sim_output_tokens`) sets how
  long the simulated answer is; without it a simulated answer is `max_tokens` long.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.aio.client import Client as NATS
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from oserve.errors import ConfigError
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import GEN_AI_PROVIDER, extract
from oserve.streams.client import ClientError, NoGateway, OServeClient, RequestRejected, RequestTimeout
from oserve.streams.schemas import (MAX_MESSAGE_BYTES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TOKENS, ErrorCode,
                                    Reply, ReplyChunk, SubmitRequest, encode)
from oserve.streams.subjects import Subjects
from oserve.workers.base import Worker

log = logging.getLogger(__name__)

USER_TAG = "user"
"""The `SubmitRequest.tags` key the OpenAI `user` field goes under."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` of the legacy completions endpoint."""


@dataclass(frozen=True, slots=True)
class HTTPFrontConfig:
    """The OpenAI-compatible HTTP front."""

    model_name: str = "llama2-7b"
    """The one model served: `/v1/models` lists it; a request naming another is a 404 `model_not_found`."""
    subjects: Subjects = field(default_factory=Subjects)
    host: str = "127.0.0.1"
    port: int = 8000
    """TCP port to listen on; 0 takes a free one (`OpenAIFront.port` says which, after `start()`)."""
    request_timeout_s: float = 600.0
    """Wall seconds one request may take, whole answer included (504 past it)."""
    health_timeout_s: float = 2.0
    """Wall seconds `/health` waits for a gateway's `Pong`."""
    max_concurrent_requests: int = 1024
    """Requests in flight at this front at once (streams until their last chunk); more are a 429."""
    max_body_bytes: int = 4 * MAX_MESSAGE_BYTES
    """Largest HTTP body read (JSON escapes can make a prompt's body bigger than its message); more is a 413.
    A prompt whose `SubmitRequest` exceeds the bus's message limit is a 400 `context_length_exceeded`."""
    default_max_tokens: int = 256
    """`max_tokens` of a chat completion that gives none (OpenAI's is the context window; a bound keeps a
    simulated answer short). Legacy completions default to OpenAI's 16."""
    drain_timeout_wall_s: float = 30.0
    """Wall seconds `drain()` lets in-flight responses finish before closing their connections."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Bearer keys a caller must send (`Authorization: Bearer <key>`, any one of them) on every endpoint but
    `/health`; empty: no authentication (vLLM's `--api-key`). Kept out of the config's repr, so out of logs."""

    def __post_init__(self) -> None:
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k.strip() == k and k
                                                            for k in self.api_keys):
            raise ConfigError(f"HTTPFrontConfig.api_keys must be a tuple of non-empty keys without surrounding "
                              f"spaces ({len(self.api_keys)} given, values not shown)")
        if not self.model_name or len(self.model_name) > 256:
            raise ConfigError(f"HTTPFrontConfig.model_name must be 1..256 characters, got {self.model_name!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"HTTPFrontConfig.port must be in 0..65535, got {self.port}")
        for name in ("request_timeout_s", "health_timeout_s", "drain_timeout_wall_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"HTTPFrontConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_concurrent_requests", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"HTTPFrontConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.default_max_tokens <= MAX_TOKENS:
            raise ConfigError(f"HTTPFrontConfig.default_max_tokens must be in 1..{MAX_TOKENS}, "
                              f"got {self.default_max_tokens}")


# --- request bodies -------------------------------------------------------------------------------------

StopField = str | list[str] | None


class _Body(BaseModel):
    """Fields both endpoints share; unknown fields are refused (OpenAI: "Unrecognized request argument")."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    stop: StopField = None
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    sim_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    """OServe's extension for the simulated engines (see the module docstring)."""


class CompletionBody(_Body):
    prompt: str | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(None, max_length=256)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def _check_common(body: _Body) -> None:
    """Refuse what the front cannot carry (OpenAI's fields with no meaning here). Pure; raises `APIError`."""
    if body.n not in (None, 1):
        raise _unsupported("n", "n > 1 (several choices per request)")
    if body.presence_penalty or body.frequency_penalty:
        raise _unsupported("presence_penalty" if body.presence_penalty else "frequency_penalty",
                           "a non-zero presence or frequency penalty")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")
    if body.stream_options is not None:
        unknown = set(body.stream_options) - {"include_usage"}
        if unknown or not isinstance(body.stream_options.get("include_usage", False), bool):
            raise APIError(400, f"stream_options: only include_usage (a boolean) is supported, got "
                                f"{sorted(body.stream_options)}", param="stream_options")
        if not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


def stop_sequences(stop: StopField) -> list[str]:
    """OpenAI's `stop` (a string, a list of them, or null) as the bus carries it. Pure; raises `APIError`."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOP_SEQUENCES} non-empty sequences of at most {MAX_STOP_CHARS} "
                            "characters", param="stop")
    return stops


def completion_prompt(body: CompletionBody) -> str:
    """The prompt text of a completions request. Pure; raises `APIError` for what is not supported."""
    if body.echo:
        raise _unsupported("echo", "echo")
    if body.logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", "best_of > 1")
    if body.suffix is not None:
        raise _unsupported("suffix", "suffix")
    if isinstance(body.prompt, list):
        if len(body.prompt) != 1:
            raise _unsupported("prompt", "a batch of prompts (a list of more than one)")
        return body.prompt[0]
    return body.prompt


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The prompt of a chat: one line `role: content` per message, then `assistant:`. Pure; raises `APIError`.

    A simple, model-agnostic template (no model's own chat template: there is no tokenizer here); a
    content given as parts may hold text parts only, joined with no separator."""
    lines = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"messages[{i}].content", "a content part that is not text")
                texts.append(part["text"])
            content = "".join(texts)
        else:
            content = m.content or ""
        lines.append(f"{m.role}: {content}")
    lines.append("assistant:")
    return "\n".join(lines)


def _check_chat(body: ChatBody) -> None:
    if body.logprobs or body.top_logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.tools:
        raise _unsupported("tools", "tools (function calling)")
    if body.tool_choice not in (None, "none"):
        raise _unsupported("tool_choice", "tool_choice")
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise _unsupported("response_format", "a response format other than text")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "give max_tokens or max_completion_tokens, not two different values",
                       param="max_completion_tokens")


_CLIENT_ERRORS: dict[str, tuple[int, str]] = {
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.NO_REPLICA: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


def api_error(exc: ClientError) -> APIError:
    """The HTTP answer to a client error from the bus. Pure."""
    if isinstance(exc, RequestRejected):
        status, type_ = _CLIENT_ERRORS.get(exc.code, (400, "invalid_request_error"))
        return APIError(status, exc.message, type_, code=exc.code)
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), "server_error", code="timeout")
    if isinstance(exc, NoGateway):
        return APIError(503, "no gateway is serving requests", "server_error", code=ErrorCode.NO_REPLICA)
    return APIError(502, str(exc), "server_error", code=ErrorCode.INTERNAL)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


CLIENT_CLOSED_STATUS = 499
"""The status recorded for a call whose client went away before its answer ended (nginx's "client closed")."""


def _client_closed() -> APIError:
    return APIError(CLIENT_CLOSED_STATUS, "the client closed the connection before the answer ended",
                    "client_closed", code="client_closed")


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Whether `given` is one of `keys`, compared in constant time with each (no early exit). Pure."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


class _EventStream(StreamingResponse):
    """A streamed answer that closes its body when the response ends however it ends (a client disconnect
    included), so the bus stream under it is closed, and its request cancelled, at once rather than when the
    generator is garbage-collected."""

    async def stream_response(self, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the process's `main()` owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


@dataclass(frozen=True, slots=True)
class _Call:
    """One OpenAI request as the front serves it."""

    kind: Literal["completion", "chat"]
    response_id: str
    request: SubmitRequest
    max_tokens: int
    stream: bool
    include_usage: bool


class OpenAIFront(Worker):
    """The HTTP front (see the module docstring): `start()` binds the port and serves, `drain()` stops taking
    connections and lets in-flight responses finish, `stop()` closes what is left."""

    name = "http"

    def __init__(self, nc: NATS, config: HTTPFrontConfig, *, client: OServeClient | None = None,
                 tracer: Tracer | None = None, metrics: Metrics | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.tracer, self.metrics = nc, config, tracer, metrics
        self.client = client or OServeClient(nc, config.subjects, default_timeout_s=config.request_timeout_s,
                                             tracer=tracer)
        self.app = self._build_app()
        self._server: _Server | None = None
        self._sock: socket.socket | None = None
        self._served = asyncio.Event()
        self._created_unix_s = int(time.time())
        self.port: int | None = None
        """The bound TCP port, once started (the one taken when `config.port` is 0)."""
        self.num_inflight = 0
        self.num_requests = 0
        self.num_errors = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    async def _subscribe(self) -> list:
        # bound here, so the port is known (and connections queue) when start() returns
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"HTTP front: cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        sock.listen(2048)
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(max(1, self.config.drain_timeout_wall_s)))
        self._server = _Server(config)
        return []

    def _loops(self):
        return [self._serve]

    async def _serve(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            self._served.set()

    async def _drain(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._served.wait(), self.config.drain_timeout_wall_s + 1.0)
        except TimeoutError:
            log.warning("http: drain timed out with %d requests in flight", self.num_inflight)

    async def _on_stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = self._server.force_exit = True
        if self._sock is not None:
            self._sock.close()

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (`http://host:port/v1`), once started."""
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/v1"

    # --- the app -----------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="OServe", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return APIError(exc.status_code, str(exc.detail), type_).response()

        @app.exception_handler(APIError)
        async def api_error_(request: Request, exc: APIError) -> JSONResponse:
            return exc.response()

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception) -> JSONResponse:  # the outermost handler
            self.num_errors += 1
            log.exception("http: %s %s failed", request.method, request.url.path)
            return APIError(500, type(exc).__name__, "server_error", code=ErrorCode.INTERNAL).response()

        auth = [Depends(self._authorize)] if self.config.api_keys else []
        app.add_api_route("/health", self._health, methods=["GET"])  # open: probes carry no key
        app.add_api_route("/v1/models", self._models, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/models/{model_id:path}", self._model, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/completions", self._completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"], dependencies=auth)
        return app

    async def _authorize(self, request: Request) -> None:
        """Let a call through when it carries one of the configured keys; else raise a 401 (`invalid_api_key`)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key_matches(given.strip(), self.config.api_keys):
            return
        self.num_errors += 1
        if self.metrics is not None:  # labelled by route, not path: a path is anything a caller sends
            route = getattr(request.scope.get("route"), "path", "other")
            self.metrics.http_requests.labels(route, "401").inc()
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
        raise APIError(401, message, "invalid_request_error", code="invalid_api_key")

    async def _health(self) -> JSONResponse:
        try:
            pong = await self.client.ping(timeout_s=self.config.health_timeout_s)
        except ClientError as exc:
            return APIError(503, f"unhealthy: {exc}", "server_error", code=ErrorCode.NO_REPLICA).response()
        return JSONResponse({"status": "ok", "gateway_id": pong.gateway_id, "num_replicas": pong.num_replicas})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self._created_unix_s, "owned_by": "oserve"}

    async def _models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, model_id: str) -> JSONResponse:
        if model_id != self.config.model_name:
            return self._model_not_found(model_id).response()
        return JSONResponse(self._model_card())

    def _model_not_found(self, model: str) -> APIError:
        return APIError(404, f"The model `{model}` does not exist; this server serves `{self.config.model_name}`",
                        param="model", code="model_not_found")

    async def _read_json(self, request: Request) -> Any:
        """The body as JSON, read up to `max_body_bytes`; raises `APIError`."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes, limit {limit}", code="too_large")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes", code="too_large")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}", code=ErrorCode.BAD_JSON) from None

    def _parse(self, kind: Literal["completion", "chat"], raw: Any) -> _Call:
        """Validate a body and build its `SubmitRequest`. Pure but for a fresh id; raises `APIError`."""
        model_cls = CompletionBody if kind == "completion" else ChatBody
        try:
            body = model_cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')} "
                                f"({exc.error_count()} error(s))", param=param, code=ErrorCode.INVALID) from None
        if body.model != self.config.model_name:
            raise self._model_not_found(body.model)
        _check_common(body)
        if isinstance(body, ChatBody):
            _check_chat(body)
            prompt = chat_prompt(body.messages)
            max_tokens = body.max_completion_tokens or body.max_tokens or self.config.default_max_tokens
            response_id = f"chatcmpl-{uuid.uuid4().hex}"
        else:
            assert isinstance(body, CompletionBody)
            prompt = completion_prompt(body)
            max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
            response_id = f"cmpl-{uuid.uuid4().hex}"
        req = SubmitRequest(request_id=response_id, prompt=prompt, max_tokens=max_tokens,
                            tags={USER_TAG: body.user} if body.user else {}, sim_output_tokens=body.sim_output_tokens,
                            stream=bool(body.stream), temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop=stop_sequences(body.stop))
        return _Call(kind, response_id, req, max_tokens, bool(body.stream),
                     bool((body.stream_options or {}).get("include_usage", False)))

    async def _completions(self, request: Request) -> Response:
        return await self._serve_call("completion", request)

    async def _chat(self, request: Request) -> Response:
        return await self._serve_call("chat", request)

    def _start_span(self, kind: Literal["completion", "chat"], request: Request) -> Span | None:
        """The request's HTTP server span, child of the caller's W3C trace context when it sent one; it is
        also the GenAI span of the call (`gen_ai.*` attributes; the engine's span is its descendant)."""
        if self.tracer is None:
            return None
        endpoint = request.url.path
        return self.tracer.start_span(
            f"POST {endpoint}", context=extract(dict(request.headers)), kind=SpanKind.SERVER,
            attributes={"oserve.step": "http.serve", "http.request.method": "POST", "url.path": endpoint,
                        "url.scheme": request.url.scheme, "server.port": self.port or 0,
                        "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
                        "gen_ai.provider.name": GEN_AI_PROVIDER, "gen_ai.request.model": self.config.model_name})

    def _finished(self, span: Span | None, endpoint: str, started_s: float, status: int, *,
                  call: _Call | None = None, reply: Reply | None = None, error: APIError | None = None) -> None:
        """Record one answered request on its span and in the metrics; ends the span."""
        if self.metrics is not None:
            self.metrics.http_request(endpoint, status, time.perf_counter() - started_s)
        if span is None:
            return
        span.set_attribute("http.response.status_code", status)
        if call is not None:
            span.set_attribute("oserve.request_id", call.response_id)
            span.set_attribute("gen_ai.request.max_tokens", call.max_tokens)
            span.set_attribute("gen_ai.response.id", call.response_id)
        if reply is not None and call is not None:
            span.set_attribute("gen_ai.usage.input_tokens", reply.input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", reply.output_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [self._finish_reason(call, reply)])
        if error is not None:
            span.set_attribute("error.type", error.code or error.type)
            span.set_status(Status(StatusCode.ERROR, error.message))
        span.end()

    async def _serve_call(self, kind: Literal["completion", "chat"], request: Request) -> Response:
        self.num_requests += 1
        started_s, endpoint = time.perf_counter(), request.url.path
        span = self._start_span(kind, request)
        if self.num_inflight >= self.config.max_concurrent_requests:
            self.num_errors += 1
            error = APIError(429, f"{self.num_inflight} requests in flight at this server; retry later",
                             "rate_limit_error", code=ErrorCode.OVERLOADED)
            self._finished(span, endpoint, started_s, 429, error=error)
            return error.response()
        self.num_inflight += 1
        handed_over = False  # a stream releases its slot (and ends its span) when its generator ends
        call: _Call | None = None
        current = trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext()
        try:
            call = self._parse(kind, await self._read_json(request))
            payload = encode(call.request)
            if len(payload) > MAX_MESSAGE_BYTES:
                raise APIError(400, f"the prompt is too long: its request is {len(payload)} bytes, the limit is "
                                    f"{MAX_MESSAGE_BYTES}", param="messages" if kind == "chat" else "prompt",
                               code="context_length_exceeded")
            if not call.stream:
                try:
                    with current:  # the client's publish span is a child of the HTTP span
                        reply = await self.client.submit_raw(payload, call.response_id)
                except ClientError as exc:
                    raise api_error(exc) from None
                assert isinstance(reply, Reply)
                self._finished(span, endpoint, started_s, 200, call=call, reply=reply)
                return JSONResponse(self._whole(call, reply))
            events = self.client.stream_raw(payload, call.response_id)
            try:
                with current:
                    first = await anext(events)  # errors before the first part still get their HTTP status
            except ClientError as exc:
                await events.aclose()
                raise api_error(exc) from None
            handed_over = True
            return _EventStream(self._sse(call, first, events, span, started_s, endpoint),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": call.response_id})
        except APIError as exc:
            self.num_errors += 1
            self._finished(span, endpoint, started_s, exc.status, call=call, error=exc)
            return exc.response()
        except BaseException as exc:  # recorded, then left to the app's outermost handler (a 500) or to cancel
            error = _client_closed() if isinstance(exc, asyncio.CancelledError) else \
                APIError(500, type(exc).__name__, "server_error", code=ErrorCode.INTERNAL)
            self._finished(span, endpoint, started_s, error.status, call=call, error=error)
            raise
        finally:
            if not handed_over:
                self.num_inflight -= 1

    # --- answers -----------------------------------------------------------------------------------

    @staticmethod
    def _finish_reason(call: _Call, reply: Reply) -> str:
        return "length" if reply.output_tokens >= call.max_tokens else "stop"

    @staticmethod
    def _usage(reply: Reply) -> dict[str, int]:
        return {"prompt_tokens": reply.input_tokens, "completion_tokens": reply.output_tokens,
                "total_tokens": reply.input_tokens + reply.output_tokens}

    def _whole(self, call: _Call, reply: Reply) -> dict[str, Any]:
        """A non-streamed answer in OpenAI's shape. Pure but for the time."""
        reason = self._finish_reason(call, reply)
        if call.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": call.response_id, "object": obj, "created": int(time.time()), "model": self.config.model_name,
                "choices": [choice], "usage": self._usage(reply)}

    def _chunk(self, call: _Call, created: int, text: str | None, reason: str | None,
               role: bool = False) -> dict[str, Any]:
        """One SSE chunk in OpenAI's shape. Pure."""
        if call.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": call.response_id, "object": obj, "created": created, "model": self.config.model_name,
                "choices": [choice]}

    async def _sse(self, call: _Call, first: ReplyChunk | Reply, events: AsyncIterator[ReplyChunk | Reply],
                   span: Span | None = None, started_s: float = 0.0, endpoint: str = "") -> AsyncIterator[bytes]:
        """The event stream of one streamed answer: its chunks, a last one with the finish reason, the usage
        when asked, then `[DONE]`. An error after the first event is sent as an `error` event. Its end
        ends the request's span and records it: 200 once the answer ended; a failure mid-way with its
        error's status and type (the headers went out as 200 before it); a client gone before the end as
        499 `client_closed`. Closing it closes `events`, which cancels the request on the bus."""
        created = int(time.time())
        last: Reply | None = None
        failure: APIError | None = None
        try:
            if call.kind == "chat":
                yield _sse(self._chunk(call, created, "", None, role=True))
            part: ReplyChunk | Reply | None = first
            while part is not None:
                if isinstance(part, Reply):
                    last = part
                    yield _sse(self._chunk(call, created, None, self._finish_reason(call, part)))
                    if call.include_usage:
                        yield _sse({"id": call.response_id, "object": self._chunk(call, created, None, None)["object"],
                                    "created": created, "model": self.config.model_name, "choices": [],
                                    "usage": self._usage(part)})
                    break
                if part.text:
                    yield _sse(self._chunk(call, created, part.text, None))
                try:
                    part = await anext(events)
                except StopAsyncIteration:
                    part = None
                except ClientError as exc:
                    self.num_errors += 1
                    failure = api_error(exc)
                    yield _sse(failure.body())
                    break
            yield b"data: [DONE]\n\n"
        finally:
            self.num_inflight -= 1
            error = None if last is not None else failure or _client_closed()  # none of them: the client went away
            self._finished(span, endpoint, started_s, 200 if error is None else error.status, call=call, reply=last,
                           error=error)
            await events.aclose()  # type: ignore[attr-defined]
