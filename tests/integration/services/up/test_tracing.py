"""Request traces through `pdserve up` (two decode workers, one prefill worker, the store) with
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set and the client's own `traceparent`: for a split request,
one prefilled locally by its decode worker, and one whose decode worker is killed mid-stream (it
migrates), the router's, the prefill worker's and the decode workers' spans land in the
client's trace with the right parents."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from services.procs import free_ports, stop_process
from tests.integration.services.otlp_collector import Collector, Span

ROOT = Path(__file__).resolve().parents[4]
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def up(tiny_model_dir: Callable[[str], Path], collector: Collector) -> Iterator[dict[str, Any]]:
    model = tiny_model_dir("llama")
    router, store, prefill, decode = free_ports(4)
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(router),
            "--kvstore-port", str(store), "--prefill-port", str(prefill), "--decode-port", str(decode),
            "--decode", "2", "--num-threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "512",
            "--startup-timeout-s", "180", "--metrics-port-offset", "0", "--router-liveness-port", "0",
            "--kv-events-port-offset", "0", "--local-prefill-tokens", "24", "--no-auth",
            "--stall-timeout-s", "3"]
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        assert proc.stdout is not None
        lines = []
        for _ in range(60):
            lines.append(proc.stdout.readline())
            if "pdserve is up" in lines[-1] or not lines[-1]:
                break
        assert "pdserve is up" in lines[-1], lines
        yield {"url": f"http://127.0.0.1:{router}", "model": str(model), "pid": proc.pid,
               "decode": [decode, decode + 1]}
    finally:
        stop_process(proc, timeout_s=60)


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{CLIENT_SPAN}-01"


def _by(spans: list[Span], service: str, name: str) -> list[Span]:
    return [s for s in spans if s.service == service and s.name == name]


def _check_worker(spans: list[Span], worker: Span, children: set[str]) -> None:
    kids = {s.name for s in spans if s.parent_id == worker.span_id}
    assert children <= kids, (worker.name, kids)


def _complete(up: dict[str, Any], prompt: list[int], traceparent: str, max_tokens: int) -> dict[str, Any]:
    r = httpx.post(f"{up['url']}/v1/completions", headers={"traceparent": traceparent}, timeout=120,
                   json={"model": up["model"], "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_split_request_is_one_trace_from_router_to_both_workers(up: dict[str, Any],
                                                                   collector: Collector) -> None:
    trace_id, parent = _traceparent()
    _complete(up, list(range(100, 180)), parent, 8)

    def ready(spans: list[Span]) -> bool:
        calls = {s.span_id for s in _by(spans, "pdserve-router", "decode")
                 if "pdserve.dropped" not in s.attributes}
        return bool(_by(spans, "pdserve-router", "POST /v1/completions")
                    and _by(spans, "pdserve-prefill", "worker prefill")
                    and any(s.parent_id in calls for s in _by(spans, "pdserve-decode", "worker decode")))

    spans = collector.wait_for(trace_id, ready)
    root = _by(spans, "pdserve-router", "POST /v1/completions")[0]
    assert root.parent_id == CLIENT_SPAN  # in the client's trace, under the client's span
    for name in ("tokenization", "admission"):
        assert _by(spans, "pdserve-router", name)[0].parent_id == root.span_id
    prefill_call = _by(spans, "pdserve-router", "prefill")[0]
    # the attempt that decoded (an early hand-off that fell back under load is a dropped one)
    decode_call = next(s for s in _by(spans, "pdserve-router", "decode")
                       if "pdserve.dropped" not in s.attributes)
    assert prefill_call.parent_id == root.span_id and decode_call.parent_id == root.span_id
    prefill = _by(spans, "pdserve-prefill", "worker prefill")[0]
    decode = next(s for s in _by(spans, "pdserve-decode", "worker decode")
                  if s.parent_id == decode_call.span_id)
    assert prefill.parent_id == prefill_call.span_id
    _check_worker(spans, prefill, {"queue", "prefill steps", "kv save"})
    _check_worker(spans, decode, {"queue", "kv load", "first step", "decode steps"})
    save = next(s for s in spans if s.name == "kv save")
    load = next(s for s in spans if s.name == "kv load")
    assert save.attributes["pdserve.kv.bytes"] > 0 and load.attributes["pdserve.kv.bytes"] > 0
    assert not [(s.service, s.name, s.message) for s in spans if s.error]


def test_a_local_prefill_is_traced_on_its_decode_worker(up: dict[str, Any], collector: Collector) -> None:
    trace_id, parent = _traceparent()
    _complete(up, list(range(300, 310)), parent, 4)  # 10 uncached tokens: prefilled locally
    spans = collector.wait_for(trace_id, lambda s: bool(
        _by(s, "pdserve-decode", "worker decode") and _by(s, "pdserve-router", "POST /v1/completions")))
    assert not _by(spans, "pdserve-prefill", "worker prefill")
    assert not _by(spans, "pdserve-router", "prefill")
    call = _by(spans, "pdserve-router", "decode")[0]
    assert call.attributes["pdserve.computes_prompt"] is True
    decode = _by(spans, "pdserve-decode", "worker decode")[0]
    assert decode.parent_id == call.span_id
    _check_worker(spans, decode, {"queue", "first step", "decode steps"})


def test_a_stream_the_client_leaves_is_cancelled_not_failed_on_the_worker(
        up: dict[str, Any], collector: Collector) -> None:
    trace_id, parent = _traceparent()
    body = {"model": up["model"], "prompt": list(range(700, 720)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{up['url']}/v1/completions", json=body, timeout=120,
                      headers={"traceparent": parent}) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # the client leaves mid-stream: the router cancels the decode call
    spans = collector.wait_for(trace_id, lambda s: bool(_by(s, "pdserve-decode", "worker decode")))
    worker = _by(spans, "pdserve-decode", "worker decode")[0]
    assert worker.attributes["pdserve.cancelled"] is True and not worker.error, worker


def test_a_migrated_request_shows_both_decode_attempts(up: dict[str, Any], collector: Collector) -> None:
    trace_id, parent = _traceparent()
    body = {"model": up["model"], "prompt": list(range(500, 540)), "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    killed = None
    with httpx.stream("POST", f"{up['url']}/v1/completions", json=body, timeout=120,
                      headers={"traceparent": parent}) as resp:
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if chunks == 3 and killed is None:
                    killed = _kill_busy_decode_worker(up)
    assert killed is not None and chunks > 3

    def ready(spans: list[Span]) -> bool:
        return len(_by(spans, "pdserve-router", "decode")) >= 2 and bool(
            _by(spans, "pdserve-router", "POST /v1/completions"))

    spans = collector.wait_for(trace_id, ready, timeout_s=60)
    root = _by(spans, "pdserve-router", "POST /v1/completions")[0]
    calls = sorted(_by(spans, "pdserve-router", "decode"), key=lambda s: s.start_ns)
    assert all(c.parent_id == root.span_id for c in calls)
    assert calls[0].error  # the stream broke there
    assert calls[-1].attributes["pdserve.migration"] is True and not calls[-1].error
    # the survivor's span is under the migrated attempt
    survivor = collector.wait_for(trace_id, lambda s: any(
        x.name == "worker decode" and x.parent_id == calls[-1].span_id for x in s))
    assert survivor


def _kill_busy_decode_worker(up: dict[str, Any]) -> int:
    """SIGKILLs the decode worker process running a request (found by its port); its pid."""
    import grpc

    from protos import worker_pb2 as pb
    from protos import worker_pb2_grpc as pb_grpc

    for port in up["decode"]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            load = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=5)
        if load.num_running:
            for proc in psutil.Process(up["pid"]).children(recursive=True):
                argv = f" {' '.join(proc.cmdline())} "
                if f" --port {port} " in argv and " worker " in argv:
                    proc.send_signal(signal.SIGKILL)
                    return proc.pid
    raise AssertionError("no decode worker was running the request")
