"""`engine.model.linear` against `F.linear` (its reference and the baseline) on the default
model's projection shapes, for the row counts of small decode batches, in one run.

Each shape gets 30 weight matrices (one per layer, 540 MB in all for the model) so the weights
come from RAM as in a real decode step, not from the CPU caches; the output head is one matrix.
Times are medians of `--repeats` passes over all the matrices, in microseconds per matrix.

    python benchmarks/bench_linear.py [--threads 1] [--rows 1,2,3,4,6,8] [--repeats 7]
        [--dtype float32|bfloat16]

With `--dtype bfloat16` "linear" is what the engine runs for bf16 on the CPU: the weights
prepacked for oneDNN (`engine.model.prepack`), and the table checks its bits equal `F.linear`'s.
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

from benchmarks.common import markdown_table, median, set_threads
from engine.model.linear import linear
from engine.model.prepack import can_prepack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # (out, in) of SmolLM2-135M


def per_matrix_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                  weights: list[torch.Tensor], repeats: int) -> float:
    for w in weights[:2]:
        fn(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append((time.perf_counter() - start) / len(weights) * 1e6)
    return median(times)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,3,4,6,8")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    pack = can_prepack(dtype, "cpu")
    set_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            weights = [torch.randn(out_f, in_f).to(dtype) for _ in range(1 if name == "lm_head" else 30)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights] if pack \
                else weights
            for rows in rows_list:
                x = torch.randn(rows, in_f).to(dtype)
                ref = per_matrix_us(F.linear, x, weights, args.repeats)
                ours = per_matrix_us(linear, x, packed, args.repeats)
                same = all(torch.equal(linear(x, pw), F.linear(x, w))
                           for pw, w in zip(packed, weights, strict=True))
                gbs = out_f * in_f * weights[0].element_size() / ours / 1e3
                table.append([name, rows, f"{ref:.0f}", f"{ours:.0f}", f"{ours / ref:.2f}", f"{gbs:.1f}",
                              "yes" if same else "NO"])
    how = "prepacked oneDNN" if pack else "engine.model.linear"
    print(f"linear ({how}) vs F.linear: {args.threads} torch thread(s), {args.dtype}, "
          f"median of {args.repeats} passes")
    print(markdown_table(["matrix", "rows", "F.linear us", "linear us", "ratio", "linear GB/s",
                          "bits equal"], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
