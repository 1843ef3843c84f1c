"""Precise (KV events) vs approximate prefix routing, one run, one table (issue 37).

`--workers` colocated workers of the default model, each with a KV cache of
`--num-kv-blocks` blocks. They publish KV cache events. Over the same workers run `--routers`
router replicas with `--prefix-index events` (pdserve's default) and as many with
`--prefix-index approximate` (the index of the prompts a router sent itself, which pdserve
used before): as behind a load balancer, each turn of a conversation goes to the next replica
of its kind. The workload is a multi-turn chat:

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

    python benchmarks/bench_prefix_routing.py [--workers 4] [--routers 2] [--conversations 8]
        [--turns 8] [--num-kv-blocks 160] [--repeats 2]

Measured on the 2-core dev VM (2026-11-29, the defaults, load average ~3.9 during the run):

| router      | turns | hit rate | TTFT p50 ms | TTFT p90 ms | found / expected tokens |
|-------------|-------|----------|-------------|-------------|-------------------------|
| events      | 128   | 0.707    | 1556        | 4678        | 49504 / 48688           |
| approximate | 128   | 0.610    | 2068        | 5601        | 42640 / 30880           |

The approximate replicas each knew only the turns they routed themselves: they expected 72% of
what their workers then found and sent a conversation's turns to the worker that held an older
prefix of it; the events replicas' expectations were within 2% of what the workers found.

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
from services.procs import cli, free_ports, new_instance_id, spawn, stop_process
from services.readiness import router_ready, worker_ready

ROOT = Path(__file__).resolve().parent.parent
INDEXES = ("events", "approximate")
WORDS = (
    "river", "stone", "garden", "window", "paper", "music", "light", "forest", "ocean",
    "mountain", "city", "bridge", "engine", "market", "winter", "summer", "silver", "orange",
    "yellow", "purple", "table", "chair", "letter", "story", "number", "signal", "planet",
    "rocket", "castle", "island", "valley", "desert", "harbor", "lantern",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--routers", type=int, default=2, help="router replicas per index")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=50)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=160, help="per worker (16-token blocks)")
    p.add_argument("--max-model-len", type=int, default=1200)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=2)
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
        r = args.routers
        ports = free_ports(3 * n + 2 * r)
        grpc, pubs, replays = ports[:n], ports[n:2 * n], ports[2 * n:3 * n]
        self.router_ports = {index: ports[3 * n + k * r: 3 * n + (k + 1) * r]
                             for k, index in enumerate(INDEXES)}
        self.targets = [f"127.0.0.1:{p}" for p in grpc]
        self.procs: list[tuple[Any, str]] = []
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
        for index, router_ports in self.router_ports.items():
            for k, port in enumerate(router_ports):
                self._spawn(f"router-{index}-{k}", [
                    "router", "--model", args.model, "--tokenizer", folder, "--port", str(port),
                    "--prefix-index", index, "--max-model-len", str(args.max_model_len),
                    *[a for t in self.targets for a in ("--decode", t)]])

    def _spawn(self, name: str, argv: list[str]) -> None:
        import subprocess

        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        instance = new_instance_id()
        proc = spawn(cli(*argv), instance=instance, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append((proc, instance))

    def wait_ready(self, timeout_s: float) -> None:
        """Every worker serves (its engine is up), then both routers; then a few of the routers'
        load refreshes (0.1 s each), so their pools see every worker serving."""
        deadline = time.monotonic() + timeout_s
        checks = [worker_ready(t) for t in self.targets]
        checks += [router_ready(f"http://127.0.0.1:{p}") for ports in self.router_ports.values()
                   for p in ports]
        for (proc, instance), ready in zip(self.procs, checks, strict=True):
            while not ready(instance):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"a component did not come up; see {self.logs}")
                time.sleep(0.5)
        time.sleep(2.0)

    def stop(self) -> None:
        for proc, _ in self.procs:
            stop_process(proc, timeout_s=30)


def _router_prefix(http: httpx.Client, port: int) -> dict[str, float]:
    """The router's prefix counters, summed over pools: "<index> expected" / "<index> found"."""
    text = http.get(f"http://127.0.0.1:{port}/metrics").text
    out: dict[str, float] = {}
    for kind in ("expected", "found"):
        name = f"pdserve:router_prefix_{kind}_tokens_total{{"
        for line in text.splitlines():
            if line.startswith(name):
                index = line.split('index="', 1)[1].split('"', 1)[0]
                out[f"{index} {kind}"] = out.get(f"{index} {kind}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _summed(http: httpx.Client, ports: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for port in ports:
        for k, v in _router_prefix(http, port).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(ports: list[int], model: str, system: str, rng: random.Random,
                 args: argparse.Namespace, out: list[dict[str, float]], lock: threading.Lock) -> None:
    """One conversation, turn t through router replica t mod len(ports)."""
    messages = [{"role": "system", "content": system}]
    first = rng.randrange(len(ports))
    with httpx.Client(timeout=args.request_timeout_s) as http:
        for turn in range(args.turns):
            base = f"http://127.0.0.1:{ports[(first + turn) % len(ports)]}"
            messages.append({"role": "user", "content": _text(rng, args.user_words)})
            body = {"model": model, "messages": messages, "max_tokens": args.output_len,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            ttft, text, usage = None, [], None
            with http.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:300]}")
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
    ports = stack.router_ports[index]
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + _text(rng, args.system_words)
    with httpx.Client(timeout=10) as http:
        before = _summed(http, ports)
    turns: list[dict[str, float]] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=conversation, args=(ports, args.model, system,
                                                           random.Random(rng.random()), args, turns, lock))
               for _ in range(args.conversations)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    with httpx.Client(timeout=10) as http:
        after = _summed(http, ports)
    counts = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"turns": turns, "wall": wall, "counts": counts}


def summarize(index: str, phases: list[dict[str, Any]]) -> list[object]:
    turns = [t for p in phases for t in p["turns"]]
    prompt = sum(t["prompt"] for t in turns)
    cached = sum(t["cached"] for t in turns)
    ttfts = [t["ttft"] for t in turns]
    counts: dict[str, float] = {}
    for p in phases:
        for k, v in p["counts"].items():
            counts[k] = counts.get(k, 0.0) + v

    def account(source: str) -> str:
        expected, found = counts.get(f"{source} expected", 0.0), counts.get(f"{source} found", 0.0)
        return f"{found:.0f} / {expected:.0f}" if expected or found else "-"

    return [index, len(turns), f"{cached / prompt:.3f}", int(cached), int(prompt),
            f"{median(ttfts) * 1e3:.0f}", f"{percentile(ttfts, 90) * 1e3:.0f}",
            account("events"), account("approximate"), f"{sum(p['wall'] for p in phases):.0f}"]


def _explain(index: str, phases: list[dict[str, Any]]) -> str:
    """What the router's found / expected tokens say about its index."""
    expected = sum(p["counts"].get(f"{index} expected", 0.0) for p in phases)
    found = sum(p["counts"].get(f"{index} found", 0.0) for p in phases)
    if not expected:
        return "no choice was made on this index"
    if found < expected:
        return (f"its workers found {found:.0f} of the {expected:.0f} prompt tokens it expected "
                "them to hold: blocks it listed that had been evicted (by the time the request "
                "was scheduled)")
    return (f"its workers found {found:.0f} prompt tokens where it expected {expected:.0f}: "
            "blocks it did not know they held (placed by another replica or client, or "
            "computed for a concurrent request between the choice and the request's first step)")


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
          f"KV blocks of 16 tokens each, {args.num_threads} thread(s)), {args.routers} router "
          f"replica(s) per index taking turns, {args.conversations} "
          f"conversations at once x {args.turns} turns, system ~{args.system_words} words, user "
          f"~{args.user_words} words, {args.output_len} output tokens; {args.repeats} phase(s) "
          "per index, order alternating")
    print(f"machine: {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} after the run")
    rows = [summarize(i, results[i]) for i in INDEXES]
    print(markdown_table(["router", "turns", "hit rate", "cached tok", "prompt tok", "TTFT p50 ms",
                          "TTFT p90 ms", "found / expected (choices on events)",
                          "found / expected (choices on the approximate index)", "wall s"], rows))
    ev, ap = rows
    print(f"events vs approximate: hit rate {ev[2]} vs {ap[2]}; TTFT p50 {ev[5]} vs {ap[5]} ms, "
          f"p90 {ev[6]} vs {ap[6]} ms.")
    for index in INDEXES:
        print(f"{index}: {_explain(index, results[index])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
