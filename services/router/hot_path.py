"""The short way through the router for its two hot endpoints, and a leaner SSE response.

    app.add_middleware(HotPath, handlers={"/v1/completions": completions_from_bytes, ...})

FastAPI's route machinery (middleware layers, dependency solving, the endpoint's task group) costs
a few hundred microseconds per request, a sizeable part of the router's budget (issue #6: under
2 ms at p50). `HotPath` takes a JSON POST to a hot endpoint, reads its body and hands the bytes to
the endpoint's handler, which parses and validates them exactly as FastAPI would (`json.loads`,
then the pydantic model) and answers with the same response objects. Whatever the handler does
not take (a body that does not parse or validate, another content type) goes on to the FastAPI app
with the body replayed, so every error body stays the one FastAPI's handlers produce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A handler answers the request from its raw body, or returns None to leave it to the FastAPI app.
Handler = Callable[[bytes], Awaitable[Response | None]]


class HotPath:
    """Pure ASGI middleware: POST + `application/json` to a path in `handlers` skips the rest of
    the stack unless its handler declines."""

    def __init__(self, app: ASGIApp, handlers: Mapping[str, Handler]) -> None:
        self.app = app
        self.handlers = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (self.handlers.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before sending its body
            return
        response = await handler(body)
        if response is None:
            await self.app(scope, _replay(body, receive), send)
            return
        await response(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _read_body(receive: Receive) -> bytes | None:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first gives back the body already read."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


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
