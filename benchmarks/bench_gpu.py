"""GPU benchmark (issue #3): the Triton kernels and the engine's CUDA path, one table.

Rows, each against its peer measured in the same run:
- decode attention (batch 64, 4k context, Llama-1B attention shape: 32 heads, 8 kv heads,
  head_dim 64, bf16, block 16, scattered blocks): KV bytes read per second against a
  device-to-device copy (bytes read + written per second). Target >= 0.80.
- prefill attention (16 fresh prompts of 1024 tokens, same shape, paged cache): time against
  `scaled_dot_product_attention(is_causal=True)` on the same, unpaged data. Target >= 0.8x.
- engine decode, Llama-1B-shaped random bf16 model, batch 1 / 16 / 64, 128-token prompts,
  128 new tokens (CUDA graphs): output tokens/s of the decode phase (a run with 129 new tokens
  minus a run with 1), against the weight-bandwidth floor (all weights + KV read once per step
  at the copy bandwidth) and against transformers `generate` measured the same way.
  Target at batch 64: >= 60% of the floor.

    python benchmarks/bench_gpu.py [--repeats 5] [--skip-engine] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import markdown_table, median

LLAMA_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    return p.parse_args(argv)


def cuda_time(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median seconds of `fn` over `repeats` timed calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def copy_bandwidth(repeats: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src), repeats)


def paged_case(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache with scattered blocks holding `lens` tokens per request, and its block table."""
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_req) + 1
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    ids = torch.randperm(num_blocks - 1, device="cuda") + 1
    table = torch.zeros(len(lens), max(per_req), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(per_req):
        table[i, :n] = ids[at:at + n].int()
        at += n
    return cache, table


def bench_decode(repeats: int, copy_bw: float) -> list[object]:
    from kernels.triton.paged_decode import paged_decode_attention

    batch, ctx, heads, kvh, d, bs, dt = 64, 4096, 32, 8, 64, 16, torch.bfloat16
    cache, table = paged_case([ctx] * batch, bs, kvh, d, dt)
    q = torch.randn(batch, heads, d, device="cuda", dtype=dt)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    secs = cuda_time(lambda: paged_decode_attention(q, cache, table, seq_lens, d**-0.5,
                                                    max_seq_len=ctx), repeats)
    kv_bytes = batch * ctx * 2 * kvh * d * dt.itemsize
    bw = kv_bytes / secs
    return ["decode attention b64 ctx4k bf16", f"{bw / 1e9:.0f} GB/s",
            f"copy {copy_bw / 1e9:.0f} GB/s", f"{bw / copy_bw:.2f}", "0.80"]


PrefillFn = Callable[..., torch.Tensor]


def prefill_case() -> tuple[PrefillFn, Callable[[], torch.Tensor]]:
    """16 fresh 1024-token prompts, Llama-1B attention shape, bf16, in a scattered paged cache:
    (ours(tiles) -> [tokens, heads, d], sdpa() -> [reqs, heads, L, d] on dense copies)."""
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
    qs, ks, vs = (t.view(reqs, n, -1, d).transpose(1, 2).contiguous() for t in (q, k, v))

    def ours(block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
             num_stages: int = 2) -> torch.Tensor:
        return paged_prefill_attention(q, cache, table, cu, seq_lens, d**-0.5, max_query_len=n,
                                       block_m=block_m, block_n=block_n, num_warps=num_warps,
                                       num_stages=num_stages)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    return ours, sdpa


def bench_prefill(repeats: int) -> list[object]:
    ours_fn, sdpa_fn = prefill_case()
    ours, sdpa = cuda_time(ours_fn, repeats), cuda_time(sdpa_fn, repeats)
    return ["prefill attention 16x1024 bf16", f"{ours * 1e3:.3f} ms", f"SDPA {sdpa * 1e3:.3f} ms",
            f"{sdpa / ours:.2f}", "0.80"]


def make_model(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config: Any = transformers.LlamaConfig(**LLAMA_1B)
    with torch.device("cuda"):
        model: Any = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)


def engine_decode_tps(folder: Path, batch: int, args: argparse.Namespace) -> float:
    from engine.config import EngineConfig
    from engine.core.outputs import EngineCoreRequest
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(folder), dtype="bfloat16", device="cuda",
                                   max_num_seqs=max(batch, 1), max_model_len=2048,
                                   max_num_batched_tokens=max(2048, batch * args.prompt_len),
                                   enable_prefix_caching=False))
    g = torch.Generator().manual_seed(batch)

    def run(new_tokens: int) -> float:
        for i in range(batch):
            prompt = torch.randint(100, 100000, (args.prompt_len,), generator=g).tolist()
            core.add_request(EngineCoreRequest(
                request_id=f"{new_tokens}-{i}-{time.monotonic_ns()}", prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                               ignore_eos=True),
                arrival_time=time.time()))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)  # warm-up
    full = median([run(args.new_tokens + 1) for _ in range(max(1, args.repeats // 2))])
    first = median([run(1) for _ in range(max(1, args.repeats // 2))])
    core.shutdown()
    return batch * args.new_tokens / (full - first)


def hf_decode_tps(model: object, batch: int, args: argparse.Namespace) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, 100000, (batch, args.prompt_len), generator=g).cuda()

    def run(new_tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[attr-defined]
                           do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)
    full = median([run(args.new_tokens + 1) for _ in range(max(1, args.repeats // 2))])
    first = median([run(1) for _ in range(max(1, args.repeats // 2))])
    return batch * args.new_tokens / (full - first)


def floor_tps(batch: int, args: argparse.Namespace, copy_bw: float) -> float:
    """Decode tokens/s if each step read every weight and the batch's KV cache exactly once at
    the copy's DRAM rate (read + write bytes/s of a device copy, which plain reads also reach)."""
    c = LLAMA_1B
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], \
        c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    weight_bytes = 2 * (layers * per_layer + vocab * h)
    avg_ctx = args.prompt_len + args.new_tokens / 2
    kv_bytes = 2 * batch * avg_ctx * layers * 2 * kv
    return batch / ((weight_bytes + kv_bytes) / copy_bw)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; this benchmark runs on a GPU only", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth(args.repeats)
    rows: list[list[object]] = []

    def add(row: list[object]) -> None:  # each row also goes to stderr as it lands: a run cut
        rows.append(row)                 # short by a lease's limit still reports what it had
        print("row:", " | ".join(str(c) for c in row), file=sys.stderr, flush=True)

    add(bench_decode(args.repeats, copy_bw))
    add(bench_prefill(args.repeats))
    if not args.skip_engine:
        import transformers

        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            make_model(folder)
            hf = None
            if not args.skip_hf:
                auto: Any = transformers.AutoModelForCausalLM
                hf = auto.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
            batches = [int(b) for b in args.batches.split(",")]
            hf_tps = {b: hf_decode_tps(hf, b, args) for b in batches} if hf is not None else {}
            del hf
            torch.cuda.empty_cache()
            for b in batches:
                tps = engine_decode_tps(folder, b, args)
                gc.collect()
                torch.cuda.empty_cache()
                floor = floor_tps(b, args, copy_bw)
                peer = f"floor {floor:.0f} tok/s"
                if b in hf_tps:
                    peer += f"; HF {hf_tps[b]:.0f} tok/s ({tps / hf_tps[b]:.2f}x)"
                add([f"engine decode b{b} Llama-1B bf16", f"{tps:.0f} tok/s", peer,
                     f"{tps / floor:.2f}", "0.60" if b == 64 else "-"])
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of "
          f"{args.repeats} runs; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(markdown_table(["measure", "ours", "peer (same run)", "ratio", "target"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
