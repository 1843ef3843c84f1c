"""Where the engine's time goes on the CPU, per step class, on workload A: one table.

Runs an in-process EngineCore (the default model, `--dtype`, 2 threads) over `--num-prompts`
workload-A prompts (64..512 random token ids, `--output-len` new tokens, greedy, EOS ignored)
and splits the wall time of its steps into:

- scheduling: `Scheduler.schedule` and `update_from_output` (torch-free, Python);
- batch preparation: the runner's inputs, block tables and slot mappings (`_prepare_batch`);
- forward, by op class, from a wall clock around each part of the model:
  GEMMs (every `linear`: qkv, o, gate_up, down), attention (the backend minus its KV writes:
  the C paged-decode kernel for decodes and the C paged-prefill kernel for prefills, bf16 or
  fp32, on AVX-512 CPUs), KV cache writes, norms, rotary,
  gated activation, embedding, and the LM head;
- sampling: the sampler over the LM head's logits;
- the rest of the step: Python between those (loops, hooks, bookkeeping, output objects).

Each class's time is its labelled regions' inclusive wall time (the clocks add well under 1%;
the table says the wall time with and without them). Decode and prefill steps are counted apart
(a step is a decode step when every request in it computes one token), in columns of their own.

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
    """Wraps functions so each call's wall time is added to its label, filed under the kind of
    step under way (`kind`: "decode" or "prefill")."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.kind = "prefill"
        self.wall: dict[str, dict[str, float]] = {"decode": defaultdict(float),
                                                  "prefill": defaultdict(float)}

    def label(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.wall[self.kind][label] += time.perf_counter() - start
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

    labels.label(Scheduler, "schedule", "scheduling")
    labels.label(Scheduler, "update_from_output", "scheduling")
    labels.label(ModelRunner, "_prepare_batch", "batch_prep")
    labels.label(CausalLM, "forward", "forward")
    labels.label(CausalLM, "compute_logits", "lm_head")
    labels.label(Sampler, "__call__", "sampling")
    for module in (layers, mlp):  # the name each module imported `linear` under
        labels.label(module, "linear", "gemm")
    labels.label(tb.TorchAttentionBackend, "forward", "attention")
    labels.label(tb, "write_kv", "kv_write")
    labels.label(layers.RMSNorm, "forward", "norm")
    labels.label(layers.RMSNorm, "add_and_norm", "norm")  # the residual add fused with the norm
    labels.label(rope.RotaryEmbedding, "forward", "rotary")
    labels.label(mlp, "act_and_mul", "activation")
    labels.label(torch.nn.functional, "embedding", "embedding")


@contextmanager
def step_clock(core: Any, kinds: dict[str, list[float]], labels: Labels) -> Iterator[None]:
    """Times each EngineCore.step, filed as a decode or a prefill step."""
    original = core.step

    def timed() -> Any:
        decode = all(r.num_computed_tokens >= r.num_tokens - 1 for r in core.scheduler.running) \
            and len(core.scheduler.waiting) == 0
        labels.kind = "decode" if decode else "prefill"
        start = time.perf_counter()
        out = original()
        kinds[labels.kind].append(time.perf_counter() - start)
        return out

    core.step = timed
    try:
        yield
    finally:
        core.step = original


def run(args: argparse.Namespace) -> list[list[object]]:
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
        with step_clock(core, steps, labels):
            start = time.perf_counter()
            generate("prof", fresh)
            wall = time.perf_counter() - start
    finally:
        labels.restore()
        core.shutdown()
    return table(args, core.config.dtype, plain_wall, wall, steps, labels.wall)


def table(args: argparse.Namespace, dtype: str, plain_wall: float, wall: float,
          steps: dict[str, list[float]], by_kind: dict[str, dict[str, float]]) -> list[list[object]]:
    step_total = sum(sum(v) for v in steps.values())
    kind_wall = {k: sum(steps[k]) for k in ("decode", "prefill")}
    rows: list[list[object]] = [
        ["wall, no clocks", f"{plain_wall:.2f}", "", "", "",
         f"{args.num_prompts * args.output_len / plain_wall:.1f} output tok/s, {dtype}"],
        ["wall, clocked", f"{wall:.2f}", f"{kind_wall['decode']:.2f}", f"{kind_wall['prefill']:.2f}",
         "100.0", f"{len(steps['decode'])} decode steps, {len(steps['prefill'])} with prefill"],
    ]

    def get(kind: str, label: str) -> float:
        return by_kind[kind].get(label, 0.0)

    def row(name: str, label: str | None = None, note: str = "",
            value: Callable[[str], float] | None = None) -> None:
        at = value or (lambda kind: get(kind, label or name))
        d, p = at("decode"), at("prefill")
        rows.append([name, f"{d + p:.3f}", f"{d:.3f}", f"{p:.3f}", f"{100 * (d + p) / wall:.1f}", note])

    row("scheduling (schedule + update_from_output)", "scheduling", "Python, no torch")
    row("batch preparation", "batch_prep", "inputs, block tables, slots")
    row("forward (all layers + final norm)", "forward")
    for name in FORWARD_CLASSES:
        if name == "lm_head":
            continue
        if name == "attention":
            row("  attention", note="minus KV writes; C kernels on AVX-512 (SDPA: windowed, capped prefill)",
                value=lambda k: max(0.0, get(k, "attention") - get(k, "kv_write")))
        else:
            row(f"  {name}", name, "with the residual adds fused into it" if name == "norm" else "")

    def unlabelled(kind: str) -> float:
        inner = sum(get(kind, c) for c in FORWARD_CLASSES if c not in ("lm_head", "kv_write"))
        return max(0.0, get(kind, "forward") - inner)

    row("  forward, unlabelled", note="residual adds, views, the layer loop", value=unlabelled)
    row("LM head (logits)", "lm_head", "a GEMM over the vocabulary")
    row("sampling", "sampling")

    def rest(kind: str) -> float:
        covered = sum(get(kind, k) for k in ("scheduling", "batch_prep", "forward", "lm_head", "sampling"))
        return max(0.0, kind_wall[kind] - covered)

    row("rest of the steps", note="Python between the phases, outputs", value=rest)
    rows.append(["outside steps", f"{max(0.0, wall - step_total):.3f}", "", "",
                 f"{100 * max(0.0, wall - step_total) / wall:.1f}", "adding requests, the loop"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"# engine step profile: workload A, {args.num_prompts} prompts x {args.output_len} tokens, "
          f"{args.threads} threads")
    print(machine_line(args.threads, None))
    print(markdown_table(["phase", "seconds", "decode steps", "prefill steps", "% of wall", "note"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
