"""HotPath hands every POST of its paths to their handlers with the body and the scope (a body that
FastAPI would not read as JSON is a 400 in OpenAI's format), and everything else to the app;
SSEResponse stops streaming when the client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Scope

from services.router.http.hot_path import HotPath, SSEResponse


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/x")
    async def slow(body: dict[str, object]) -> dict[str, object]:
        return {"via": "fastapi", "body": body}

    async def fast(raw: bytes, scope: Scope) -> Response:
        return JSONResponse({"via": "hot", "body": json.loads(raw), "path": scope["path"]})

    app.add_middleware(HotPath, handlers={"/v1/x": fast})
    return app


@pytest.mark.asyncio
async def test_hot_path_takes_every_json_post_of_its_paths_and_refuses_other_content_types() -> None:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        hot = await client.post("/v1/x", json={"a": 1})
        assert hot.json() == {"via": "hot", "body": {"a": 1}, "path": "/v1/x"}
        charset = await client.post("/v1/x", content=b'{"a": 3}',
                                    headers={"content-type": "Application/JSON; charset=utf-8"})
        assert charset.json()["via"] == "hot"
        suffix = await client.post("/v1/x", content=b'{"a": 4}',
                                   headers={"content-type": "application/vnd.x+json"})
        assert suffix.json()["via"] == "hot"  # FastAPI reads application/*+json as JSON too
        bare = await client.send(client.build_request("POST", "/v1/x", content=b'{"a": 5}',
                                                      headers={"content-type": ""}))
        assert bare.json()["body"] == {"a": 5}
        text = await client.post("/v1/x", content=b'{"a": 6}', headers={"content-type": "text/plain"})
        assert text.status_code == 400
        assert "Content-Type: application/json" in text.json()["error"]["message"]
        assert (await client.get("/v1/x")).status_code == 405


@pytest.mark.asyncio
async def test_sse_response_stops_streaming_when_the_client_leaves() -> None:
    stopped, released = asyncio.Event(), asyncio.Event()
    sent: list[Message] = []
    leave = asyncio.Event()

    async def body() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            leave.set()
            await asyncio.sleep(60)  # a decode that would go on
            yield "data: 2\n\n"
        finally:
            stopped.set()

    async def release() -> None:
        released.set()

    async def receive() -> Message:
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    response = SSEResponse(body(), media_type="text/event-stream", background=BackgroundTask(release))
    await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=5)
    assert stopped.is_set() and released.is_set()
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: 1\n\n"]


@pytest.mark.asyncio
async def test_sse_response_finishes_without_cancelling_itself() -> None:
    finished = asyncio.Event()

    async def body() -> AsyncIterator[str]:
        yield "data: 1\n\n"

    async def receive() -> Message:  # the server reports the end once the response is complete
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()

    await SSEResponse(body())({"type": "http"}, receive, send)
    await asyncio.sleep(0.01)  # a late cancel from the watcher would land here
