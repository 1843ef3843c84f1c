"""Prefix caching: TTFT of requests that share a long prefix, with caching on and off.

32 requests share a 1,024-token prefix of random ids (seeded) and each add a distinct 16..64-token
suffix. For each setting a fresh engine (same process) first runs one warm-up request with the
prefix, then the 32 requests one at a time, so each TTFT (first_token_time - arrival_time from
the request's metrics) is measured on an idle engine. Reports median and p90 TTFT, the ratio
off/on, and the share of prompt tokens served from the cache.

    python benchmarks/bench_prefix_cache.py [--num-requests 32] [--prefix-len 1024]
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    ModelShape,
    machine_line,
    markdown_table,
    median,
    percentile,
    random_token_ids,
    resolve_model_folder,
    set_threads,
)
from engine.config import DEFAULT_MODEL


@dataclass
class CacheRun:
    """TTFTs (seconds) and cached token counts of the measured requests of one setting."""

    caching: bool
    ttfts: list[float]
    cached_tokens: list[int]
    prompt_tokens: list[int]

    @property
    def hit_rate(self) -> float:
        return sum(self.cached_tokens) / max(1, sum(self.prompt_tokens))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local HF folder")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--min-suffix", type=int, default=16)
    p.add_argument("--max-suffix", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    return p.parse_args(argv)


def build_prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """The warm-up prompt and the measured prompts: a shared prefix plus distinct suffixes."""
    rng = np.random.default_rng(args.seed)
    prefix = random_token_ids(rng, args.prefix_len, vocab_size)
    lengths = rng.integers(args.min_suffix, args.max_suffix + 1, size=args.num_requests + 1)
    prompts = [prefix + random_token_ids(rng, int(n), vocab_size) for n in lengths]
    return prompts[0], prompts[1:]


def run_setting(
    folder: Path, warm: list[int], prompts: list[list[int]], caching: bool,
    args: argparse.Namespace,
) -> CacheRun:
    """A fresh engine: one warm-up request, then every prompt alone, in order."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=str(folder), dtype="float32", kv_cache_gib=args.kv_cache_gib,
              enable_prefix_caching=caching, num_threads=args.threads)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([warm], params, use_tqdm=False)
    run = CacheRun(caching, [], [], [])
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        if out.metrics is None or out.metrics.ttft is None:
            raise RuntimeError("the engine returned no first-token time in RequestOutput.metrics")
        run.ttfts.append(out.metrics.ttft)
        cached = out.num_cached_tokens
        run.cached_tokens.append(out.metrics.num_cached_tokens if cached is None else cached)
        run.prompt_tokens.append(len(prompt))
    stop = getattr(llm, "shutdown", None)
    if callable(stop):
        stop()
    del llm
    gc.collect()
    return run


def report_rows(on: CacheRun, off: CacheRun) -> list[list[object]]:
    rows: list[list[object]] = []
    for run in (off, on):
        speedup = median(off.ttfts) / median(run.ttfts)
        rows.append(["on" if run.caching else "off", median(run.ttfts) * 1e3,
                     percentile(run.ttfts, 90) * 1e3, speedup, run.hit_rate,
                     int(median([float(c) for c in run.cached_tokens]))])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    warm, prompts = build_prompts(args, ModelShape.from_folder(folder).vocab_size)
    on = run_setting(folder, warm, prompts, True, args)
    off = run_setting(folder, warm, prompts, False, args)
    print(f"prefix cache: {len(prompts)} sequential requests, shared prefix {args.prefix_len} "
          f"tokens + suffix {args.min_suffix}..{args.max_suffix}, {args.output_len} new tokens, "
          f"fp32, model {folder.name}; prefix warmed by one request first")
    print(machine_line(args.threads, None))
    headers = ["prefix caching", "median TTFT ms", "p90 TTFT ms", "median speedup",
               "hit rate", "median cached tokens"]
    print(markdown_table(headers, report_rows(on, off)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
