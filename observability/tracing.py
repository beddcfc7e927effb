"""OpenTelemetry tracing for the live pipeline: provider setup by config, W3C trace context in NATS headers.

One request is one trace: the client's publish (CLIENT span) -> the gateway's routing (CONSUMER span,
child of the client's) -> the engine's handling up to its reply (CONSUMER span, child of the gateway's).
The context travels as a `traceparent` header (W3C trace context) through the propagator; header dicts
are always copied before they are handed on, because `js.publish` and friends mutate their argument.

Workers take a `Tracer | None`: None means no spans at all (the fast path), but an incoming
`traceparent` is still passed on unchanged so a traced client keeps one trace across untraced hops.

Conventions. Each worker's spans come from a tracer provider of its own, so each worker is a service of
its own in Jaeger: `service.name` is `{stem}-{worker}` (`oserve-gateway`, `oserve-engine`,
`oserve-forecaster`, `oserve-scheduler`, `oserve-switch-planner`), `service.namespace` is `oserve`, with
`service.version` and a `service.instance.id` per provider; the providers of one process share one
span processor and exporter (`TracingSetup.tracer_for`). Spans on the bus carry the messaging
conventions (`messaging_attributes`: `messaging.system=nats`, the subject, the operation type, the
message id and body size) and are named "{operation} {subject}"; the engine's span of a request is the
GenAI inference span, "{gen_ai.operation.name} {gen_ai.request.model}" with `gen_ai.*` attributes.
Every span keeps its `oserve.*` attributes; `oserve.step` names the pipeline step (`gateway.route`,
`engine.serve`, ...) whatever the span's conventional name. No secret goes into an attribute: subjects,
ids, counts and model names only.

The standard environment variables are read by `TracingConfig.from_env` (the CLI calls it; nothing here
reads the environment by itself): `OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
`OTEL_TRACES_SAMPLER_ARG`, `OTEL_SDK_DISABLED`; a command-line flag given explicitly wins over them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal, Mapping, get_args
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from oserve import __version__
from oserve.errors import ConfigError

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_propagator = TraceContextTextMapPropagator()

Exporter = Literal["none", "console", "otlp", "memory", "file"]
EXPORTERS: tuple[str, ...] = get_args(Exporter)
SAMPLERS: tuple[str, ...] = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
                             "parentbased_always_off", "parentbased_traceidratio")
"""`OTEL_TRACES_SAMPLER` values understood (the specification's built-in samplers)."""
DEFAULT_OTLP_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
SERVICE_NAMESPACE = "oserve"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go, and what the services that make them are called."""

    exporter: Exporter = "none"
    """`otlp` (HTTP, e.g. Jaeger's :4318), `file` (OTLP JSON lines at `file_path`), `console`, `memory`
    (tests) or `none`."""
    otlp_endpoint: str = DEFAULT_OTLP_ENDPOINT
    """OTLP/HTTP traces endpoint, used when exporter is `otlp`."""
    file_path: str = "traces.jsonl"
    """Where the `file` exporter appends its spans."""
    service_name: str = "oserve"
    """The stem of each worker's `service.name`: `{stem}-{worker}` (`oserve-gateway`); spans made by no
    worker (`TracingSetup.tracer`: a client, a test) carry the stem itself."""
    service_name_is_stem: bool = True
    """False: `service_name` is the service.name of every span as it is (`OTEL_SERVICE_NAME` in a process
    that runs one worker)."""
    service_namespace: str = SERVICE_NAMESPACE
    resource_attributes: tuple[tuple[str, str], ...] = ()
    """More resource attributes (`OTEL_RESOURCE_ATTRIBUTES`); they win over OServe's own but service.name."""
    sampler: str = "parentbased_always_on"
    """One of `SAMPLERS` (`OTEL_TRACES_SAMPLER`): the default keeps every trace."""
    sampler_ratio: float = 1.0
    """Fraction of traces kept by the `traceidratio` samplers (`OTEL_TRACES_SAMPLER_ARG`)."""

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"TracingConfig.exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"TracingConfig.sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if not 0.0 <= self.sampler_ratio <= 1.0:
            raise ConfigError(f"TracingConfig.sampler_ratio must be in [0, 1], got {self.sampler_ratio}")
        if not self.service_name:
            raise ConfigError("TracingConfig.service_name must not be empty")

    def service_name_for(self, worker: str | None) -> str:
        """The `service.name` of a worker's spans (None: of spans made by no worker). Pure."""
        if worker is None or not self.service_name_is_stem:
            return self.service_name
        return f"{self.service_name}-{worker}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, exporter: str | None = None, otlp_endpoint: str | None = None,
                 num_workers: int = 0, **fields) -> TracingConfig:
        """A config from the standard `OTEL_*` variables in `env`; `exporter` and `otlp_endpoint`, when given
        (a flag set on the command line), win over them. Pure (reads only `env`).

        - exporter: `exporter`, else `OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`), else `otlp` when
          an OTLP endpoint variable is set, else `none`; `OTEL_SDK_DISABLED=true` means `none`.
        - endpoint: `otlp_endpoint`, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, else
          `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces` (the specification's rule for OTLP/HTTP).
        - `OTEL_SERVICE_NAME` (else `service.name` in `OTEL_RESOURCE_ATTRIBUTES`): the service.name itself
          in a process that runs one worker (`num_workers == 1`), else the stem of every worker's name
          (`{name}-gateway`, ...), since several workers in one process are still several services.
        - `OTEL_RESOURCE_ATTRIBUTES`: added to every provider's resource (`k=v,k2=v2`, percent-encoded).
        - `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`: one of `SAMPLERS`, and its ratio.
        - `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: only `http/protobuf` (the
          exporter installed); `grpc` or `http/json` is refused, rather than sending OTLP/HTTP to a port
          that speaks gRPC and losing every span.
        """
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                    or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip())
        if protocol and protocol != "http/protobuf":
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: OServe exports traces over OTLP/HTTP with protobuf "
                              f"(http/protobuf) only, got {protocol!r}; point the endpoint at the collector's "
                              f"OTLP/HTTP port (4318)")
        attrs = _parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        service_name = env.get("OTEL_SERVICE_NAME", "").strip() or attrs.pop("service.name", "")
        attrs.pop("service.name", None)
        traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        base_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if not otlp_endpoint:
            otlp_endpoint = traces_endpoint or (base_endpoint.rstrip("/") + "/v1/traces" if base_endpoint else "")
        if not exporter:
            names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
            if len(names) > 1:
                raise ConfigError(f"OTEL_TRACES_EXPORTER: one exporter at a time, got {names}")
            if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
                exporter = "none"
            elif names:
                if names[0] not in ("otlp", "console", "none"):
                    raise ConfigError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {names[0]!r}")
                exporter = names[0]
            else:
                exporter = "otlp" if traces_endpoint or base_endpoint else "none"
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        if sampler:
            fields["sampler"] = sampler
        ratio = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        if ratio and "ratio" in fields.get("sampler", ""):
            try:
                fields["sampler_ratio"] = float(ratio)
            except ValueError:
                raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {ratio!r}") from None
        if service_name:
            fields["service_name"] = service_name
            fields["service_name_is_stem"] = num_workers != 1
        return cls(exporter=exporter, otlp_endpoint=otlp_endpoint or DEFAULT_OTLP_ENDPOINT,  # type: ignore[arg-type]
                   resource_attributes=tuple(sorted(attrs.items())), **fields)


def _parse_resource_attributes(text: str) -> dict[str, str]:
    """`OTEL_RESOURCE_ATTRIBUTES` (`k=v,k2=v2`, values percent-encoded) as a dict. Pure."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"OTEL_RESOURCE_ATTRIBUTES: {item!r} is not key=value")
        out[key.strip()] = unquote(value.strip())
    return out


def _sampler(config: TracingConfig) -> Sampler:
    name = config.sampler
    root = ALWAYS_OFF if name.endswith("always_off") else \
        TraceIdRatioBased(config.sampler_ratio) if name.endswith("traceidratio") else ALWAYS_ON
    return ParentBased(root) if name.startswith("parentbased_") else root


_OTLP_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(value):
    """OTLP/JSON's one departure from protobuf's JSON mapping: trace and span ids are hex, not base64. Pure."""
    import base64

    if isinstance(value, list):
        return [_hex_ids(v) for v in value]
    if not isinstance(value, dict):
        return value
    return {k: base64.b64decode(v).hex() if k in _OTLP_ID_KEYS and isinstance(v, str) else _hex_ids(v)
            for k, v in value.items()}


class OTLPJsonFileExporter(SpanExporter):
    """Spans as OTLP/JSON, one `ExportTraceServiceRequest` per line (lowerCamelCase fields, enums as
    integers, ids in hex): the format of the OpenTelemetry Collector's file exporter, which the
    Collector's `otlpjsonfile` receiver reads back and forwards to Jaeger."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in shutdown)

    def export(self, spans) -> SpanExportResult:
        import json

        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        if self._file.closed:
            return SpanExportResult.FAILURE
        body = _hex_ids(MessageToDict(encode_spans(spans), use_integers_for_enums=True))
        self._file.write(json.dumps(body, separators=(",", ":")) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


@dataclass(frozen=True, slots=True, eq=False)
class TracingSetup:
    """What `setup_tracing` built; `tracer` (and every `tracer_for`) is None when exporting nothing."""

    provider: TracerProvider | None
    """The provider of spans made by no worker (service.name: the stem)."""
    tracer: Tracer | None
    exporter: SpanExporter | None
    config: TracingConfig = field(default_factory=TracingConfig)
    processor: SpanProcessor | None = None
    """The one span processor every provider of this setup hands its spans to."""
    providers: dict[str, TracerProvider] = field(default_factory=dict)
    """service.name -> its provider, made on first use by `tracer_for`."""

    def tracer_for(self, worker: str) -> Tracer | None:
        """The tracer of one worker (`gateway`, `engine`, ...): spans of service `{stem}-{worker}`."""
        if self.processor is None:
            return None
        name = self.config.service_name_for(worker)
        provider = self.providers.get(name)
        if provider is None:
            provider = self.providers[name] = _provider(self.config, name, self.processor)
        return provider.get_tracer(f"oserve.workers.{worker}", __version__)

    def shutdown(self) -> None:
        """Flush and close the exporter once (every provider shares it)."""
        if self.processor is not None:
            self.processor.shutdown()


def _provider(config: TracingConfig, service_name: str, processor: SpanProcessor) -> TracerProvider:
    attrs = {"service.namespace": config.service_namespace, "service.version": __version__,
             "service.instance.id": str(uuid.uuid4()), **dict(config.resource_attributes)}
    attrs["service.name"] = service_name  # the worker's, whatever OTEL_RESOURCE_ATTRIBUTES says (see from_env)
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource, sampler=_sampler(config), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider


def setup_tracing(config: TracingConfig, *, component: str = "oserve") -> TracingSetup:
    """Build the span processor and exporter for `config`, and the provider of spans made by no worker
    (not installed globally: callers pass the tracers on; `tracer_for` gives each worker its own)."""
    if config.exporter == "none":
        return TracingSetup(None, None, None, config)
    exporter: SpanExporter
    processor: SpanProcessor
    if config.exporter == "memory":
        exporter = InMemorySpanExporter()
        processor = SimpleSpanProcessor(exporter)
    elif config.exporter == "console":
        exporter = ConsoleSpanExporter()
        processor = SimpleSpanProcessor(exporter)
    elif config.exporter == "file":
        exporter = OTLPJsonFileExporter(config.file_path)
        processor = BatchSpanProcessor(exporter)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        processor = BatchSpanProcessor(exporter)
    provider = _provider(config, config.service_name_for(None), processor)
    return TracingSetup(provider, provider.get_tracer(component), exporter, config, processor,
                        {config.service_name_for(None): provider})


def inject(span: Span | None, headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """A new header dict: a copy of `headers` with `span`'s context as traceparent (if span is given)."""
    out = dict(headers) if headers else {}
    if span is not None:
        _propagator.inject(out, context=trace.set_span_in_context(span))
    return out


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent context carried in NATS headers, or None when there is none."""
    if not headers or TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers)


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """Just the trace-context headers of `headers`, copied (for handing on without a local span)."""
    if not headers or TRACEPARENT not in headers:
        return None
    out = {TRACEPARENT: headers[TRACEPARENT]}
    if TRACESTATE in headers:
        out[TRACESTATE] = headers[TRACESTATE]
    return out


def messaging_attributes(subject: str, operation_type: str, operation_name: str, *, message_id: str = "",
                         body_size_bytes: int | None = None) -> dict[str, str | int]:
    """The messaging semantic conventions' attributes of one NATS message. Pure.

    `operation_type` is the convention's (`send`, `receive`, `process`; `publish` is its deprecated
    name for `send`), `operation_name` NATS's own (`publish`, `request`, `process`), which also names the
    span: `messaging_span_name`.
    """
    out: dict[str, str | int] = {"messaging.system": "nats", "messaging.destination.name": subject,
                                 "messaging.operation.type": operation_type,
                                 "messaging.operation.name": operation_name}
    if message_id:
        out["messaging.message.id"] = message_id
    if body_size_bytes is not None:
        out["messaging.message.body.size"] = body_size_bytes
    return out


def messaging_span_name(operation_name: str, subject: str) -> str:
    """"{operation} {destination}", the messaging conventions' span name. Pure."""
    return f"{operation_name} {subject}"


GEN_AI_PROVIDER = "oserve"
"""`gen_ai.provider.name` (the current name of the deprecated `gen_ai.system`): the system serving."""


def genai_span_name(operation: str, model: str) -> str:
    """"{gen_ai.operation.name} {gen_ai.request.model}", the GenAI conventions' span name. Pure."""
    return f"{operation} {model}" if model else operation
