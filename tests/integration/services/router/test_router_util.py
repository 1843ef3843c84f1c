"""The tests' served router survives a port taken between `free_port` and its bind (seen once
under make test's two processes: every test of a module erred with "router thread died")."""

from __future__ import annotations

import socket

import httpx
import pytest

from services.procs import free_port
from tests.integration.services import router_util
from tests.integration.services.router_util import ServedRouter


async def hello(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    if scope["type"] == "lifespan":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"hi"})  # type: ignore[operator]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failed bind
def test_a_port_taken_before_the_bind_is_retried_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(router_util, "free_port", lambda: next(ports, None) or free_port())
    try:
        with ServedRouter(hello) as served:
            assert served.port != taken.getsockname()[1]
            assert httpx.get(served.url, timeout=10).text == "hi"
    finally:
        taken.close()
