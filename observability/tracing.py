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
from typing import Literal, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from oserve.errors import ConfigError

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_propagator = TraceContextTextMapPropagator()

Exporter = Literal["none", "console", "otlp", "memory"]


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go."""

    exporter: Exporter = "none"
    """`otlp` (HTTP, e.g. Jaeger's :4318), `console`, `memory` (tests) or `none`."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """OTLP/HTTP traces endpoint, used when exporter is `otlp`."""
    service_name: str = "oserve"

    def __post_init__(self) -> None:
        if self.exporter not in ("none", "console", "otlp", "memory"):
            raise ConfigError(f"TracingConfig.exporter must be none, console, otlp or memory, got {self.exporter!r}")


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
