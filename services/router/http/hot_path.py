"""The short way through the router for its two hot endpoints, and a leaner SSE response.

    app.add_middleware(HotPath, handlers={"/v1/completions": completions_from_bytes, ...})

FastAPI's route machinery (middleware layers, dependency solving, the endpoint's task group) costs
a few hundred microseconds per request, a sizeable part of the router's budget (under 2 ms at
p50), and FastAPI parses a body on the event loop whatever its size. `HotPath` takes every POST
to a hot endpoint, reads its body and hands the bytes to the endpoint's handler, which parses and
validates them as FastAPI would (JSON, then the pydantic model; errors are the same 400s) where
it chooses (a large body off the loop: services/router/prepare.py). As FastAPI, it reads a body
without a Content-Type, or with application/json or application/*+json, as JSON; any other
content type is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.errors import OpenAIError

# A handler answers the request from its raw body (and its scope: who sent it).
Handler = Callable[[bytes, Scope], Awaitable[Response]]


class HotPath:
    """Pure ASGI middleware: a POST to a path in `handlers` skips the rest of the stack."""

    def __init__(self, app: ASGIApp, handlers: Mapping[str, Handler]) -> None:
        self.app = app
        self.handlers = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (self.handlers.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before sending its body
            return
        if _is_json(scope):
            response = await handler(body, scope)
        else:
            response = OpenAIError(400, "the request body must be JSON (Content-Type: "
                                        "application/json)").response()
        await response(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    """No Content-Type, application/json or application/*+json (what FastAPI parses as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind in (b"", b"application/json") or (kind.startswith(b"application/")
                                                     and kind.endswith(b"+json"))
    return True


async def _read_body(receive: Receive) -> bytes | None:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that watches for the client leaving with one plain asyncio task, not an
    anyio task group (servers on ASGI spec < 2.4, uvicorn among them, need a watcher). A client
    that leaves cancels the streaming, whose generators then cancel their worker calls."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        streaming = asyncio.current_task()
        assert streaming is not None
        state = {"done": False, "left": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["done"]:
                state["left"] = True
                streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["left"]:
                raise
            streaming.uncancel()
        finally:
            state["done"] = True
            watcher.cancel()
        if self.background is not None:
            await self.background()
