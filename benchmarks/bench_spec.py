"""Speculative decoding against plain decoding: output tokens/s and inter-token latency at batch
1, 4 and 16, on a rewrite workload and on workload A's random prompts, in one run.

Both engines (one plain, one per proposer) load the same model in this process (each core in
its own process, as a worker's) and run the same requests, interleaved cell by cell: `batch`
clients stream their requests at once, one after another, `--requests` in all (after a
warm-up request on each engine). ITL is each
streamed chunk's gap divided among its tokens (speculation emits several tokens per step), over
every token but a request's first. Greedy: the table also counts requests whose tokens equal the
plain engine's (speculation must never change them). Acceptance: accepted / drafted tokens, and
per draft position the share of drafts accepted there.

    python benchmarks/bench_spec.py [--batches 1,4,16] [--output-len 128] [--repeats 1]

Workloads:
- rewrite: the chat template around "Rewrite this passage, keeping its words" and a 280-word
  passage; the answer repeats the passage, which n-gram lookup drafts from the prompt.
- random: workload A's prompts (random token ids, 64..512 tokens), EOS ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    machine_line,
    markdown_table,
    median,
    percentile,
    random_prompts,
    resolve_model_folder,
    vocab_size,
)
from engine.config import DEFAULT_MODEL

PASSAGE = (
    "The harbour town woke slowly in winter. Before the sun cleared the hills, the fishing boats "
    "were already out past the breakwater, their lamps swinging with each swell, and the baker on "
    "the corner had lit the ovens that warmed half the street. By eight the market stalls were "
    "open: crates of mackerel on ice, bundles of leeks and carrots still dusted with soil, jars of "
    "honey from the farms up the valley. Children ran between the stalls on their way to school, "
    "and the older men sat outside the cafe with their coffee, arguing about the weather and the "
    "price of diesel. In the afternoon the wind usually turned, coming in cold from the sea, and "
    "the town drew in on itself. Shutters closed, the square emptied, and the only sound was the "
    "rigging of the moored boats knocking against their masts. The library stayed open until six, "
    "its reading room warm and quiet, where students from the college worked through their notes "
    "and an old sailor read the same atlas every day. When the boats came home at dusk, the whole "
    "town seemed to come back to life for an hour: the catch was weighed and sold, the cafe filled "
    "again, and lights came on one by one along the harbour wall. Then the night settled, and the "
    "only light left was the lighthouse, turning slowly over the dark water until morning."
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,4,16", help="concurrent clients per cell")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per cell (default: the batch, at least 3)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--workloads", default="rewrite,random")
    p.add_argument("--speculative-config", action="append", default=None,
                   help="a proposer's JSON (repeat; default: n-gram, 4 tokens, lookup 1..4)")
    p.add_argument("--min-len", type=int, default=64, help="random prompts' shortest")
    p.add_argument("--max-len", type=int, default=512, help="random prompts' longest")
    p.add_argument("--repeats", type=int, default=1, help="runs of every cell (medians)")
    p.add_argument("--num-threads", type=int, default=None)
    return p.parse_args(argv)


def _prompts(kind: str, n: int, folder: Path, args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if kind == "random":
        return random_prompts(n, args.min_len, args.max_len, vocab_size(folder), seed=7)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Rewrite this passage, keeping its words:\n\n" + PASSAGE}],
        tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [list(ids) for _ in range(n)]


async def _one(engine: Any, rid: str, prompt: list[int], params: Any) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    gaps: list[float] = []
    last = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        now = time.perf_counter()
        new = out.outputs[0].token_ids
        if last is not None and new:
            gaps += [(now - last) / len(new)] * len(new)
        if new:
            last = now
        tokens += new
    return tokens, gaps


async def _cell(engine: Any, tag: str, prompts: list[list[int]], batch: int,
                params: Any) -> tuple[float, list[float], list[list[int]], float]:
    queue = list(enumerate(prompts))
    results: dict[int, list[int]] = {}
    gaps: list[float] = []

    async def client() -> None:
        while queue:
            i, prompt = queue.pop(0)
            tokens, g = await _one(engine, f"{tag}-{i}", prompt, params)
            results[i] = tokens
            gaps.extend(g)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(batch)))
    wall = time.perf_counter() - start
    outs = [results[i] for i in range(len(prompts))]
    return wall, gaps, outs, sum(map(len, outs)) / wall


async def run(args: argparse.Namespace) -> list[list[object]]:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.sampling_params import RequestOutputKind, SamplingParams

    folder = resolve_model_folder(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    specs = args.speculative_config or ['{"method": "ngram", "num_speculative_tokens": 4}']
    base = dict(model=str(folder), dtype=args.dtype, num_threads=args.num_threads,
                max_num_seqs=max(batches))
    engines = {"none": AsyncLLM(EngineConfig(**base))}
    for s in specs:
        engines[s] = AsyncLLM(EngineConfig(**base, speculative_config=s))
    tokenizer = engines["none"].get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    rows: list[list[object]] = []
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for name, engine in engines.items():  # first-call costs (allocations, kernel set-up)
            await _cell(engine, f"warm-{name}", _prompts("rewrite", 1, folder, args, tokenizer)[:1]
                        + _prompts("random", 2, folder, args, tokenizer), 3, warm)
        for kind in args.workloads.split(","):
            for batch in batches:
                n = args.requests or max(3, batch)
                prompts = _prompts(kind, n, folder, args, tokenizer)
                rates: dict[str, list[float]] = {name: [] for name in engines}
                gaps: dict[str, list[float]] = {name: [] for name in engines}
                outs: dict[str, list[list[int]]] = {}
                accepted: dict[str, tuple[int, int, list[int], int]] = {}
                for r in range(args.repeats):
                    for name, engine in engines.items():  # interleaved: the same noise for all
                        before = (await engine.get_stats()).spec_decoding
                        _, g, o, rate = await _cell(engine, f"{kind}-{batch}-{r}-{len(rows)}",
                                                    prompts, batch, params)
                        after = (await engine.get_stats()).spec_decoding
                        rates[name].append(rate)
                        gaps[name] += g
                        outs[name] = o
                        if before is not None and after is not None:
                            prev = accepted.get(name, (0, 0, [0] * len(after.accepted_per_pos), 0))
                            accepted[name] = (
                                prev[0] + after.num_accepted_tokens - before.num_accepted_tokens,
                                prev[1] + after.num_draft_tokens - before.num_draft_tokens,
                                [p + a - b for p, a, b in zip(prev[2], after.accepted_per_pos,
                                                              before.accepted_per_pos, strict=True)],
                                prev[3] + after.num_drafts - before.num_drafts)
                plain_rate = median(rates["none"])
                for name in engines:
                    same = sum(a == b for a, b in zip(outs[name], outs["none"], strict=True))
                    acc = accepted.get(name)
                    rate = median(rates[name])
                    rows.append([
                        kind, batch, "none" if name == "none" else _short(name), round(rate, 1),
                        round(1000 * percentile(gaps[name], 50), 1),
                        round(1000 * percentile(gaps[name], 99), 1), round(rate / plain_rate, 2),
                        f"{same}/{len(prompts)}",
                        "-" if acc is None or not acc[1] else f"{acc[0] / acc[1]:.2f}",
                        "-" if acc is None or not acc[3] else
                        " ".join(f"{a / acc[3]:.2f}" for a in acc[2])])
    finally:
        for engine in engines.values():
            await engine.close()
    return rows


def _short(spec: str) -> str:
    import json

    d = json.loads(spec)
    return f"{d.get('method', 'ngram')} k={d.get('num_speculative_tokens')}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = asyncio.run(run(args))
    print(machine_line(args.num_threads or 0, None))
    print(f"greedy, {args.output_len} new tokens, requests per cell: "
          f"{args.requests or 'max(3, batch)'}, repeats {args.repeats}")
    print(markdown_table(["workload", "batch", "proposer", "output tok/s", "ITL p50 ms",
                          "ITL p99 ms", "vs none", "same tokens", "acceptance",
                          "accepted per position"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
