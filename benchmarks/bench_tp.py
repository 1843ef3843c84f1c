"""Tensor parallelism on this machine: TP 2 (two processes, one torch thread each, gloo) against
TP 1 (one process, two threads) on workload A, and the KV hand-off between engines of every pair
of TP sizes through a real KV store.

Workload A: 64 prompts of random ids, 64..512 tokens (seeded), 128 new tokens each, greedy, EOS
ignored, the default model in float32. Reported per TP size: median wall time and output tok/s,
the ratio against TP 1, whether the greedy tokens equal TP 1's, and the communication share of
the steps: rank 0's time inside collectives (all-reduces after the row-parallel projections, the
vocab gather, waits for the slower rank included) over its step time.

Hand-off: a producer of TP p prefills `--handoff-prompts` prompts of `--handoff-len` tokens into
the store (each rank's head shard its own object), a consumer of TP d loads them (async) and
decodes; reported per (p, d): the consumer's load time per request, the bytes it read, the ratio
against P1 -> D1 (re-sharding joins the producer ranks' objects and splits them over its own
ranks), and whether its greedy tokens equal the colocated TP 1 engine's. On a 2-core machine TP 2
is not expected to win: the point is the communication share, which is what a GPU user needs.

    python benchmarks/bench_tp.py [--repeats 1] [--num-prompts 64] [--skip-workload]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_line, markdown_table, median, random_prompts, resolve_model_folder
from benchmarks.common import vocab_size as model_vocab
from engine.config import DEFAULT_MODEL


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per TP size; medians")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all (TP 2: one a rank)")
    p.add_argument("--sizes", default="1,2", help="TP sizes to compare")
    p.add_argument("--handoff-prompts", type=int, default=4)
    p.add_argument("--handoff-len", type=int, default=1024)
    p.add_argument("--skip-workload", action="store_true")
    p.add_argument("--skip-handoff", action="store_true")
    return p.parse_args(argv)


def _engine(folder: Path, tp: int, threads: int, **kw: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=str(folder), dtype="float32", kv_cache_gib=kw.pop("kv_cache_gib", 2.0),
               max_num_seqs=64, num_threads=max(1, threads // tp), tensor_parallel_size=tp, **kw)


def _greedy(n: int, transfer: dict[str, Any] | None = None) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, kv_transfer_params=transfer)


def workload(folder: Path, args: argparse.Namespace, sizes: list[int]) -> list[list[object]]:
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, model_vocab(folder), 0)
    rows: list[list[object]] = []
    base: tuple[float, list[list[int]]] | None = None
    for tp in sizes:
        llm = _engine(folder, tp, args.threads)
        llm.generate([[100] * 8], _greedy(2), use_tqdm=False)  # warm-up
        core = llm.engine_core
        clock = core.tp_executor.tp.clock if core.tp_executor is not None else None
        times, tokens, shares, calls = [], [], [], []
        for _ in range(args.repeats):
            comm0, calls0 = (clock.seconds, clock.calls) if clock else (0.0, 0)
            steps0, busy0 = core.step_seconds.count, core.step_seconds.total
            start = time.perf_counter()
            outs = llm.generate(prompts, _greedy(args.output_len), use_tqdm=False)
            times.append(time.perf_counter() - start)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            busy = core.step_seconds.total - busy0
            steps = core.step_seconds.count - steps0
            shares.append((clock.seconds - comm0) / busy if clock else 0.0)
            calls.append((clock.calls - calls0) / max(1, steps) if clock else 0.0)
        llm.shutdown()
        t = median(times)
        if base is None:
            base = (t, tokens)
        same = sum(a == b for a, b in zip(tokens, base[1], strict=True))
        rows.append([f"TP {tp}", t, len(prompts) * args.output_len / t, base[0] / t,
                     f"{same}/{len(prompts)}", 100 * median(shares), median(calls)])
    return rows


def handoff(folder: Path, args: argparse.Namespace, sizes: list[int]) -> list[list[object]]:
    from kvstore.service import KVStoreService, StoreOptions

    prompts = random_prompts(args.handoff_prompts, args.handoff_len, args.handoff_len, model_vocab(folder), 1)
    colocated = _engine(folder, 1, args.threads, kv_cache_gib=0.5)
    want = [list(o.outputs[0].token_ids) for o in colocated.generate(prompts, _greedy(4), use_tqdm=False)]
    colocated.shutdown()
    rows: list[list[object]] = []
    base = None
    for p in sizes:
        for d in sizes:
            with KVStoreService(StoreOptions(capacity="2GiB", port=0)) as store:
                kv = {"kv_connector": "kvstore", "kv_store_url": store.location, "kv_cache_gib": 0.5}
                producer = _engine(folder, p, args.threads, kv_role="kv_producer", **kv)
                consumer = _engine(folder, d, args.threads, kv_role="kv_consumer", kv_load_mode="async", **kv)
                asks = [_greedy(1, {"do_remote_decode": True, "transfer_id": f"t{i}"})
                        for i in range(len(prompts))]
                firsts = producer.generate(prompts, asks, use_tqdm=False)
                connector = consumer.engine_core.runner.connector
                before = connector.get_transfer_stats()
                continued = [[*q, f.outputs[0].token_ids[0]] for q, f in zip(prompts, firsts, strict=True)]
                outs = consumer.generate(continued, [_greedy(3, f.kv_transfer_params) for f in firsts],
                                         use_tqdm=False)
                after = connector.get_transfer_stats()
                producer.shutdown()
                consumer.shutdown()
            loads = after.load_seconds.count - before.load_seconds.count
            per = (after.load_seconds.total - before.load_seconds.total) / max(1, loads)
            base = base or per
            same = sum([f.outputs[0].token_ids[0], *o.outputs[0].token_ids] == w
                       for f, o, w in zip(firsts, outs, want, strict=True))
            cached = sum(o.num_cached_tokens for o in outs) == sum(len(q) for q in prompts)
            rows.append([f"P{p} -> D{d}", 1000 * per, (after.load_bytes - before.load_bytes) / 2**20,
                         per / base, f"{same}/{len(prompts)}", "yes" if cached else "no"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    folder = resolve_model_folder(args.model)
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()[0]
    print(f"tensor parallelism, model {folder.name}, float32, {args.threads} torch threads in all "
          f"(TP n: {args.threads} // n a rank)")
    print(machine_line(args.threads, None) + f"; load average {load_before:.1f} before")
    if not args.skip_workload:
        print(f"\nworkload A: {args.num_prompts} prompts of {args.min_len}..{args.max_len} random ids, "
              f"{args.output_len} new tokens each, greedy; median of {args.repeats} run(s)")
        print(markdown_table(["engine", "time s", "output tok/s", "vs TP 1", "tokens = TP 1",
                              "comm % of step", "collectives/step"], workload(folder, args, sizes)))
    if not args.skip_handoff:
        print(f"\nKV hand-off: {args.handoff_prompts} prompts of {args.handoff_len} tokens, "
              f"prefill on TP p, async load and decode on TP d")
        print(markdown_table(["pair", "load ms/request", "MiB read", "vs P1 -> D1", "tokens = colocated",
                              "whole prompt loaded"], handoff(folder, args, sizes)))
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes skew the times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
