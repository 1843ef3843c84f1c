"""The new architectures on workload A, and what a sliding window saves in KV blocks: one table.

Rows 1-2: this engine against transformers `generate` (static batches of 16) on workload A
(random-id prompts of 64..512 tokens, 128 new tokens each, greedy, EOS ignored, float32,
2 threads) for Gemma 3 270M (the catalog model, fetched and converted on first use) and a tiny
random Qwen3-MoE (8 layers, 16 experts, top-4). Row 3: KV blocks a request holds in the engine
on the same workload for a Mistral-shaped random model with a 128-key window on every layer
against the same model with the window off (blocks of 16; means over requests of the blocks
each held at its last step and of the most it held, and the most the batch held at once: a
prompt's blocks are all taken while it is prefilled, so the savings show as requests decode).
Row 4: the same for a Gemma 3-shaped random model (5 local layers with the window to 1 global)
with vLLM's hybrid KV cache manager (the local layers' groups free their blocks) against it
off (every block kept), in blocks of every layer.

    python benchmarks/bench_models.py [--num-prompts 64] [--skip-hf] [--only gemma,moe,window,hybrid]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_workload_a import compare_tokens, run_systems
from benchmarks.common import (
    machine_line,
    markdown_table,
    measure_gemm_flops,
    random_prompts,
    resolve_model_folder,
    set_threads,
    vocab_size,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--window", type=int, default=128, help="the windowed model's window")
    p.add_argument("--skip-hf", action="store_true", help="engine rows only")
    p.add_argument("--only", default="gemma,moe,window,hybrid", help="which rows (comma-separated)")
    return p.parse_args(argv)


def _with_tokenizer(folder: Path) -> Path:
    """Gives a random model folder the default model's tokenizer (same vocabulary size)."""
    import shutil

    from engine.config import DEFAULT_MODEL

    source = resolve_model_folder(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def tiny_moe(folder: Path) -> Path:
    """A random Qwen3-MoE of about 60M parameters (the default model's vocabulary size)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                            moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=16,
                            num_experts_per_tok=4, norm_topk_prob=True,
                            max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return _with_tokenizer(folder)


def windowed(folder: Path, window: int | None) -> Path:
    """A random Mistral-shaped model (the default model's size) with `window` on every layer."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           max_position_embeddings=2048, sliding_window=window,
                           tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return _with_tokenizer(folder)


def hybrid(folder: Path, window: int) -> Path:
    """A random Gemma 3-shaped model of the default model's size: 30 layers, 5 local (a `window`
    key window) to 1 global."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, max_position_embeddings=2048, sliding_window=window,
                              tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return _with_tokenizer(folder)


def throughput_row(label: str, folder: Path, args: argparse.Namespace) -> list[object]:
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab_size(folder),
                             args.seed)
    results = run_systems(folder, prompts, args)
    tokens = sum(len(p) for p in prompts) + len(prompts) * args.output_len
    engine = results[0]
    if len(results) == 1:
        return [label, f"{tokens / engine.time:.0f} tok/s ({engine.time:.1f} s)", "-", "-", "-"]
    hf = results[1]
    same, _ = compare_tokens(engine.token_ids, hf.token_ids)
    return [label, f"{tokens / engine.time:.0f} tok/s ({engine.time:.1f} s)",
            f"{tokens / hf.time:.0f} tok/s ({hf.time:.1f} s)", f"{hf.time / engine.time:.2f}x",
            f"{same}/{len(prompts)} identical"]


def blocks_held(folder: Path, args: argparse.Namespace, **engine: Any
                ) -> tuple[float, float, float, float]:
    """(mean over requests of the most blocks each held, of the blocks each held at its last
    step, most blocks in use at once, seconds of the run), in blocks of every layer: a hybrid
    model's pages hold fewer layers (engine/core/kv_layout.py), counted as that share of a block."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=str(folder), dtype="float32", kv_cache_gib=args.kv_cache_gib,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_threads=args.threads, block_size=16, **engine)
    kv = llm.engine_core.kv_cache_manager
    layout = llm.engine_core.kv_layout
    share = layout.layers_per_block / len(layout.layer_group)  # of a block of every layer
    most: dict[str, int] = {}
    last: dict[str, int] = {}
    peak = [0]
    allocate = kv.allocate_slots

    def recording(request: Any, *a: Any, **kw: Any) -> Any:
        out = allocate(request, *a, **kw)
        rid = request.request_id
        last[rid] = kv.num_held_blocks(rid)
        most[rid] = max(most.get(rid, 0), last[rid])
        peak[0] = max(peak[0], kv.block_pool.num_blocks - 1 - kv.num_free_blocks)
        return out

    kv.allocate_slots = recording  # type: ignore[method-assign]
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab_size(folder),
                             args.seed)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                         ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return (share * sum(most.values()) / len(most), share * sum(last.values()) / len(last),
            share * peak[0], seconds)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    only = set(args.only.split(","))
    gemm = measure_gemm_flops(2048)
    load_before = os.getloadavg()[0]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        if "gemma" in only:
            rows.append(throughput_row("Gemma 3 270M (Q4_K_M GGUF, dequantized)",
                                       resolve_model_folder("gemma-3-270m"), args))
        if "moe" in only:
            rows.append(throughput_row("tiny Qwen3-MoE (16 experts, top-4, random)",
                                       tiny_moe(Path(tmp) / "moe"), args))
        if "window" in only:
            on = blocks_held(windowed(Path(tmp) / "on", args.window), args)
            off = blocks_held(windowed(Path(tmp) / "off", None), args)
            rows.append([f"KV blocks a request holds at its last step, window {args.window} vs off",
                         f"{on[1]:.1f}", f"{off[1]:.1f} (window off)",
                         f"{off[1] / on[1]:.2f}x fewer", "-"])
            rows.append(["KV blocks: most a request held / most in use at once",
                         f"{on[0]:.1f} / {on[2]:.0f}", f"{off[0]:.1f} / {off[2]:.0f} (window off)",
                         f"{off[0] / on[0]:.2f}x / {off[2] / on[2]:.2f}x", "-"])
        if "hybrid" in only:
            folder = hybrid(Path(tmp) / "hybrid", args.window)
            on = blocks_held(folder, args)
            off = blocks_held(folder, args, disable_hybrid_kv_cache_manager=True)
            rows.append([f"hybrid 5 local : 1 global, window {args.window}: KV blocks (of every "
                         "layer) a request holds at its last step",
                         f"{on[1]:.1f}", f"{off[1]:.1f} (hybrid manager off)",
                         f"{off[1] / on[1]:.2f}x fewer", "-"])
            rows.append(["hybrid: most a request held / most in use at once",
                         f"{on[0]:.1f} / {on[2]:.0f}", f"{off[0]:.1f} / {off[2]:.0f} (off)",
                         f"{off[0] / on[0]:.2f}x / {off[2] / on[2]:.2f}x", "-"])
            rows.append(["hybrid: engine seconds for the workload (one group per kind vs one)",
                         f"{on[3]:.1f} s", f"{off[3]:.1f} s (off)", f"{off[3] / on[3]:.2f}x", "-"])
    print(f"workload A: {args.num_prompts} prompts of {args.min_len}..{args.max_len} random ids, "
          f"{args.output_len} new tokens each, greedy, ignore EOS, fp32; median of {args.repeats} "
          f"run(s); transformers in static batches of {args.hf_batch_size}")
    print(machine_line(args.threads, gemm) + f"; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(markdown_table(["workload", "engine", "peer (transformers)", "ratio", "greedy tokens"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
