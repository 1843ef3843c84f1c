"""The split's hand-off through `pdserve up` (issue 33): long prompts one at a time, one table.

For each setup (`split`: `pdserve up` at its defaults, one prefill and one decode worker, KV
through the store, the decode call sent with the prefill (early hand-off); `split-after-prefill`:
the same with `--handoff after-prefill`; and `pdserve up --colocated` as the reference) the
script starts the system on loopback ports, sends `--warmup` then `--requests` prompts of
`--prompt-len` random token ids, one at a time, streaming `--output-len` tokens (greedy, EOS
ignored) from /v1/completions, and reads the arrival time of every streamed chunk. Per request:

- TTFT: request sent -> first token; first gap: first token -> second token (the hand-off in
  the split: the prefill worker's first token reaches the client, then the decode worker's);
- steady ITL: the median gap from the second token on.

Per setup the table gives medians over requests of TTFT, first gap, steady ITL and the ratio
first gap / steady ITL (per request, then the median), and the worker's own time to first token
(queue plus prefill time of the prefill worker, or of the colocated worker, over the measured
requests, read from its /metrics) against the client's TTFT, the router's
`pdserve:handoff_seconds` and the decode worker's own arrival-to-first-token time. Issue 33
asks the split for a first gap <= 1.2x its steady ITL and a TTFT <= the prefill worker's own
+ 10%.

    python benchmarks/bench_handoff.py [--requests 12] [--prompt-len 1000] [--output-len 32]
        [--setups split,split-after-prefill,colocated] [--repeats 1]

Only loopback; every request is bounded (--request-timeout-s) and the run by --requests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import markdown_table
from engine.config import DEFAULT_MODEL
from loadtest.compare import Server
from services.procs import free_ports

VOCAB_SAFE = (1000, 40000)  # random ids well inside the default model's vocabulary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--setups", default="split,split-after-prefill,colocated")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="start each setup this many times, alternating")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="extra `pdserve up` arguments for every setup")
    p.add_argument("--log-dir", default="")
    return p.parse_args(argv)


def metric_sum_count(text: str, name: str) -> tuple[float, float]:
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def scrape(client: httpx.Client, url: str, name: str) -> tuple[float, float]:
    return metric_sum_count(client.get(url, timeout=10).text, name)


# A worker's own time to first token: its queue time (arrival -> first scheduled step) plus its
# prefill time (-> first token); for a decode worker the "prefill" is loading the KV and the
# first decode step.
WORKER_TTFT = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")


def worker_ttft(client: httpx.Client, url: str) -> tuple[float, float]:
    """(seconds summed over both histograms, requests counted)."""
    text = client.get(url, timeout=10).text
    parts = [metric_sum_count(text, name) for name in WORKER_TTFT]
    return sum(p[0] for p in parts), parts[1][1]


def one_request(client: httpx.Client, base: str, prompt: list[int], args: argparse.Namespace,
                model: str) -> list[float]:
    """Seconds from sending to each streamed chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", f"{base}/v1/completions", json=body,
                       timeout=args.request_timeout_s) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
    return times


def run_setup(name: str, args: argparse.Namespace, log_dir: Path, prompts: list[list[int]]
              ) -> dict[str, Any]:
    port, kv, dec, pre = free_ports(4)
    argv = [sys.executable, "-m", "services.cli", "up", "--model", args.model, "--port", str(port),
            "--kvstore-port", str(kv), "--decode-port", str(dec), "--prefill-port", str(pre),
            "--startup-timeout-s", str(args.startup_timeout_s), *args.up_args.split()]
    split = name.startswith("split")
    if name == "colocated":
        argv.append("--colocated")
    elif name == "split-after-prefill":
        argv += ["--handoff", "after-prefill"]
    # worker metrics: gRPC port + the default offset (1000); the colocated worker is the decode one
    first_url = f"http://127.0.0.1:{(pre if split else dec) + 1000}/metrics"
    decode_url = f"http://127.0.0.1:{dec + 1000}/metrics" if split else None
    server = Server(name, argv, port, "pdserve is up", log_dir / f"{name}.log")
    try:
        server.wait_ready(args.startup_timeout_s)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client() as client:
            model = client.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            warm = [random.Random(args.seed + 99).sample(range(*VOCAB_SAFE), args.prompt_len)
                    for _ in range(args.warmup)]
            for prompt in warm:
                one_request(client, base, prompt, args, model)
            w0 = worker_ttft(client, first_url)
            d0 = worker_ttft(client, decode_url) if decode_url else (0.0, 0.0)
            h0 = scrape(client, f"{base}/metrics", "pdserve:handoff_seconds")
            per = [one_request(client, base, p, args, model) for p in prompts]
            w1 = worker_ttft(client, first_url)
            d1 = worker_ttft(client, decode_url) if decode_url else (0.0, 0.0)
            h1 = scrape(client, f"{base}/metrics", "pdserve:handoff_seconds")
    finally:
        server.stop()

    def mean(a: tuple[float, float], b: tuple[float, float]) -> float | None:
        return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else None

    return {"per": per, "worker_ttft": mean(w0, w1), "decode_ttft": mean(d0, d1),
            "handoff": mean(h0, h1)}


def summarize(name: str, runs: list[dict[str, Any]]) -> list[object]:
    per = [t for r in runs for t in r["per"] if len(t) >= 3]
    ttft = statistics.median(t[0] for t in per)
    first_gap = statistics.median(t[1] - t[0] for t in per)
    steady = [statistics.median(b - a for a, b in itertools.pairwise(t[1:])) for t in per]
    ratio = statistics.median((t[1] - t[0]) / s for t, s in zip(per, steady, strict=True))
    wt = [r["worker_ttft"] for r in runs if r["worker_ttft"] is not None]
    worker = statistics.mean(wt) if wt else None
    mean_ttft = statistics.mean(t[0] for t in per)
    handoffs = [r["handoff"] for r in runs if r["handoff"] is not None]
    dt = [r["decode_ttft"] for r in runs if r["decode_ttft"] is not None]
    return [name, len(per), f"{ttft * 1e3:.0f}", f"{mean_ttft * 1e3:.0f}",
            f"{worker * 1e3:.0f}" if worker is not None else "-",
            f"{mean_ttft / worker:.2f}" if worker else "-",
            f"{first_gap * 1e3:.0f}", f"{statistics.median(steady) * 1e3:.1f}", f"{ratio:.2f}",
            f"{statistics.mean(handoffs) * 1e3:.0f}" if handoffs else "-",
            f"{statistics.mean(dt) * 1e3:.0f}" if dt else "-"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [s for s in args.setups.split(",") if s]
    unknown = set(names) - {"split", "split-after-prefill", "colocated"}
    if unknown:
        raise SystemExit(f"unknown setups {sorted(unknown)} (split, split-after-prefill, colocated)")
    rng = random.Random(args.seed)
    prompts = [rng.sample(range(*VOCAB_SAFE), args.prompt_len) for _ in range(args.requests)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-handoff-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            print(f"[{r + 1}/{args.repeats}] {name} ...", flush=True)
            results[name].append(run_setup(name, args, log_dir, prompts))
    print(f"# hand-off through `pdserve up` (defaults{', ' + args.up_args if args.up_args else ''}): "
          f"{args.requests} prompts of {args.prompt_len} random ids, one at a time, "
          f"{args.output_len} tokens each, greedy; {args.repeats} start(s) per setup")
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores; load average {load:.2f} after the run "
          "(other processes skew the times)")
    rows = [summarize(n, results[n]) for n in names]
    print(markdown_table(["setup", "requests", "TTFT p50 ms", "TTFT mean ms",
                          "worker TTFT mean ms", "TTFT / worker's", "first gap p50 ms",
                          "steady ITL p50 ms", "first gap / ITL (p50)", "router handoff mean ms",
                          "decode worker TTFT mean ms"],
                         rows))
    print("worker TTFT: the prefill worker's own (split) or the colocated worker's: its "
          "vllm:request_queue_time_seconds + vllm:request_prefill_time_seconds (arrival -> first "
          "token); decode worker TTFT: the same on the split's decode worker (arrival -> its "
          "first token: KV load and first step; with the early hand-off the arrival is the "
          "prefill's start, so it spans the prefill too); router handoff: pdserve:handoff_seconds "
          f"(prefill's first token -> decode's first). Logs: {log_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
