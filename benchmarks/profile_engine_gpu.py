"""Where a decode step's time goes on a CUDA GPU: the engine at bench_gpu.py's Llama-1B shape
(random bf16 weights, CUDA graphs), one table per batch size.

For each batch it runs prompts to their decode phase, then profiles `--steps` decode steps with
torch.profiler (CPU and CUDA activities) and prints: the host's wall time per step, the GPU's
busy time per step (sum of kernel times), the weight-bandwidth floor per step (bench_gpu.py's),
and the kernels and host functions that take the most time. What it answers: is decode held back
by the host (wall >> GPU busy) or by the kernels (GPU busy >> floor), and by which ones.

    python benchmarks/profile_engine_gpu.py [--batches 1,64] [--steps 20] [--top 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_gpu import copy_bandwidth, floor_tps, make_model
from benchmarks.common import markdown_table


def profile_batch(folder: Path, batch: int, args: argparse.Namespace,
                  copy_bw: float) -> list[list[object]]:
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.core.outputs import EngineCoreRequest
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(folder), dtype="bfloat16", device="cuda",
                                   max_num_seqs=batch, max_model_len=2048,
                                   max_num_batched_tokens=max(2048, batch * args.prompt_len),
                                   enable_prefix_caching=False))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(100, 100000, (args.prompt_len,), generator=g).tolist()
        core.add_request(EngineCoreRequest(
            request_id=f"p-{i}", prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=args.steps + 40, temperature=0.0,
                                           ignore_eos=True),
            arrival_time=time.time()))
    for _ in range(20):  # prefill and the first decode steps (graphs warm)
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    core.shutdown()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.steps
    floor_ms = batch / floor_tps(batch, args, copy_bw) * 1e3
    rows: list[list[object]] = [
        [f"b{batch}: wall per step", f"{wall * 1e3:.3f} ms", f"host clock, {args.steps} steps, profiler on"],
        [f"b{batch}: GPU busy per step", f"{gpu_us / 1e3:.3f} ms", "sum of kernel times"],
        [f"b{batch}: weight-bandwidth floor", f"{floor_ms:.3f} ms", "bench_gpu.py floor_tps"],
    ]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]:
        rows.append([f"b{batch} kernel {e.key[:60]}",
                     f"{e.self_device_time_total / args.steps / 1e3:.3f} ms",
                     f"{e.count / args.steps:.0f} launches/step"])
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        rows.append([f"b{batch} host {e.key[:60]}",
                     f"{e.self_cpu_time_total / args.steps / 1e3:.3f} ms",
                     f"{e.count / args.steps:.0f} calls/step (self time)"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)  # floor_tps's average context
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_engine_gpu: no CUDA device", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth(5)
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        for b in (int(x) for x in args.batches.split(",")):
            rows += profile_batch(Path(tmp), b, args, copy_bw)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy {copy_bw / 1e9:.0f} GB/s")
    print(markdown_table(["what", "per step", "note"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
