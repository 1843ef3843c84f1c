"""Peak memory of an engine process against the 2.5 GiB budget (exit code 1 when over).

Starts the engine with the default model and `kv_cache_gib=1.0` in a subprocess, runs a few
generations (16 prompts of 256 random ids, 32 new tokens), and reports the peak RSS of that
process: the larger of its own `getrusage` peak (plus any children's) and the peak of the summed
RSS of its process tree, sampled every 20 ms. The model is resolved (converted once if
needed) in this process first, so a one-time conversion does not count.

    python benchmarks/check_memory.py [--budget-gib 2.5] [--kv-cache-gib 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    REPO_ROOT,
    ModelShape,
    markdown_table,
    random_prompts,
    resolve_model_folder,
)
from engine.config import DEFAULT_MODEL

GIB = 1024**3
_RESULT_TAG = "CHECK_MEMORY_RESULT "


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local HF folder")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--budget-gib", type=float, default=2.5)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    """Inside the measured process: run the engine, print the getrusage peaks as JSON."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    folder = Path(args.model)
    vocab = ModelShape.from_folder(folder).vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt_len, args.prompt_len, vocab)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_gib=args.kv_cache_gib,
              num_threads=args.threads)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(_RESULT_TAG + json.dumps({"self_bytes": self_kib * 1024,
                                    "children_bytes": children_kib * 1024,
                                    "generated_tokens": generated}), flush=True)
    return 0


def tree_rss(proc: psutil.Process) -> int:
    """Summed RSS of a process and its live descendants (0 once it is gone)."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def measure(args: argparse.Namespace, folder: Path) -> tuple[int, dict[str, int]]:
    """Run the worker subprocess; its sampled tree peak and its own reported peaks."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(folder),
           "--kv-cache-gib", str(args.kv_cache_gib), "--num-prompts", str(args.num_prompts),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    child = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    handle = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        peak = max(peak, tree_rss(handle))
        time.sleep(0.02)
    stdout = child.stdout.read() if child.stdout else ""
    if child.returncode != 0:
        raise RuntimeError(f"engine subprocess failed with exit code {child.returncode}")
    line = next((ln for ln in stdout.splitlines() if ln.startswith(_RESULT_TAG)), None)
    if line is None:
        raise RuntimeError("engine subprocess printed no result")
    return peak, json.loads(line[len(_RESULT_TAG):])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    folder = resolve_model_folder(args.model)
    sampled, reported = measure(args, folder)
    peak = max(sampled, reported["self_bytes"] + reported["children_bytes"])
    over = peak > args.budget_gib * GIB
    print(f"memory: engine with kv_cache_gib={args.kv_cache_gib}, model {folder.name}, "
          f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} new tokens "
          f"({reported['generated_tokens']} generated)")
    headers = ["peak RSS GiB", "getrusage peak GiB", "sampled tree peak GiB", "budget GiB",
               "result"]
    row = [peak / GIB, (reported["self_bytes"] + reported["children_bytes"]) / GIB,
           sampled / GIB, args.budget_gib, "OVER BUDGET" if over else "ok"]
    print(markdown_table(headers, [row]))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
