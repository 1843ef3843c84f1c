"""The router's edge under bad input: a 20 MB body gets 413 while other streams keep flowing, a
prompt that cannot fit is refused before it is tokenized, long prompts are tokenized off the
event loop with the same result, text the tokenizer refuses (a lone surrogate) is a 400, and
clients that send half a request are answered 408 and dropped."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"


@pytest.fixture(scope="module")
def router(workers: dict[str, WorkerServer], model_dir: Path) -> Iterator[ServedRouter]:
    config = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                          dispatch=DispatchOptions(decode=(workers["colocated"].target,)),
                          header_timeout_s=0.5, body_timeout_s=0.5, inline_bytes=16)
    with ServedRouter(config) as served:
        yield served


async def stream_gaps(http: httpx.AsyncClient, started: asyncio.Event) -> list[float]:
    """The gaps between the events of one long stream (which must end by its length)."""
    gaps, last, finish = [], time.perf_counter(), None
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                started.set()
                if line != "data: [DONE]":
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    return gaps[1:]


@in_module_loop
async def test_a_20_mb_body_gets_413_and_other_streams_keep_flowing(router: ServedRouter) -> None:
    big = json.dumps({"model": MODEL, "prompt": "a" * (20 * 2**20), "max_tokens": 4}).encode()
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        started = asyncio.Event()
        flowing = asyncio.create_task(stream_gaps(http, started))
        await asyncio.wait_for(started.wait(), 30)
        sized = await http.post("/v1/completions", content=big, headers={"content-type": "application/json"})

        async def chunks() -> object:
            for i in range(0, len(big), 2**20):
                yield big[i:i + 2**20]

        chunked = await http.post("/v1/completions", content=chunks(),
                                  headers={"content-type": "application/json"})
        gaps = await asyncio.wait_for(flowing, 60)
    for response in (sized, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    assert max(gaps) < 1.0, max(gaps)  # a 20 MB prompt tokenized on the event loop stalled it ~11 s


@in_module_loop
async def test_prompts_that_cannot_fit_are_refused_before_tokenizing(router: ServedRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        start = time.perf_counter()
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 1_000_000})
        assert time.perf_counter() - start < 2.0
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "cannot fit" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "word " * 1_000_000}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@in_module_loop
async def test_prompts_tokenized_in_the_pool_give_the_inline_result(router: ServedRouter,
                                                                   model_dir: Path) -> None:
    from engine.model.loader import load_tokenizer

    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # over inline_bytes: the pool
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(load_tokenizer(model_dir)(prompt).input_ids)


@in_module_loop
async def test_text_the_tokenizer_refuses_is_a_400_never_a_500(router: ServedRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        for text in (r"a\ud800b", r"a\ud800b" + "x" * 40):  # JSON escapes of a lone surrogate
            for path, body in (
                    ("/v1/chat/completions",
                     '{"model": "tiny", "messages": [{"role": "user", "content": "' + text + '"}]}'),
                    ("/v1/completions", '{"model": "tiny", "prompt": "' + text + '"}')):
                r = await http.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["param"] in ("messages", "prompt"), r.text
        for path, body in (  # in the model field: a 400 naming it (was a bare 500)
                ("/v1/chat/completions",
                 '{"model": "ti\\ud800ny", "messages": [{"role": "user", "content": "hi"}]}'),
                ("/v1/completions", '{"model": "ti\\ud800ny", "prompt": "hi"}'),
                ("/tokenize", '{"model": "ti\\ud800ny", "prompt": "hi"}')):
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == "model" and "lone surrogate" in r.json()["error"]["message"]
        salted = '{"model": "tiny", "prompt": "hi", "cache_salt": "a\\ud800"}'  # any field: was a 500 too
        r = await http.post("/v1/completions", content=salted, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def raw(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Sends `data` on a new connection; returns what came back until the server closed it."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    return got, time.perf_counter() - start


@pytest.mark.parametrize("data", [
    b"",  # connected, nothing sent
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",  # half a header
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n{\"model\":",  # half a body
], ids=["nothing", "partial-header", "partial-body"])
def test_clients_that_send_half_a_request_get_408_and_are_dropped(router: ServedRouter, data: bytes) -> None:
    got, took = raw(router.port, data, wait_s=10)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert took < 5.0
    with httpx.Client(base_url=router.url, timeout=10) as http:  # the router is fine
        assert http.get("/livez").status_code == 200


@in_module_loop
async def test_an_oversized_chunked_body_is_a_413_whatever_the_content_type_or_key(
        workers: dict[str, WorkerServer], model_dir: Path) -> None:
    config = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, api_keys=("k",),
                          dispatch=DispatchOptions(decode=(workers["colocated"].target,)))

    async def chunks() -> object:
        for _ in range(10):
            yield b"x" * 2**20

    with ServedRouter(config) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30,
                                     headers={"authorization": "Bearer k"}) as http:
            for content_type in ("application/json", "text/plain"):
                r = await http.post("/v1/completions", content=chunks(),
                                    headers={"content-type": content_type})
                assert r.status_code == 413, (content_type, r.text)

            async def small() -> object:  # a chunked body under the limit reaches the app whole
                body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
                yield body[:10]
                yield body[10:]

            r = await http.post("/v1/completions", content=small(),
                                headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_kept_alive_connection_gets_408_for_a_half_sent_second_request(router: ServedRouter) -> None:
    first = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
    got, took = raw(router.port, first + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", wait_s=10)
    assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got, got[:400]
    assert took < 5.0


def test_a_connection_answered_before_its_body_arrived_closes_once_idle(router: ServedRouter) -> None:
    headers = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % (9 * 2**20))
    got, took = raw(router.port, headers + b"x" * (9 * 2**20), wait_s=20)
    assert got.startswith(b"HTTP/1.1 413") and took < 15.0, (got[:200], took)
