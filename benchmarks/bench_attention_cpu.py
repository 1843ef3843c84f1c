"""The CPU attention kernels on the default model's shapes, against what they replace, in one run.

Prefill (`kernels/cpu/paged_prefill.c`): `--prompts` fresh prompts of 64..512 tokens (seeded),
9 query / 3 kv heads of 64, block size 16, scattered blocks, one call for all of them, in bf16
and float32; the peer is PyTorch's SDPA (`is_causal`, `enable_gqa`) per prompt on the same
K/V, which the engine used before the kernel. Each row also gives the largest error against the
float32 reference (`paged_prefill_reference`).

Decode (`kernels/cpu/paged_decode.c`): `--decode-reqs` requests with contexts of 128..576
tokens, one cache per layer for 30 layers (the default model's KV bytes per step), scattered
blocks; the peer is the memory floor: one sequential read of the same caches (`sum`), and the
kernel's time with every request on the same few blocks (no DRAM traffic) says how much of it
is arithmetic.

Medians of `--repeats` runs; these 2-core machines are noisy (run nothing else at the time).

    python benchmarks/bench_attention_cpu.py [--threads 2] [--prompts 16] [--decode-reqs 64]
        [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import machine_line, markdown_table, median, set_threads
from kernels.cpu import paged_decode as pd
from kernels.cpu import paged_prefill as pp

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30  # SmolLM2-135M
SCALE = HEAD_DIM ** -0.5


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def scattered_table(lens: list[int], gen: torch.Generator, spare: int = 1) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled pool: every request's blocks land apart."""
    per = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per) + spare
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for r, n in enumerate(per):
        table[r, :n] = ids[at: at + n]
        at += n
    return table, num_blocks


def prefill_rows(args: argparse.Namespace) -> list[list[object]]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 513, (args.prompts,), generator=gen).tolist()
    table, num_blocks = scattered_table(lens, gen)
    cache32 = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    query32 = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=gen)
    return [prefill_row(args, dtype, lens, table, cache32, query32)
            for dtype in (torch.bfloat16, torch.float32)]


def prefill_row(args: argparse.Namespace, dtype: torch.dtype, lens: list[int], table: torch.Tensor,
                cache32: torch.Tensor, query32: torch.Tensor) -> list[object]:
    name = str(dtype).removeprefix("torch.")
    if not pp.supports(HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype):
        return [f"prefill {name}", "not supported on this CPU", "", "", "", ""]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    flops = sum(n * (n + 1) / 2 for n in lens) * HEADS * HEAD_DIM * 4
    cache, query = cache32.to(dtype), query32.to(dtype)
    want = pp.paged_prefill_reference(query, cache, table, starts, lens, lens, SCALE)
    out = torch.empty_like(query)
    per_req = [(s, n, table[i, : -(-n // BLOCK)].long())
               for i, (s, n) in enumerate(zip(starts, lens, strict=True))]

    def kernel() -> None:
        pp.paged_prefill(query, cache, table, starts, lens, lens, SCALE, out)

    def sdpa() -> None:
        for s, n, ids in per_req:
            k = cache[ids, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
            v = cache[ids, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
            F.scaled_dot_product_attention(query[s: s + n].transpose(0, 1)[None],
                                           k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=SCALE, enable_gqa=True)

    t_kernel, t_sdpa = timed(kernel, args.repeats), timed(sdpa, args.repeats)
    err = (out.float() - want).abs().max().item()
    return [f"prefill {name}, {len(lens)} prompts (1 layer)", f"{t_kernel * 1e3:.2f}",
            f"SDPA per prompt {t_sdpa * 1e3:.2f}", f"{t_sdpa / t_kernel:.2f}",
            f"{flops / t_kernel / 1e9:.0f} GFLOP/s", f"{err:.1e}"]


def decode_rows(args: argparse.Namespace) -> list[list[object]]:
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(128, 577, (args.decode_reqs,), generator=gen, dtype=torch.int32)
    table, num_blocks = scattered_table(lens.tolist(), gen, spare=16)
    return [decode_row(args, dtype, lens, table, num_blocks, gen)
            for dtype in (torch.bfloat16, torch.float32)]


def decode_row(args: argparse.Namespace, dtype: torch.dtype, lens: torch.Tensor,
               table: torch.Tensor, num_blocks: int, gen: torch.Generator) -> list[object]:
    same = (table % 8).contiguous()  # every request on blocks 0..7: the caches stay in CPU cache
    caches = [torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
              for _ in range(LAYERS)]
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(dtype).float()
    nbytes = int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * caches[0].element_size() * LAYERS
    total = sum(c.numel() * c.element_size() for c in caches)

    def step(tab: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for cache in caches:
                pd.paged_decode(query, cache, tab, lens, SCALE)
        return run

    def floor() -> None:
        for cache in caches:
            cache.view(-1).view(torch.int16).max()

    t_kernel = timed(step(table), args.repeats)
    t_cached = timed(step(same), args.repeats)
    t_floor = timed(floor, args.repeats) * nbytes / total  # the same read, scaled to its bytes
    name = str(dtype).removeprefix("torch.")
    return [f"decode {name}, {len(lens)} requests x {LAYERS} layers (1 step)", f"{t_kernel * 1e3:.1f}",
            f"sequential read of its KV {t_floor * 1e3:.1f}", f"{t_floor / t_kernel:.2f}",
            f"{nbytes / t_kernel / 1e9:.1f} GB/s; blocks in CPU cache {t_cached * 1e3:.1f} ms", ""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--decode-reqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    set_threads(args.threads)
    if not pp.available() or not pd.available():
        print("the CPU kernels are not built here (no C compiler, or PDSERVE_DISABLE_CPU_KERNELS=1)")
        return 1
    rows = prefill_rows(args) + decode_rows(args)
    print(f"# CPU attention kernels vs what they replace (SmolLM2-135M shapes), medians of {args.repeats}")
    print(machine_line(args.threads, None))
    print(markdown_table(["case", "kernel ms", "peer ms", "peer / kernel", "rate", "max err vs f32 ref"],
                         rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
