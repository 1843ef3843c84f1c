"""Where the engine's time goes on the CPU, per step class, on workload A: one table.

Runs an in-process EngineCore (the default model, `--dtype`, 2 threads) over `--num-prompts`
workload-A prompts (64..512 random token ids, `--output-len` new tokens, greedy, EOS ignored)
and splits the wall time of its steps into:

- scheduling: `Scheduler.schedule` and `update_from_output` (torch-free, Python);
- batch preparation: the runner's inputs, block tables and slot mappings (`_prepare_batch`);
- forward, by op class, from torch.profiler with a label around each part of the model:
  GEMMs (every `linear`: qkv, o, gate_up, down), attention (the backend minus its KV writes:
  SDPA for prefills, the C paged-decode kernel for decodes), KV cache writes, norms, rotary,
  gated activation, embedding, and the LM head;
- sampling: the sampler over the LM head's logits;
- the rest of the step: Python between those (loops, hooks, bookkeeping, output objects).

Each class's time is its labelled regions' inclusive CPU time (the profiler adds a few percent;
the table says the wall time with and without it). Decode and prefill steps are counted apart:
a step is a decode step when every request in it computes one token.

    python benchmarks/profile_engine_cpu.py [--dtype auto|float32|bfloat16] [--num-prompts 16]
        [--output-len 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_line, markdown_table, random_prompts, resolve_model_folder, set_threads
from engine.config import DEFAULT_MODEL

FORWARD_CLASSES = ("gemm", "attention", "kv_write", "norm", "rotary", "activation", "embedding",
                   "lm_head")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    return p.parse_args(argv)


class Labels:
    """Wraps functions so each call runs inside a profiler label (and, for the step phases,
    a wall clock)."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.wall: dict[str, float] = defaultdict(float)

    def label(self, owner: Any, name: str, label: str, clock: bool = False) -> None:
        original = getattr(owner, name)
        record = torch.profiler.record_function

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter() if clock else 0.0
            with record(label):
                out = original(*args, **kwargs)
            if clock:
                self.wall[label] += time.perf_counter() - start
            return out

        setattr(owner, name, wrapped)
        self.undo.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()


def install(labels: Labels) -> None:
    import engine.attention.torch_backend as tb
    import engine.model.layers as layers
    import engine.model.mlp as mlp
    import engine.model.rope as rope
    from engine.core.scheduler import Scheduler
    from engine.model.causal_lm import CausalLM
    from engine.runner import ModelRunner
    from engine.sample.sampler import Sampler

    labels.label(Scheduler, "schedule", "scheduling", clock=True)
    labels.label(Scheduler, "update_from_output", "scheduling", clock=True)
    labels.label(ModelRunner, "_prepare_batch", "batch_prep", clock=True)
    labels.label(CausalLM, "forward", "forward", clock=True)
    labels.label(CausalLM, "compute_logits", "lm_head", clock=True)
    labels.label(Sampler, "__call__", "sampling", clock=True)
    for module in (layers, mlp):  # the name each module imported `linear` under
        labels.label(module, "linear", "gemm")
    labels.label(tb.TorchAttentionBackend, "forward", "attention")
    labels.label(tb, "write_kv", "kv_write")
    labels.label(layers.RMSNorm, "forward", "norm")
    labels.label(rope.RotaryEmbedding, "forward", "rotary")
    labels.label(mlp, "act_and_mul", "activation")
    labels.label(torch.nn.functional, "embedding", "embedding")


@contextmanager
def step_clock(core: Any, kinds: dict[str, list[float]]) -> Iterator[None]:
    """Times each EngineCore.step, filed as a decode or a prefill step."""
    original = core.step

    def timed() -> Any:
        decode = all(r.num_computed_tokens >= r.num_tokens - 1 for r in core.scheduler.running) \
            and len(core.scheduler.waiting) == 0
        start = time.perf_counter()
        out = original()
        kinds["decode" if decode else "prefill"].append(time.perf_counter() - start)
        return out

    core.step = timed
    try:
        yield
    finally:
        core.step = original


def run(args: argparse.Namespace) -> list[list[object]]:
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.core.outputs import EngineCoreRequest
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams

    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    core = EngineCore(EngineConfig(model=str(folder), dtype=args.dtype, num_threads=args.threads,
                                   kv_cache_gib=args.kv_cache_gib))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(args.num_prompts, 64, 512, core.vocab_size, seed=0)
    # the profiled pass gets prompts of its own: the first pass's are in the prefix cache
    fresh = random_prompts(args.num_prompts, 64, 512, core.vocab_size, seed=1)

    def generate(tag: str, items: list[list[int]]) -> None:
        for i, prompt in enumerate(items):
            core.add_request(EngineCoreRequest(request_id=f"{tag}{i}", prompt_token_ids=prompt,
                                               sampling_params=params, arrival_time=time.time()))
        while core.scheduler.has_unfinished_requests():
            core.step()

    generate("warm", prompts[:2])
    start = time.perf_counter()
    generate("plain", prompts)
    plain_wall = time.perf_counter() - start

    labels = Labels()
    install(labels)
    steps: dict[str, list[float]] = defaultdict(list)
    try:
        with step_clock(core, steps), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            generate("prof", fresh)
            wall = time.perf_counter() - start
    finally:
        labels.restore()
        core.shutdown()
    inclusive = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    return table(args, core.config.dtype, plain_wall, wall, steps, inclusive, labels.wall)


def table(args: argparse.Namespace, dtype: str, plain_wall: float, wall: float,
          steps: dict[str, list[float]], inclusive: dict[str, float],
          clocks: dict[str, float]) -> list[list[object]]:
    step_total = sum(sum(v) for v in steps.values())
    rows: list[list[object]] = [
        ["wall, no profiler", f"{plain_wall:.2f}", "",
         f"{args.num_prompts * args.output_len / plain_wall:.1f} output tok/s, {dtype}"],
        ["wall, profiled", f"{wall:.2f}", "100.0", f"{len(steps['decode'])} decode steps "
         f"({sum(steps['decode']):.2f} s), {len(steps['prefill'])} with prefill "
         f"({sum(steps['prefill']):.2f} s)"],
    ]

    def row(name: str, seconds: float, note: str = "") -> None:
        rows.append([name, f"{seconds:.3f}", f"{100 * seconds / wall:.1f}", note])

    forward = clocks.get("forward", 0.0)
    classes = {c: inclusive.get(c, 0.0) for c in FORWARD_CLASSES if c != "lm_head"}
    classes["attention"] = max(0.0, classes["attention"] - classes["kv_write"])
    row("scheduling (schedule + update_from_output)", clocks.get("scheduling", 0.0), "Python, no torch")
    row("batch preparation", clocks.get("batch_prep", 0.0), "inputs, block tables, slots")
    row("forward (all layers + final norm)", forward)
    labelled = 0.0
    for name, seconds in classes.items():
        labelled += seconds
        row(f"  {name}", seconds, "minus KV writes" if name == "attention" else "")
    row("  forward, unlabelled", max(0.0, forward - labelled), "residual adds, views, hooks, layer loop")
    row("LM head (logits)", clocks.get("lm_head", 0.0), "a GEMM over the vocabulary")
    row("sampling", clocks.get("sampling", 0.0))
    covered = sum(clocks.get(k, 0.0) for k in ("scheduling", "batch_prep", "forward", "lm_head", "sampling"))
    row("rest of the steps", max(0.0, step_total - covered), "Python between the phases, outputs")
    row("outside steps", max(0.0, wall - step_total), "adding requests, the loop")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"# engine step profile: workload A, {args.num_prompts} prompts x {args.output_len} tokens, "
          f"{args.threads} threads")
    print(machine_line(args.threads, None))
    print(markdown_table(["phase", "seconds", "% of profiled wall", "note"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
