"""Tile sweep for the two Triton attention kernels on a CUDA GPU, at bench_gpu.py's shapes.

Each configuration is first checked against its reference on random data (bf16 tolerance), then
timed (CUDA events, median); the table lists the fastest configurations and the current defaults
beside the peer of bench_gpu.py (copy bandwidth for decode, SDPA for prefill).

    python benchmarks/tune_attention_gpu.py [--repeats 20] [--top 6]
    python benchmarks/tune_attention_gpu.py --prefill-ab 64,64,4,2 128,64,4,2 [--rounds 15]

--prefill-ab times two prefill configurations (block_m,block_n,num_warps,num_stages) in
alternation, `--rounds` rounds of `--repeats` calls each, beside SDPA: an A/B that clock drift
and run-to-run noise cannot bias toward either side.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_gpu import copy_bandwidth, cuda_time, paged_case, prefill_case
from benchmarks.common import markdown_table, median

Config = tuple[int, int, int, int]


def sweep(configs: Iterable[Config], run: Callable[[Config], torch.Tensor],
          check: Callable[[torch.Tensor], None], repeats: int) -> list[tuple[float, Config, str]]:
    """(seconds, config, error) per configuration, fastest first; one that fails to compile or
    gives a wrong result is kept with its error and an infinite time."""
    results = []
    for cfg in configs:
        try:
            check(run(cfg))
            secs = cuda_time(lambda cfg=cfg: run(cfg), repeats)  # type: ignore[misc]
        except Exception as exc:
            results.append((float("inf"), cfg, type(exc).__name__))
            continue
        results.append((secs, cfg, ""))
    return sorted(results, key=lambda r: r[0])


def table_rows(results: list[tuple[float, Config, str]], top: int, default: Config,
               name: Callable[[Config], str],
               cells: Callable[[float], list[object]]) -> list[list[object]]:
    """The `top` fastest, then the default (wherever it ranked), then up to 5 failures."""
    keep = results[:top] + [r for r in results[top:] if r[1] == default]
    rows: list[list[object]] = [
        [name(cfg) + (" (default)" if cfg == default else ""), *cells(secs)]
        for secs, cfg, err in keep if not err]
    failed: list[list[object]] = [[f"{name(cfg)} failed", err, "", ""]
                                  for _, cfg, err in results if err]
    return rows + failed[:5]


def decode_rows(repeats: int, top: int, copy_bw: float) -> list[list[object]]:
    from kernels.triton.paged_decode import (
        DEFAULT_PARTITION_SIZE,
        DEFAULT_TILE_TOKENS,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    batch, ctx, heads, kvh, d, bs, dt = 64, 4096, 32, 8, 64, 16, torch.bfloat16
    cache, table = paged_case([ctx] * batch, bs, kvh, d, dt)
    q = torch.randn(batch, heads, d, device="cuda", dtype=dt)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    ref = paged_decode_attention_reference(q[:4].float(), cache.float(), table[:4], seq_lens[:4],
                                           d**-0.5).to(dt)
    kv_bytes = batch * ctx * 2 * kvh * d * dt.itemsize

    def run(cfg: Config) -> torch.Tensor:
        return paged_decode_attention(q, cache, table, seq_lens, d**-0.5, max_seq_len=ctx,
                                      partition_size=cfg[0], tile_tokens=cfg[1],
                                      num_warps=cfg[2], num_stages=cfg[3])

    def check(out: torch.Tensor) -> None:
        torch.testing.assert_close(out[:4], ref, atol=1.6e-2, rtol=1.6e-2)

    results = sweep(itertools.product((256, 512, 1024, 2048), (32, 64, 128), (2, 4, 8), (2, 3)),
                    run, check, repeats)
    return table_rows(
        results, top, (DEFAULT_PARTITION_SIZE, DEFAULT_TILE_TOKENS, 4, 2),
        lambda c: f"decode part {c[0]} tile {c[1]} w{c[2]} s{c[3]}",
        lambda secs: [f"{secs * 1e6:.1f} us", f"{kv_bytes / secs / 1e9:.0f} GB/s",
                      f"{kv_bytes / secs / copy_bw:.2f} of copy"])


def prefill_rows(repeats: int, top: int) -> list[list[object]]:
    from kernels.triton.prefill_attention import _default_tiles

    ours, sdpa = prefill_case()
    ref = sdpa().transpose(1, 2).flatten(0, 1)
    t_sdpa = cuda_time(sdpa, repeats)

    def run(cfg: Config) -> torch.Tensor:
        return ours(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])

    def check(out: torch.Tensor) -> None:
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

    results = sweep(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)), run, check,
                    repeats)
    return table_rows(
        results, top, (*_default_tiles(False, 64), 2),
        lambda c: f"prefill m{c[0]} n{c[1]} w{c[2]} s{c[3]}",
        lambda secs: [f"{secs * 1e3:.3f} ms", f"SDPA {t_sdpa * 1e3:.3f} ms",
                      f"{t_sdpa / secs:.2f} of SDPA"])


def prefill_ab(a: str, b: str, rounds: int, repeats: int) -> list[list[object]]:
    ours, sdpa = prefill_case()
    ref = sdpa().transpose(1, 2).flatten(0, 1)
    fns: dict[str, Callable[[], torch.Tensor]] = {"sdpa": sdpa}
    for spec in (a, b):
        m, n, w, s = (int(x) for x in spec.split(","))
        fns[spec] = lambda m=m, n=n, w=w, s=s: ours(  # type: ignore[misc]
            block_m=m, block_n=n, num_warps=w, num_stages=s)
        torch.testing.assert_close(fns[spec](), ref, atol=2e-2, rtol=2e-2)
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            times[key].append(cuda_time(fn, repeats))
    t_sdpa = median(times["sdpa"])
    return [[f"prefill A/B block_m,block_n,warps,stages = {spec}",
             f"{median(times[spec]) * 1e3:.3f} ms (rounds {min(times[spec]) * 1e3:.3f}-"
             f"{max(times[spec]) * 1e3:.3f} ms)",
             f"SDPA {t_sdpa * 1e3:.3f} ms", f"{t_sdpa / median(times[spec]):.2f} of SDPA"]
            for spec in (a, b)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--prefill-ab", nargs=2, metavar=("A", "B"))
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_attention_gpu: no CUDA device", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth(args.repeats)
    if args.prefill_ab:
        rows = prefill_ab(args.prefill_ab[0], args.prefill_ab[1], args.rounds, args.repeats)
    else:
        rows = decode_rows(args.repeats, args.top, copy_bw) + prefill_rows(args.repeats, args.top)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of "
          f"{args.repeats}; copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(markdown_table(["configuration", "time", "rate / peer", "ratio"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
