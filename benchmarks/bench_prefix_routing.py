"""Precise (KV events) vs approximate prefix routing, one run, one table (issue 37).

`--workers` colocated workers of the default model, each with a small KV cache
(`--num-kv-blocks`) so conversations evict each other. They publish KV cache events. Two routers
run over the same workers: one with `--prefix-index events` (pdserve's default), one with
`--prefix-index approximate` (the index of the prompts it sent, which pdserve used before).
The workload is a multi-turn chat:

- `--conversations` conversations run at once, each `--turns` turns long;
- every conversation shares a system prompt of about `--system-words` words;
- each turn adds a user message of about `--user-words` words and the streamed answer
  (`--output-len` tokens, greedy, through /v1/chat/completions).

Each index drives its own phase with fresh conversations and a fresh system prompt, so one
phase's cache helps nothing in the other; the phase order alternates over `--repeats`. Per index
the table gives:

- the prompt tokens the workers found cached over all prompt tokens (hit rate, the workers'
  usage.prompt_tokens_details.cached_tokens);
- TTFT p50 / p90 at the client;
- the router's own account, `pdserve:router_prefix_expected_tokens` vs `_found_tokens`: what it
  expected the chosen worker to hold against what that worker found. The approximate index's
  shortfall is its misses: blocks it still lists that the worker has evicted.

    python benchmarks/bench_prefix_routing.py [--workers 4] [--conversations 8] [--turns 5]

Only loopback; every request is bounded (--request-timeout-s), the run by the counts above.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import markdown_table, median, percentile
from engine.config import DEFAULT_MODEL
from services.procs import free_ports, stop_process

ROOT = Path(__file__).resolve().parent.parent
INDEXES = ("events", "approximate")
WORDS = ("river stone garden window paper music light forest ocean mountain city bridge "
         "engine market winter summer silver orange yellow purple table chair letter story "
         "number signal planet rocket castle island valley desert harbor lantern").split()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=50)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=80, help="per worker (16-token blocks)")
    p.add_argument("--max-model-len", type=int, default=1200)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="")
    return p.parse_args(argv)


class Stack:
    """The workers and the two routers, as child processes on loopback ports."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        from engine.model.loader import resolve_model_path

        folder = str(resolve_model_path(args.model))
        n = args.workers
        ports = free_ports(3 * n + 2)
        grpc, pubs, replays = ports[:n], ports[n:2 * n], ports[2 * n:3 * n]
        self.router_ports = dict(zip(INDEXES, ports[3 * n:], strict=True))
        self.targets = [f"127.0.0.1:{p}" for p in grpc]
        self.procs: list[Any] = []
        self.logs = log_dir
        for i, (g, pub, rep) in enumerate(zip(grpc, pubs, replays, strict=True)):
            events = json.dumps({"enable_kv_cache_events": True, "bind": True, "topic": "kv-events",
                                 "endpoint": f"tcp://127.0.0.1:{pub}",
                                 "replay_endpoint": f"tcp://127.0.0.1:{rep}"})
            self._spawn(f"worker-{i}", ["worker", "--role", "colocated", "--port", str(g), "--no-auth",
                                        "--model", folder, "--served-model-name", args.model,
                                        "--kv-store-url", "grpc://127.0.0.1:1",
                                        "--num-threads", str(args.num_threads),
                                        "--num-kv-blocks", str(args.num_kv_blocks),
                                        "--max-model-len", str(args.max_model_len),
                                        "--kv-events-config", events])
        for index, port in self.router_ports.items():
            self._spawn(f"router-{index}", ["router", "--model", args.model, "--tokenizer", folder,
                                            "--port", str(port), "--prefix-index", index,
                                            "--max-model-len", str(args.max_model_len),
                                            *[a for t in self.targets for a in ("--decode", t)]])

    def _spawn(self, name: str, argv: list[str]) -> None:
        import subprocess

        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=ROOT,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONPATH": str(ROOT)}))

    def wait_ready(self, timeout_s: float) -> None:
        """Both routers answer and each sees every worker serving with its events stream."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5) as http:
            for port in self.router_ports.values():
                while True:
                    if any(p.poll() is not None for p in self.procs):
                        raise RuntimeError(f"a component exited; see {self.logs}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"not ready after {timeout_s} s; see {self.logs}")
                    try:
                        if _serving_workers(http, port) == len(self.targets):
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(1.0)

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p, timeout_s=30)


def _serving_workers(http: httpx.Client, port: int) -> int:
    text = http.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(1 for line in text.splitlines()
               if line.startswith("pdserve:worker_healthy{") and line.endswith(" 1.0"))


def _router_prefix(http: httpx.Client, port: int) -> tuple[float, float]:
    text = http.get(f"http://127.0.0.1:{port}/metrics").text
    out = []
    for name in ("pdserve:router_prefix_expected_tokens_total", "pdserve:router_prefix_found_tokens_total"):
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{")))
    return out[0], out[1]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(port: int, model: str, system: str, rng: random.Random, args: argparse.Namespace,
                 out: list[dict[str, float]], lock: threading.Lock) -> None:
    messages = [{"role": "system", "content": system}]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=args.request_timeout_s) as http:
        for _ in range(args.turns):
            messages.append({"role": "user", "content": _text(rng, args.user_words)})
            body = {"model": model, "messages": messages, "max_tokens": args.output_len,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            ttft, text, usage = None, [], None
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            ttft = ttft if ttft is not None else time.perf_counter() - start
                            text.append(piece)
            assert usage is not None and ttft is not None, "a turn ended without usage or text"
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            with lock:
                out.append({"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": cached})
            messages.append({"role": "assistant", "content": "".join(text)})


def run_phase(stack: Stack, index: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    port = stack.router_ports[index]
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + _text(rng, args.system_words)
    with httpx.Client(timeout=10) as http:
        before = _router_prefix(http, port)
    turns: list[dict[str, float]] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=conversation, args=(port, args.model, system,
                                                           random.Random(rng.random()), args, turns, lock))
               for _ in range(args.conversations)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    with httpx.Client(timeout=10) as http:
        after = _router_prefix(http, port)
    expected, found = after[0] - before[0], after[1] - before[1]
    return {"turns": turns, "wall": wall, "expected": expected, "found": found}


def summarize(index: str, phases: list[dict[str, Any]]) -> list[object]:
    turns = [t for p in phases for t in p["turns"]]
    prompt = sum(t["prompt"] for t in turns)
    cached = sum(t["cached"] for t in turns)
    ttfts = [t["ttft"] for t in turns]
    expected = sum(p["expected"] for p in phases)
    found = sum(p["found"] for p in phases)
    return [index, len(turns), f"{cached / prompt:.3f}", int(cached), int(prompt),
            f"{median(ttfts) * 1e3:.0f}", f"{percentile(ttfts, 90) * 1e3:.0f}",
            int(expected), int(found), f"{found / expected:.3f}" if expected else "-",
            f"{sum(p['wall'] for p in phases):.0f}"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-prefix-routing-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args, log_dir)
    results: dict[str, list[dict[str, Any]]] = {i: [] for i in INDEXES}
    try:
        stack.wait_ready(args.startup_timeout_s)
        for r in range(args.repeats):
            order = INDEXES if r % 2 == 0 else INDEXES[::-1]
            for k, index in enumerate(order):
                print(f"[{r + 1}/{args.repeats}] {index} ...", flush=True)
                results[index].append(run_phase(stack, index, args, args.seed + 1000 * r + k))
    finally:
        stack.stop()
    print(f"# prefix routing: {args.workers} colocated workers ({args.model}, {args.num_kv_blocks} "
          f"KV blocks of 16 tokens each, {args.num_threads} thread(s)), {args.conversations} "
          f"conversations at once x {args.turns} turns, system ~{args.system_words} words, user "
          f"~{args.user_words} words, {args.output_len} output tokens; {args.repeats} phase(s) "
          "per index, order alternating")
    print(f"machine: {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} after the run")
    rows = [summarize(i, results[i]) for i in INDEXES]
    print(markdown_table(["index", "turns", "hit rate", "cached tok", "prompt tok", "TTFT p50 ms",
                          "TTFT p90 ms", "router expected tok", "found tok", "found/expected",
                          "wall s"], rows))
    ev, ap = rows
    print(f"events vs approximate: hit rate {ev[2]} vs {ap[2]}; TTFT p50 {ev[5]} vs {ap[5]} ms, "
          f"p90 {ev[6]} vs {ap[6]} ms. The approximate index expected {ap[7]} cached tokens and "
          f"its workers found {ap[8]}: the rest were blocks it still listed that had been evicted.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
