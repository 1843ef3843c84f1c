"""Router and disaggregation cost (issue #6): p50 / p99 time to first token for prompts of 128,
1,024 and 2,048 tokens, in one run, over three setups started with `pdserve up`:

- direct:  the colocated worker's gRPC Decode called directly (token ids in, first chunk out);
- router:  the router (HTTP, streamed /v1/completions) in front of that same colocated worker;
- disagg:  the router in front of one prefill worker and one decode worker (KV through the store).

Router overhead = router - direct (target: under 2 ms at p50); disaggregation cost = disagg - router.
Each sample is a fresh random prompt (no prefix-cache hits) sent as token ids, so the router does
no tokenization; setups are interleaved sample by sample so background load hits all alike. Only
one request is in flight at a time. E2E columns are for `--max-tokens` tokens (the first token of a
disaggregated request comes from the prefill worker; the KV transfer shows up after it).

The HTTP client is aiohttp on one kept-alive connection (what vLLM's benchmark_serving uses);
`--client httpx` measures through httpx instead, whose own streaming path costs ~1 ms more per
request on this box: client-side time, not the router's, but it lands in the router column.
`--tiny` serves a random 2-layer Llama (hidden 64, the default model's tokenizer) instead of
`--model`, so that the model's compute and its run-to-run noise do not swamp the router's cost.

    python benchmarks/bench_router.py [--samples 20] [--lengths 128,1024,2048] [--max-tokens 8] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import httpx
import numpy as np

from benchmarks.common import markdown_table, median, percentile, random_token_ids
from engine.config import DEFAULT_MODEL
from loadtest.compare import Server


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--samples", type=int, default=20, help="requests per setup and length")
    p.add_argument("--lengths", default="128,1024,2048")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--base-port", type=int, default=18000)
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    p.add_argument("--tiny", action="store_true", help="serve a random 2-layer Llama, not --model")
    return p.parse_args(argv)


def make_tiny_model(folder: Path, max_positions: int) -> Path:
    """A random 2-layer Llama (hidden 64) with the default model's tokenizer, saved in `folder`."""
    import shutil

    import torch
    import transformers

    from engine.model.loader import resolve_model_path

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    source = resolve_model_path(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def start_up(args: argparse.Namespace, port: int, colocated: bool, log: Path) -> Server:
    """`pdserve up` in a child process (its output copied to `log`); decode worker on port + 2."""
    argv = [sys.executable, "-m", "services.cli", "up", "--model", args.model, "--port", str(port),
            "--kvstore-port", str(port + 1), "--decode-port", str(port + 2),
            "--prefill-port", str(port + 3), "--num-threads", str(args.num_threads),
            "--kv-cache-gib", "1", "--max-model-len", str(max(args.lengths_list) + 64),
            "--metrics-port-offset", "0", "--secrets-dir", str(log.parent / f"secrets-{port}")]
    return Server(f"pdserve up :{port}", [*argv, "--colocated"] if colocated else argv, port,
                  "pdserve is up", log)


def colocated_secrets(server: Server) -> Path:
    """The credentials `start_up` had `pdserve up` generate (the direct client needs the
    workers' token, as the router does)."""
    return server.log.parent / f"secrets-{server.port}"


def _body(model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def via_router(http: aiohttp.ClientSession, port: int, model: str, ids: list[int], max_tokens: int
                     ) -> tuple[float, float]:
    """(TTFT, E2E) in seconds of one streamed completion through the router (aiohttp). The JSON
    body is encoded before the clock starts (the client's own work: ~0.1 ms for 2,048 ids); the
    direct call builds its protobuf request inside its timer, which errs in the router's disfavour."""
    data = json.dumps(_body(model, ids, max_tokens)).encode()
    start = time.perf_counter()
    ttft = None
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", data=data,
                         headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"router answered {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if line.startswith(b"data: {") and ttft is None and json.loads(line[6:])["choices"]:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, time.perf_counter() - start


async def via_router_httpx(http: httpx.AsyncClient, port: int, model: str, ids: list[int], max_tokens: int
                           ) -> tuple[float, float]:
    """As via_router, through httpx."""
    start = time.perf_counter()
    ttft = None
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                           json=_body(model, ids, max_tokens)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and ttft is None and json.loads(line[6:])["choices"]:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, time.perf_counter() - start


async def direct(client: Any, ids: list[int], max_tokens: int, request_id: str) -> tuple[float, float]:
    """(TTFT, E2E) of one Decode call straight to the colocated worker."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ttft = None
    async for chunk in client.decode(request_id, ids, params, timeout_s=600):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, time.perf_counter() - start


async def measure(args: argparse.Namespace, colocated: Server, disagg: Server, vocab: int
                  ) -> dict[tuple[str, int], list[tuple[float, float]]]:
    from services.worker.auth import WorkerAccess
    from services.worker.client import WorkerClient

    rng = np.random.default_rng(0)
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session, httpx.AsyncClient(timeout=600) as hx, \
            WorkerClient(f"127.0.0.1:{colocated.port + 2}", WorkerAccess(token=(
                colocated_secrets(colocated) / "worker-token").read_text().strip())) as worker:
        http = (lambda port, ids: via_router(session, port, args.model, ids, args.max_tokens)) \
            if args.client == "aiohttp" else \
            (lambda port, ids: via_router_httpx(hx, port, args.model, ids, args.max_tokens))
        setups = {
            "direct": lambda ids, rid: direct(worker, ids, args.max_tokens, rid),
            "router": lambda ids, rid: http(colocated.port, ids),
            "disagg": lambda ids, rid: http(disagg.port, ids),
        }
        for name, run in setups.items():  # warm-up: first calls compile and fill caches
            for length in args.lengths_list:
                await run(random_token_ids(rng, length, vocab), f"warm-{name}-{length}")
        for i in range(args.samples):
            for length in args.lengths_list:
                order = list(setups)
                rng.shuffle(order)
                for name in order:
                    ids = random_token_ids(rng, length, vocab)
                    out.setdefault((name, length), []).append(await setups[name](ids, f"b-{i}-{length}"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.lengths_list = [int(x) for x in args.lengths.split(",")]
    from benchmarks.common import resolve_model_folder, vocab_size

    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    if args.tiny:
        args.model = str(make_tiny_model(logs / "tiny-llama", max(args.lengths_list) + 64))
    vocab = vocab_size(resolve_model_folder(args.model))
    ups = [start_up(args, args.base_port, True, logs / "colocated.log"),
           start_up(args, args.base_port + 10, False, logs / "disaggregated.log")]
    try:
        for up in ups:
            up.wait_ready(args.startup_timeout_s)
        res = asyncio.run(measure(args, ups[0], ups[1], vocab))
    finally:
        for up in ups:
            up.stop()
    rows = []
    for length in args.lengths_list:
        t = {name: [s[0] * 1e3 for s in res[(name, length)]] for name in ("direct", "router", "disagg")}
        e = {name: [s[1] * 1e3 for s in res[(name, length)]] for name in ("direct", "router", "disagg")}
        p50 = {n: median(v) for n, v in t.items()}
        p99 = {n: percentile(v, 99) for n, v in t.items()}
        rows.append([length, f"{p50['direct']:.1f} / {p99['direct']:.1f}",
                     f"{p50['router']:.1f} / {p99['router']:.1f}",
                     f"{p50['disagg']:.1f} / {p99['disagg']:.1f}",
                     f"{p50['router'] - p50['direct']:.2f}",
                     f"{p50['disagg'] - p50['router']:.1f} ({p50['disagg'] / p50['router']:.2f}x)",
                     f"{median(e['router']):.0f} / {median(e['disagg']):.0f}"])
    model = "random 2-layer Llama (--tiny)" if args.tiny else args.model
    print(f"router benchmark: model {model}, {args.samples} samples per cell, one request at a time, "
          f"setups interleaved, {args.client} client; TTFT in ms as p50 / p99; E2E for "
          f"{args.max_tokens} tokens")
    print(markdown_table(["prompt tokens", "direct gRPC TTFT", "router TTFT", "disagg TTFT",
                          "router overhead p50 (ms)", "disagg cost p50 (ms)",
                          "E2E p50 router / disagg (ms)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
