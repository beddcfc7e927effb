"""OpenTelemetry tracing for the live pipeline: provider setup by config, W3C trace context in NATS headers.

One request is one trace: the client's publish (CLIENT span) -> the gateway's routing (CONSUMER span,
child of the client's) -> the engine's handling up to its reply (CONSUMER span, child of the gateway's).
The context travels as a `traceparent` header (W3C trace context) through the propagator; header dicts
are always copied before they are handed on, because `js.publish` and friends mutate their argument.

Workers take a `Tracer | None`: None means no spans at all (the fast path), but an incoming
`traceparent` is still passed on unchanged so a traced client keeps one trace across untraced hops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, get_args

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from oserve.errors import ConfigError

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_propagator = TraceContextTextMapPropagator()

Exporter = Literal["none", "console", "otlp", "memory", "file"]
EXPORTERS: tuple[str, ...] = get_args(Exporter)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go."""

    exporter: Exporter = "none"
    """`otlp` (HTTP, e.g. Jaeger's :4318), `file` (OTLP JSON lines at `file_path`), `console`, `memory`
    (tests) or `none`."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """OTLP/HTTP traces endpoint, used when exporter is `otlp`."""
    file_path: str = "traces.jsonl"
    """Where the `file` exporter appends its spans."""
    service_name: str = "oserve"

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"TracingConfig.exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")


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


@dataclass(frozen=True, slots=True)
class TracingSetup:
    """What `setup_tracing` built; `tracer` is None when exporting nothing."""

    provider: TracerProvider | None
    tracer: Tracer | None
    exporter: SpanExporter | None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(config: TracingConfig, *, component: str = "oserve") -> TracingSetup:
    """Build a tracer provider for `config` (not installed globally: callers pass the tracer on)."""
    if config.exporter == "none":
        return TracingSetup(None, None, None)
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    exporter: SpanExporter
    if config.exporter == "memory":
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif config.exporter == "console":
        exporter = ConsoleSpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif config.exporter == "file":
        exporter = OTLPJsonFileExporter(config.file_path)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return TracingSetup(provider, provider.get_tracer(component), exporter)


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
