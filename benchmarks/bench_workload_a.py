"""Workload A: this engine (continuous batching) against transformers `generate` (static batches).

64 prompts of random token ids, lengths uniform in 64..512 (seeded), 128 new tokens each,
greedy, EOS ignored, SmolLM2-135M in float32 on 2 torch threads, both systems in one process
and one run. Reports wall time, output and total tokens/s, the share of the compute floor
(ideal FLOPs / measured fp32 GEMM speed, divided by the measured time), the engine/transformers
ratio, and how many prompts got identical greedy tokens from both.

    python benchmarks/bench_workload_a.py [--repeats 3] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    ModelShape,
    machine_line,
    markdown_table,
    measure_gemm_flops,
    median,
    random_prompts,
    resolve_model_folder,
    set_threads,
    workload_flops,
)
from engine.config import DEFAULT_MODEL


@dataclass
class RunResult:
    """Wall times of the repeats and the generated token ids (of the last repeat)."""

    name: str
    times: list[float]
    token_ids: list[list[int]]

    @property
    def time(self) -> float:
        return median(self.times)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local HF folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="engine KV cache (2 GiB holds all of workload A without preemption)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system; medians")
    p.add_argument("--gemm-size", type=int, default=2048, help="matrix size of the GEMM probe")
    p.add_argument("--skip-hf", action="store_true", help="run only this engine")
    return p.parse_args(argv)


class EngineSystem:
    """This engine: all prompts in one `LLM.generate` call (it batches continuously)."""

    name = "engine"

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams

        self.llm = LLM(
            model=str(folder),
            dtype="float32",
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_threads=args.threads,
        )
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.llm.generate([[100] * 8], warm, use_tqdm=False)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        self.llm.shutdown()


class TransformersSystem:
    """transformers `generate` over static, left-padded batches in prompt order."""

    name = "transformers"

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else (
            self.model.config.eos_token_id)
        self.pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else _first(eos)
        gen_cfg.eos_token_id = None  # ignore EOS like the engine (no stop, no EOS masking)
        gen_cfg.pad_token_id = self.pad
        self.batch_size, self.output_len = args.hf_batch_size, args.output_len
        _hf_generate(self.model, [[100] * 8], 2, self.pad)  # warm-up

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        size = self.batch_size
        batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        return [t for b in batches for t in _hf_generate(self.model, b, self.output_len, self.pad)]

    def close(self) -> None:
        del self.model


def run_systems(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> list[RunResult]:
    """Loads the systems once, then times `repeats` rounds, alternating which one goes first."""
    systems: list[EngineSystem | TransformersSystem] = [EngineSystem(folder, args)]
    if not args.skip_hf:
        systems.append(TransformersSystem(folder, args))
    results = {s.name: RunResult(s.name, [], []) for s in systems}
    for repeat in range(args.repeats):
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            start = time.perf_counter()
            token_ids = system.generate(prompts)
            results[system.name].times.append(time.perf_counter() - start)
            results[system.name].token_ids = token_ids
    for system in systems:
        system.close()
    gc.collect()
    return [results[s.name] for s in systems]


def _first(token_id: int | list[int] | None) -> int:
    if isinstance(token_id, list):
        return int(token_id[0]) if token_id else 0
    return 0 if token_id is None else int(token_id)


def _hf_generate(model: object, batch: list[list[int]], new_tokens: int, pad: int) -> list[list[int]]:
    """Greedy-generate exactly `new_tokens` for each prompt of a left-padded batch."""
    import torch

    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [batch, width]
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )  # [batch, width + new_tokens]
    new = out[:, width:].tolist()
    if any(len(t) != new_tokens for t in new):
        raise RuntimeError(f"transformers generated {len(new[0])} tokens, expected {new_tokens}")
    return new


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """Number of prompts with identical tokens, and (prompt index, first differing position)."""
    mismatches = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            first = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                         min(len(x), len(y)))
            mismatches.append((i, first))
    return len(a) - len(mismatches), mismatches


def report_rows(
    results: list[RunResult], total_tokens: int, output_tokens: int, floor_s: float
) -> list[list[object]]:
    """One table row per system; the ratio column is against transformers when it ran."""
    hf = next((r for r in results if r.name == "transformers"), None)
    rows: list[list[object]] = []
    for r in results:
        ratio = float("nan") if hf is None else hf.time / r.time  # = ratio of total tok/s
        rows.append([r.name, r.time, output_tokens / r.time, total_tokens / r.time,
                     floor_s / r.time, ratio])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    shape = ModelShape.from_folder(folder)
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, shape.vocab_size,
                             args.seed)
    prompt_lens = [len(p) for p in prompts]
    gemm = measure_gemm_flops(args.gemm_size)
    floor_s = workload_flops(shape, prompt_lens, args.output_len) / gemm
    output_tokens = len(prompts) * args.output_len
    total_tokens = sum(prompt_lens) + output_tokens

    load_before = os.getloadavg()[0]
    results = run_systems(folder, prompts, args)

    print(f"workload A: {len(prompts)} prompts of {args.min_len}..{args.max_len} random ids "
          f"({sum(prompt_lens)} prompt tokens), {args.output_len} new tokens each, greedy, "
          f"ignore EOS, fp32, model {folder.name}; median of {args.repeats} run(s); "
          f"compute floor {floor_s:.1f} s")
    print(machine_line(args.threads, gemm) + f"; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (other processes skew the times)")
    headers = ["system", "time s", "output tok/s", "total tok/s", "floor share",
               "vs transformers"]
    print(markdown_table(headers, report_rows(results, total_tokens, output_tokens, floor_s)))
    if len(results) == 2:
        same, mismatches = compare_tokens(results[0].token_ids, results[1].token_ids)
        print(f"greedy tokens identical to transformers: {same}/{len(prompts)} prompts")
        for index, position in mismatches:
            print(f"  prompt {index} (len {prompt_lens[index]}): first difference at "
                  f"output position {position}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
