"""Tile sweep for the two Triton attention kernels on a CUDA GPU, at bench_gpu.py's shapes.

Each configuration is first checked against its reference on fresh random data (bf16 tolerance),
then timed (CUDA events, median); the table lists the fastest configurations and the current
defaults beside the peer of bench_gpu.py (copy bandwidth for decode, SDPA for prefill).

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
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_gpu import copy_bandwidth, cuda_time, paged_case
from benchmarks.common import markdown_table, median


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
    default = (DEFAULT_PARTITION_SIZE, DEFAULT_TILE_TOKENS, 4, 2)
    results = []
    for cfg in itertools.product((256, 512, 1024, 2048), (32, 64, 128), (2, 4, 8), (2, 3)):
        part, tile, warps, stages = cfg
        if tile > part:
            continue

        def run(part: int = part, tile: int = tile, warps: int = warps,
                stages: int = stages) -> torch.Tensor:
            return paged_decode_attention(q, cache, table, seq_lens, d**-0.5, max_seq_len=ctx,
                                          partition_size=part, tile_tokens=tile, num_warps=warps,
                                          num_stages=stages)
        try:
            out = run()
            torch.testing.assert_close(out[:4], ref, atol=1.6e-2, rtol=1.6e-2)
            secs = cuda_time(run, repeats)
        except Exception as exc:  # a configuration that does not compile or is wrong is listed
            results.append((float("inf"), cfg, f"{type(exc).__name__}"))
            continue
        results.append((secs, cfg, ""))
    results.sort(key=lambda r: r[0])
    keep = results[:top] + [r for r in results if r[1] == default and r not in results[:top]]
    rows: list[list[object]] = []
    for secs, cfg, err in keep:
        bw = kv_bytes / secs
        tag = " (default)" if cfg == default else ""
        rows.append([f"decode part {cfg[0]} tile {cfg[1]} w{cfg[2]} s{cfg[3]}{tag}",
                     err or f"{secs * 1e6:.1f} us", f"{bw / 1e9:.0f} GB/s",
                     f"{bw / copy_bw:.2f} of copy"])
    failed: list[list[object]] = [[f"decode {cfg} failed", err, "", ""]
                                  for _, cfg, err in results if err]
    rows += failed[:5]
    return rows


def prefill_case() -> tuple[Callable[..., torch.Tensor], Callable[[], torch.Tensor]]:
    """(ours(block_m, block_n, num_warps, num_stages), sdpa()) on bench_gpu.py's prefill shape."""
    import torch.nn.functional as F

    from kernels.triton.prefill_attention import paged_prefill_attention
    from kernels.triton.reshape_and_cache import reshape_and_cache

    reqs, n, heads, kvh, d, bs, dt = 16, 1024, 32, 8, 64, 16, torch.bfloat16
    q = torch.randn(reqs * n, heads, d, device="cuda", dtype=dt)
    k = torch.randn(reqs * n, kvh, d, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    cache, table = paged_case([n] * reqs, bs, kvh, d, dt)
    pos = torch.arange(n, device="cuda")
    slots = torch.cat([table[i, pos // bs].long() * bs + pos % bs for i in range(reqs)])
    reshape_and_cache(k, v, cache, slots)
    cu = torch.arange(0, reqs * n + 1, n, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((reqs,), n, dtype=torch.int32, device="cuda")
    qs = q.view(reqs, n, heads, d).transpose(1, 2).contiguous()
    ks = k.view(reqs, n, kvh, d).transpose(1, 2).contiguous()
    vs = v.view(reqs, n, kvh, d).transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    def ours(bm: int, bn: int, warps: int, stages: int) -> torch.Tensor:
        return paged_prefill_attention(q, cache, table, cu, seq_lens, d**-0.5, max_query_len=n,
                                       block_m=bm, block_n=bn, num_warps=warps,
                                       num_stages=stages)

    return ours, sdpa


def prefill_rows(repeats: int, top: int) -> list[list[object]]:
    from kernels.triton.prefill_attention import _default_tiles

    ours, sdpa = prefill_case()
    reqs, n, heads, d = 16, 1024, 32, 64
    ref = sdpa().transpose(1, 2).reshape(reqs * n, heads, d)
    t_sdpa = cuda_time(sdpa, repeats)
    m0, n0, w0 = _default_tiles(False, d)
    default = (m0, n0, w0, 2)
    results = []
    for cfg in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        bm, bn, warps, stages = cfg

        def run(bm: int = bm, bn: int = bn, warps: int = warps, stages: int = stages) -> torch.Tensor:
            return ours(bm, bn, warps, stages)
        try:
            torch.testing.assert_close(run(), ref, atol=2e-2, rtol=2e-2)
            secs = cuda_time(run, repeats)
        except Exception as exc:
            results.append((float("inf"), cfg, f"{type(exc).__name__}"))
            continue
        results.append((secs, cfg, ""))
    results.sort(key=lambda r: r[0])
    keep = results[:top] + [r for r in results if r[1] == default and r not in results[:top]]
    rows: list[list[object]] = []
    for secs, cfg, err in keep:
        tag = " (default)" if cfg == default else ""
        rows.append([f"prefill m{cfg[0]} n{cfg[1]} w{cfg[2]} s{cfg[3]}{tag}",
                     err or f"{secs * 1e3:.3f} ms", f"SDPA {t_sdpa * 1e3:.3f} ms",
                     f"{t_sdpa / secs:.2f} of SDPA"])
    failed: list[list[object]] = [[f"prefill {cfg} failed", err, "", ""]
                                  for _, cfg, err in results if err]
    rows += failed[:5]
    return rows


def prefill_ab(a: str, b: str, rounds: int, repeats: int) -> list[list[object]]:
    ours, sdpa = prefill_case()
    cfgs = [tuple(int(x) for x in c.split(",")) for c in (a, b)]
    ref = sdpa().transpose(1, 2).reshape(ours(*cfgs[0]).shape)
    for cfg in cfgs:
        torch.testing.assert_close(ours(*cfg), ref, atol=2e-2, rtol=2e-2)
    times: dict[object, list[float]] = {cfgs[0]: [], cfgs[1]: [], "sdpa": []}

    def call(key: object) -> Callable[[], torch.Tensor]:
        return sdpa if key == "sdpa" else lambda: ours(*key)  # type: ignore[misc]

    for _ in range(rounds):
        for key in times:
            times[key].append(cuda_time(call(key), repeats))
    t_sdpa = median(times["sdpa"])
    rows: list[list[object]] = []
    for cfg in cfgs:
        spread = f"{min(times[cfg]) * 1e3:.3f}-{max(times[cfg]) * 1e3:.3f} ms"
        rows.append([f"prefill A/B m{cfg[0]} n{cfg[1]} w{cfg[2]} s{cfg[3]}",
                     f"{median(times[cfg]) * 1e3:.3f} ms (rounds {spread})",
                     f"SDPA {t_sdpa * 1e3:.3f} ms", f"{t_sdpa / median(times[cfg]):.2f} of SDPA"])
    return rows


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
