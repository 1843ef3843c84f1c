"""`kernels.moe.moe_grouped` (the CPU MoE path) against its peers on one MoE layer, in one run.

Peers, all on the same weights and the same routing (softmax top-k of a random router,
renormalised as in Qwen3-MoE):
- dense: the naive loop over all E experts, each computing every token, masked by its routing
  weight (E/K times the FLOPs of the sparse paths);
- hf eager: transformers' `Qwen3MoeExperts` (the expert half of `Qwen3MoeSparseMoeBlock`) with
  `_experts_implementation = "eager"` (a loop over hit experts with `torch.where` per expert);
- hf grouped_mm: the same module with transformers' "grouped_mm" implementation, when it runs;
- reference: `kernels.moe.moe_reference`, one (token, choice) pair at a time (only up to
  `--reference-max-tokens`, it is slow).
Default shape: Qwen3-30B-A3B's experts scaled down (H=1024, I=768, E=64, top-8; theirs is
H=2048, E=128). Ours and each peer are called alternately (`--repeats` times each) so that load
from other processes hits both alike; times are medians in milliseconds ("ours ms" over all its
pairings), a ratio is median(peer) / median(ours) within that pairing (> 1: ours is faster).
Every peer's output is checked against ours first.

    python benchmarks/bench_moe.py [--threads 1] [--tokens 1,4,64,512] [--repeats 5] [--dtype float32]
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
from kernels.moe import moe_grouped, moe_reference

MoeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weights, ids) -> out


def dense_all_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The naive peer: every expert on all T tokens, scaled by a [T, E] routing matrix (0 where
    not chosen) and summed. x [T, H], w13 [E, 2I, H], w2 [E, H, I]; returns [T, H]."""
    inter = w13.shape[1] // 2
    route = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32)
    route.scatter_add_(1, topk_ids, topk_weights.float())  # [T, E]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w13.shape[0]):
        h = x @ w13[e].t()  # [T, 2I]
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()  # [T, H]
        out += route[:, e:e + 1] * y.float()
    return out.to(x.dtype)


def hf_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int, implementation: str) -> MoeFn:
    """transformers' Qwen3MoeExperts holding w13 / w2, called with our routing."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    num_experts, two_inter, hidden = w13.shape
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=two_inter // 2,
                            num_experts=num_experts, num_experts_per_tok=top_k, hidden_act="silu")
    config._experts_implementation = implementation
    experts = Qwen3MoeExperts(config).to(w13.dtype)
    experts.gate_up_proj.data = w13
    experts.down_proj.data = w2
    return lambda x, weights, ids: experts(x, ids, weights.to(x.dtype))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax over experts in float32, top-k, renormalised to sum 1."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def paired_ms(ours: MoeFn, peer: MoeFn, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              repeats: int) -> tuple[list[float], list[float]]:
    """Times of `ours` and `peer` in ms, alternating call by call after one warm-up each, so that
    load from other processes on a shared machine falls on both alike."""
    ours(x, weights, ids)
    peer(x, weights, ids)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, times[0]), (peer, times[1])):
            start = time.perf_counter()
            fn(x, weights, ids)
            out.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,4,64,512")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reference-max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    set_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    w13 = (torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i) / i ** 0.5).to(dtype)
    router = torch.randn(e, h).to(dtype)
    ours: MoeFn = lambda x, w, ids: moe_grouped(x, w13, w2, w, ids)  # noqa: E731
    peers: dict[str, MoeFn] = {"dense": lambda x, w, ids: dense_all_experts(x, w13, w2, w, ids),
                               "hf eager": hf_experts(w13, w2, k, "eager"),
                               "hf grouped_mm": hf_experts(w13, w2, k, "grouped_mm"),
                               "reference": lambda x, w, ids: moe_reference(x, w13, w2, w, ids)}
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    table = []
    with torch.inference_mode():
        for t in (int(s) for s in args.tokens.split(",")):
            x = torch.randn(t, h).to(dtype)
            weights, ids = route(x, router, k)
            want = ours(x, weights, ids)
            ours_times: list[float] = []
            cells: list[object] = []
            for name, fn in peers.items():
                if name == "reference" and t > args.reference_max_tokens:
                    cells += ["-", "-"]
                    continue
                try:
                    got = fn(x, weights, ids)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. grouped_mm without a CPU kernel
                    print(f"{name} failed at T={t}: {exc}", file=sys.stderr)
                    cells += ["n/a", "n/a"]
                    continue
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
                mine, theirs = paired_ms(ours, fn, x, weights, ids, args.repeats)
                ours_times += mine
                cells += [median(theirs), median(theirs) / median(mine)]
            row: list[object] = [t, median(ours_times), *cells]
            table.append(row)
    headers = ["T", "ours ms"] + [c for name in peers for c in (f"{name} ms", f"{name}/ours")]
    print(f"moe_grouped vs peers: H={h} I={i} E={e} top-{k}, {args.dtype}, {args.threads} torch "
          f"thread(s), median of {args.repeats}")
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
