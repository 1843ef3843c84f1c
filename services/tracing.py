"""Request traces with OpenTelemetry: one span tree per request across the router and the
workers, joined by W3C `traceparent` (HTTP headers from the client, gRPC metadata to workers).

Tracing is on in a process when an OTLP endpoint is configured, by the standard variables
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`) or vLLM's
`--otlp-traces-endpoint`; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off.
The protocol is `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`):
`grpc` (the default, as vLLM's) or `http/protobuf`. The SDK reads the rest itself
(`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_*`,
`OTEL_TRACES_SAMPLER`, ...). Spans leave in batches from a thread of the SDK's own.

Off, nothing is set up: `tracer()` is None and every call site checks that first (one `if`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_tracer: Tracer | None = None
_provider: Any = None


def endpoint_from_env(explicit: str | None = None) -> str | None:
    """The OTLP endpoint traces go to (None: tracing off)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return None
    return (explicit or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def setup(service_name: str, explicit_endpoint: str | None = None) -> Tracer | None:
    """Starts exporting this process's spans when an endpoint is configured; returns the tracer
    (None: off). `service_name` unless OTEL_SERVICE_NAME says otherwise."""
    global _tracer, _provider
    endpoint = endpoint_from_env(explicit_endpoint)
    if endpoint is None:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # TLS or not: the SDK's rule (OTEL_EXPORTER_OTLP_*INSECURE, else an http:// scheme)
        exporter = OTLPSpanExporter(endpoint=endpoint)
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        path = endpoint if explicit_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") \
            else endpoint.rstrip("/") + "/v1/traces"  # (a base endpoint gets the signal's path)
        exporter = HTTPSpanExporter(endpoint=path)
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not grpc or "
                         "http/protobuf")
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(_provider)
    _tracer = trace.get_tracer("pdserve")
    logger.warning("tracing: spans of %s go to %s (%s)", service_name, endpoint, protocol)
    return _tracer


def tracer() -> Tracer | None:
    return _tracer


OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current one around a block (None when tracing is off: a shared
    no-op context). Not across a yield of an async generator."""
    if _tracer is None:
        return OFF
    return _tracer.start_as_current_span(name)


def shutdown() -> None:
    """Sends the spans still held (at most a few seconds)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def context_from(carrier: Mapping[str, str]) -> Context:
    """The W3C trace context in `carrier` (the client's `traceparent`; none: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    """From ASGI headers."""
    carrier = {}
    for name, value in headers:
        if name in (b"traceparent", b"tracestate"):
            carrier[name.decode()] = value.decode("latin-1")
    return context_from(carrier)


def context_from_metadata(metadata: Sequence[Any] | None) -> Context:
    """From gRPC invocation metadata."""
    carrier = {m.key: m.value for m in metadata or () if m.key in (TRACEPARENT, TRACESTATE)}
    return context_from(carrier)


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata (nothing when tracing is off)."""
    if _tracer is None:
        return ()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return tuple(carrier.items())


def ns(seconds: float) -> int:
    """A time.time() timestamp as the nanoseconds spans take."""
    return int(seconds * 1e9)
