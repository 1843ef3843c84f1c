"""The root span of every API request (services/tracing.py), installed only when tracing is on:
a SERVER span named after the method and path, in the client's trace when it sent a W3C
`traceparent` header, current while the request runs (its response streamed included), so the
router's spans of the request (tokenization, admission, each worker call) are its children."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class TraceRequests:
    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = tracing.context_from_headers(scope["headers"])
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span(
                name, context=parent, kind=SpanKind.SERVER,
                attributes={"http.request.method": scope["method"], "url.path": scope["path"]}) as span:
            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, sending)
