"""The router's span of each worker call (services/tracing.py): a CLIENT span per prefill or
decode attempt, a child of the request's root span, whose context goes to the worker in the
call's gRPC metadata (the worker's spans are its children). Every function is a no-op (None)
when tracing is off."""

from __future__ import annotations

import contextlib
from typing import Any

from services import tracing


def start(call: str, worker: str, **attributes: Any) -> Any:
    """A started span for a `call` ("prefill" / "decode") attempt on `worker`; None when off."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    attrs = {"pdserve.worker": worker, **{f"pdserve.{k}": v for k, v in attributes.items()}}
    return tracer.start_span(call, kind=SpanKind.CLIENT, attributes=attrs)


def current(span: Any) -> contextlib.AbstractContextManager[Any]:
    """`span` current for a synchronous block (the call's start: its metadata takes the span's
    context). Never across a yield: async generators must not hold a context."""
    if span is None:
        return tracing.OFF
    from opentelemetry.trace import use_span

    return use_span(span, end_on_exit=False)


def end(span: Any, error: BaseException | None = None, **attributes: Any) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    for k, v in attributes.items():
        span.set_attribute(f"pdserve.{k}", v)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:300]))
    span.end()
