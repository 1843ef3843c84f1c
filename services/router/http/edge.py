"""The router's edge: what reaches the app, and how long a client may take to send it.

- `BodyLimit` (ASGI middleware): a body over `max_bytes` gets 413 in OpenAI's error format (by
  its Content-Length before anything is read, or as soon as a chunked body passes the limit);
  the app never sees more than `max_bytes`. The rest of the body is read and dropped by the
  server (closing at once would reset the connection under a client still sending, and it
  would never read its 413), within the body timeout.
- `GuardedProtocol` (uvicorn's httptools protocol): a request's headers must be complete within
  `header_timeout_s` of its first byte (a new connection: of connecting), and its body within
  `body_timeout_s` of its headers; else 408 and the connection closes. Idle keep-alive
  connections close after uvicorn's keep-alive timeout. Slow-loris clients hold nothing long.
- `serve(app, config, host, port)`: uvicorn on a socket bound here, exclusively (a taken port is a
  PortInUseError naming it and the router, before anything starts), or on one a launcher holds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvstore.ports import listen
from services.router.api.openai_models import error_body
from services.router.config import RouterConfig


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:  # the server delivers no more than Content-Length says
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._too_large(send)
            else:
                await self.app(scope, receive, send)
            return
        # A chunked body: read (at most max_bytes + 1) here, then replay it to the app.
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.max_bytes} bytes",
                                     "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


_TIMEOUT_BODY = json.dumps(error_body("request not received in time", "invalid_request_error", None,
                                      "request_timeout")).encode()
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: " + str(len(_TIMEOUT_BODY)).encode()
                     + b"\r\n\r\n" + _TIMEOUT_BODY)


class GuardedProtocol(HttpToolsProtocol):
    """See the module docstring; `protocol_class(config)` sets the timeouts. `_phase` is what the
    request being read still owes: its "headers", its "body", or nothing (None)."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase = "headers"
        self._arm(self.header_timeout_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "headers"
        self._arm(self.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._phase = "body"
        self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = None
        self._disarm()
        cycle = self.cycle
        if (cycle is not None and cycle.response_complete and not self.pipeline
                and self.timeout_keep_alive_task is None and not self.transport.is_closing()):
            # Answered before its body was in (413, 401): the bytes that came since cancelled
            # uvicorn's keep-alive timer; the connection is idle now.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._may_answer():
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()

    def _may_answer(self) -> bool:
        """Whether a 408 can be written: no other response is on the wire, and none for this
        request has started."""
        if self.pipeline:  # an earlier request's response is still in progress
            return False
        cycle = self.cycle
        if self._phase == "headers":  # `cycle` is the previous request's, if any
            return cycle is None or cycle.response_complete
        return self._phase == "body" and cycle is not None and not cycle.response_started


def protocol_class(config: RouterConfig) -> type[GuardedProtocol]:
    return type("RouterProtocol", (GuardedProtocol,), {"header_timeout_s": config.header_timeout_s,
                                                       "body_timeout_s": config.body_timeout_s})


def uvicorn_config(app: ASGIApp, config: RouterConfig, log_level: str = "warning",
                   **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(app, http=protocol_class(config), log_level=log_level, lifespan="on", **kwargs)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that no one else listens on (no SO_REUSEPORT)."""
    sock = listen(host, port, "router")
    sock.setblocking(False)
    return sock


def serve(app: ASGIApp, config: RouterConfig, host: str, port: int, log_level: str = "warning",
          fd: int | None = None) -> None:
    """Runs the router until SIGINT / SIGTERM (uvicorn's handling), on host:port or on the
    listening socket `fd` a launcher passed down (it keeps the port open while the router
    restarts: clients that connect meanwhile wait in the backlog instead of being refused)."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
    else:
        sock = bind(host, port)
    server = uvicorn.Server(uvicorn_config(app, config, log_level))
    # uvicorn sends itself the signal that stopped it again once it has shut down, to the
    # handler in place before it ran: the default one would end the process there, before its
    # closing line. These handlers only note it (uvicorn's own handle the signals meanwhile).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
