"""`pdserve up` starts the KV store, a prefill and a decode worker and the router as processes;
the openai client gets the offline engine's greedy text; Ctrl-C stops every process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.procs import free_ports, stop_process

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_up_serves_the_openai_api_and_stops_on_ctrl_c(tiny_model_dir: Callable[[str], Path],
                                                      colocated: bool) -> None:
    from openai import OpenAI

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model = tiny_model_dir("llama")
    for _ in range(50):  # worker /metrics = gRPC port + offset: keep the prefill one valid too
        router, store, prefill, decode, metrics = free_ports(5)
        offset = metrics - decode  # the decode (or colocated) worker's /metrics lands on a free port
        if 1024 <= prefill + offset <= 65535:
            break
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(router),
            "--kvstore-port", str(store), "--prefill-port", str(prefill), "--decode-port", str(decode),
            "--num-threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "512",
            "--startup-timeout-s", "180", "--metrics-port-offset", str(offset)]
    if colocated:
        argv.append("--colocated")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for _ in range(50):  # the children print their own start lines too
            lines.append(proc.stdout.readline())
            if "pdserve is up" in lines[-1] or not lines[-1]:
                break
        assert "pdserve is up" in lines[-1], lines
        client = OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key="x", timeout=60)
        got = client.completions.create(model=str(model), prompt="The quick brown fox",
                                        max_tokens=12, temperature=0)
        want = LLM(model=str(model), num_threads=1, kv_cache_gib=0.05).generate(
            ["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        assert got.choices[0].text == want[0].outputs[0].text
        import httpx

        worker_metrics = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        assert "vllm:generation_tokens_total" in worker_metrics
        router_metrics = httpx.get(f"http://127.0.0.1:{router}/metrics", timeout=10).text
        assert "vllm:time_to_first_token_seconds_count" in router_metrics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        time.sleep(0.5)
        for port in (router, store, prefill, decode, metrics):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"
    finally:
        stop_process(proc)
