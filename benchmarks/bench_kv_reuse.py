"""Cross-instance prefix reuse through the KV store (issue #5): engine A computes a prompt with a
2,048-token prefix and saves its KV; engine B, another instance that never saw it, gets the
same prefix with a different suffix and loads the prefix instead of computing it. Compared with
engine C computing B's prompt from scratch, in the same run. Target: B's TTFT >= 5x lower.

    python benchmarks/bench_kv_reuse.py [--repeats 3] [--prefix 2048] [--suffix 32]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import (
    markdown_table,
    median,
    random_token_ids,
    resolve_model_folder,
    set_threads,
    vocab_size,
)
from benchmarks.kvstore_process import StoreProcess
from engine.config import DEFAULT_MODEL


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=256, help="KV store chunk (LMCache's 256)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from engine.sampling_params import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens or 0


def main(argv: Sequence[str] | None = None) -> int:
    from engine.llm import LLM

    args = parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    common = dict(model=str(folder), num_threads=args.threads, kv_cache_gib=0.5,
                  max_num_batched_tokens=2048)
    rng = np.random.default_rng(0)
    with StoreProcess() as store:
        conn = dict(kv_connector="kvstore", kv_role="kv_both", kv_store_url=store.url,
                    kv_chunk_size=args.chunk_size)
        a, b, c = LLM(**common, **conn), LLM(**common, **conn), LLM(**common)
        ttft(c, random_token_ids(rng, 64, vocab_size(folder)))  # warm-up
        ttft(b, random_token_ids(rng, 64, vocab_size(folder)))
        reuse, scratch, cached = [], [], []
        for _ in range(args.repeats):
            prefix = random_token_ids(rng, args.prefix, vocab_size(folder))
            ttft(a, prefix + random_token_ids(rng, args.suffix, vocab_size(folder)))
            prompt = prefix + random_token_ids(rng, args.suffix, vocab_size(folder))
            t_b, n_cached = ttft(b, prompt)
            t_c, _ = ttft(c, prompt)
            reuse.append(t_b)
            scratch.append(t_c)
            cached.append(n_cached)
        for engine in (a, b, c):
            engine.engine_core.shutdown()
    speedup = median(scratch) / median(reuse)
    print(f"cross-instance reuse: model {folder.name}, fp32, {args.threads} threads, prefix "
          f"{args.prefix} + suffix {args.suffix} tokens, median of {args.repeats}; target >= 5x")
    print(markdown_table(
        ["engine", "median TTFT ms", "prompt tokens loaded", "speedup", "target"],
        [["C: computes the prompt", f"{median(scratch) * 1e3:.0f}", 0, "1.00", "-"],
         ["B: loads the prefix A computed", f"{median(reuse) * 1e3:.0f}", int(median(cached)),
          f"{speedup:.2f}", "ok" if speedup >= 5 else "MISS"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
