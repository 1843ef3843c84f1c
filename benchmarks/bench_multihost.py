"""What crossing hosts costs: the router, 2 prefill and 2 decode workers and the KV store, each
on a host of its own (a network namespace with its own address and /dev/shm on a bridge,
loadtest/netns.py: every call and every KV byte crosses a veth pair and the bridge), against
the same fleet all on loopback (the store's same-host shared-memory path in use, as on one
machine). Both fleets run in this one process's lifetime and take the same seeded requests,
setups alternating per repeat; each repeat has prompts of its own (no prefix cache hit carries
over). Streamed completions from `--users` concurrent clients through the router:

- TTFT: request sent -> first token; p50 and p99 over the repeat's requests.
- ITL: the gap between streamed chunks over the tokens the chunk brought (continuous usage
  stats), p99 over every token of the repeat.
Cells are medians over repeats; the ratio is namespaces / loopback. The load average (1 min)
is printed at the start and end of the measurement: the machine is shared.

    python benchmarks/bench_multihost.py               # the default model
    python benchmarks/bench_multihost.py --tiny        # a random 2-layer Llama, seconds per run

Needs root (network namespaces); exits 2 saying so otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import markdown_table, median, percentile, random_prompts
from engine.config import DEFAULT_MODEL
from loadtest.multihost import Fleet, FleetSpec
from loadtest.netns import Hosts, unavailable

SETUPS = ("namespaces", "loopback")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tiny", action="store_true", help="serve a random 2-layer Llama, not --model")
    p.add_argument("--requests", type=int, default=16, help="requests per setup and repeat")
    p.add_argument("--users", type=int, default=4, help="concurrent clients")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--log-dir", type=Path, default=None, help="component logs (default: temporary)")
    return p.parse_args(argv)


async def one_request(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                      ) -> tuple[float, list[float]]:
    """(TTFT, per-token gaps) in seconds of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = time.perf_counter()
    ttft, last, done, gaps = None, start, 0, []
    async with http.stream("POST", f"{url}/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            if not chunk.get("choices"):
                continue
            total = int((chunk.get("usage") or {}).get("completion_tokens", done + 1))
            new, now = total - done, time.perf_counter()
            if new <= 0:
                continue
            if ttft is None:
                ttft, new = now - start, new - 1  # the first token's time is the TTFT
            gaps += [(now - last) / new] * new if new > 0 else []
            last, done = now, total
    assert ttft is not None, "no token came"
    return ttft, gaps


async def run_load(url: str, prompts: list[list[int]], users: int, max_tokens: int
                   ) -> tuple[list[float], list[float]]:
    """Every prompt once, `users` at a time; (TTFTs, gaps)."""
    queue = list(prompts)
    ttfts: list[float] = []
    gaps: list[float] = []

    async def user(http: httpx.AsyncClient) -> None:
        while queue:
            ttft, mine = await one_request(http, url, queue.pop(), max_tokens)
            ttfts.append(ttft)
            gaps.extend(mine)

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(user(http) for _ in range(users)))
    return ttfts, gaps


def shm_puts(fleet: Fleet) -> tuple[int, int]:
    """(objects the store took through shared memory, all objects it took)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.client import KVStoreClient

    token = Path(fleet.secrets.path("kv-admin-token")).read_text().strip()
    with KVStoreClient(fleet.store_url, token=token, use_shm=False) as admin:
        text = admin.metrics_text()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return int(got["pdserve_kvstore_shm_put_objects_total"]), int(got["pdserve_kvstore_put_objects_total"])


def measure(args: argparse.Namespace, fleets: dict[str, Fleet], vocab: int) -> dict[str, list[list[float]]]:
    """Per setup, per repeat: [TTFT p50, TTFT p99, ITL p99] in ms."""
    out: dict[str, list[list[float]]] = {name: [] for name in fleets}
    warm = random_prompts(2 * args.users, args.min_prompt, args.max_prompt, vocab, seed=10_000)
    for fleet in fleets.values():  # first calls of each worker: caches, lazy set-up
        asyncio.run(run_load(fleet.base_url, warm, args.users, args.max_tokens))
    for rep in range(args.repeats):
        prompts = random_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, seed=rep)
        order = SETUPS if rep % 2 == 0 else SETUPS[::-1]
        for name in order:
            ttfts, gaps = asyncio.run(run_load(fleets[name].base_url, prompts, args.users, args.max_tokens))
            out[name].append([percentile(ttfts, 50) * 1e3, percentile(ttfts, 99) * 1e3,
                              percentile(gaps, 99) * 1e3])
    return out


def table(results: dict[str, list[list[float]]], shm: dict[str, tuple[int, int]]) -> str:
    """Medians over repeats, with the range of the repeats (min-max) beside them."""
    rows: list[list[object]] = []
    for i, metric in enumerate(("TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p99 (ms)")):
        per = {name: [r[i] for r in results[name]] for name in SETUPS}
        mid = {name: median(values) for name, values in per.items()}
        rows.append([metric, *(f"{mid[n]:.1f} ({min(per[n]):.0f}-{max(per[n]):.0f})" for n in SETUPS),
                     f"{mid['namespaces'] / mid['loopback']:.2f}x"])
    rows.append(["KV objects put via shared memory", f"{shm['namespaces'][0]} of {shm['namespaces'][1]}",
                 f"{shm['loopback'][0]} of {shm['loopback'][1]}", "-"])
    return markdown_table(["metric", "namespaces: median (range)", "loopback: median (range)",
                           "namespaces / loopback"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench_multihost: {why} (run as root with iproute2 installed)", file=sys.stderr)
        return 2
    from benchmarks.common import resolve_model_folder, vocab_size

    work = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    if args.tiny:
        from benchmarks.bench_router import make_tiny_model

        args.model = str(make_tiny_model(work / "tiny-llama", args.max_prompt + args.max_tokens + 64))
    folder = str(resolve_model_folder(args.model))
    engine = ("--num-threads", str(args.num_threads), "--kv-cache-gib", "0.25", "--grace-s", "2",
              "--max-model-len", str(args.max_prompt + args.max_tokens + 64))
    spec = FleetSpec(model=folder, served_name="bench", engine_args=engine,
                     startup_timeout_s=args.startup_timeout_s)
    logs = args.log_dir or work / "logs"
    with Hosts(spec.num_hosts) as hosts, \
            Fleet(spec, hosts, log_dir=logs / "namespaces") as across, \
            Fleet(spec, None, log_dir=logs / "loopback") as loopback:
        fleets = {"namespaces": across, "loopback": loopback}
        load_start = os.getloadavg()[0]
        results = measure(args, fleets, vocab_size(Path(folder)))
        load_end = os.getloadavg()[0]
        shm = {name: shm_puts(fleet) for name, fleet in fleets.items()}
    model = "random 2-layer Llama (--tiny)" if args.tiny else args.model
    print(f"multi-host benchmark: router + 2 prefill + 2 decode + KV store, model {model}, "
          f"{args.requests} requests x {args.repeats} repeats per setup, {args.users} concurrent "
          f"clients, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} new; "
          f"{os.cpu_count()} cores, load average {load_start:.1f} -> {load_end:.1f}")
    print(table(results, shm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
