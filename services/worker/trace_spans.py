"""A worker's spans of one request (services/tracing.py), made when the request ends, from the
engine's timestamps of it: the call itself (a child of the router's attempt, whose `traceparent`
rides in the gRPC metadata), then its queue, its computing steps, and the KV it loaded from or
saved to the store."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from services.tracing import ns

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

    from engine.outputs import RequestMetrics


def record(tracer: Tracer, role: str, call: str, parent: Context, start: float, request_id: str,
           metrics: RequestMetrics | None, error: str | None = None,
           attributes: dict[str, Any] | None = None) -> None:
    """`call` ("prefill" or "decode") on a worker of `role`, from `start` (time.time()) to now."""
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

    end = time.time()
    attrs: dict[str, Any] = {"pdserve.role": role, "pdserve.request_id": request_id,
                             **(attributes or {})}
    if metrics is not None:
        attrs.update({"gen_ai.usage.cached_tokens": metrics.num_cached_tokens,
                      "pdserve.preemptions": metrics.num_preemptions,
                      "pdserve.generated_tokens": metrics.num_generated_tokens})
    span = tracer.start_span(f"worker {call}", context=parent, kind=SpanKind.SERVER,
                             start_time=ns(start), attributes=attrs)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    if metrics is not None:
        ctx = set_span_in_context(span)

        def child(name: str, lo: float, hi: float, **kw: Any) -> None:
            if lo and hi and hi >= lo:
                tracer.start_span(name, context=ctx, start_time=ns(lo), attributes=kw).end(ns(hi))

        m = metrics
        child("queue", m.arrival_time, m.first_scheduled_time)
        if m.kv_load_bytes or m.kv_load_seconds:
            child("kv load", m.kv_load_end_time - m.kv_load_seconds, m.kv_load_end_time,
                  **{"pdserve.kv.bytes": m.kv_load_bytes, "pdserve.kv.ms": m.kv_load_seconds * 1e3})
        if call == "prefill":
            child("prefill steps", m.first_scheduled_time, m.first_token_time)
        else:
            child("first step", m.first_scheduled_time, m.first_token_time)
            child("decode steps", m.first_token_time, m.finished_time,
                  **{"pdserve.generated_tokens": m.num_generated_tokens})
        if m.kv_save_bytes:
            child("kv save", m.kv_save_end_time - m.kv_save_seconds, m.kv_save_end_time,
                  **{"pdserve.kv.bytes": m.kv_save_bytes, "pdserve.kv.ms": m.kv_save_seconds * 1e3})
    span.end(ns(end))
