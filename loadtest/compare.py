"""Colocated against disaggregated, in one go, on the same workload and cores:

- `colocated`: `pdserve up --colocated`: one engine that prefills and decodes, on every core;
- `disaggregated`: `pdserve up`: one prefill worker on core 0 and one decode worker on core 1
  (the KV store beside the decode worker, the router unpinned as vLLM's proxy is, by default:
  `--kvstore-cpus`, `--router-cpus`), KV through the store;
- `disaggregated-fcfs` (only when named in --setups): the same split with the prefill worker
  scheduling first come first served in 2,048-token steps, as before its shortest-first default;
- `vllm-pd` (when vLLM CPU is installed in .peers/vllm, see loadtest/peers/install_vllm.sh):
  vLLM's own disaggregated setup on the same cores, at vLLM's defaults (bf16 on this CPU, its
  compiled forward): two `vllm serve` instances with a shared-storage KV connector behind a
  proxy that sends the prompt to the prefill instance with max_tokens=1, then to the decode
  instance;
- `vllm-pd-fp32-eager` (only when named in --setups): the same forced to float32 and
  --enforce-eager (the comparison this project made before it ran vLLM at its defaults).

Each setup is started, loaded with the same seeded requests (bounded in count and time), and
stopped before the next; the summary prints the runs side by side with the ratios that matter
(p99 ITL and p50 TTFT of disaggregated over colocated, pdserve's split against vLLM's), and the
plots overlay every run.

    python -m loadtest.compare --workload long-prompt --users 4 --max-requests 60 \\
        --ttft-slo-ms 3000 --itl-slo-ms 150 --out loadtest-out/compare
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.run import ROOT, add_run_args, describe, run_locust, spec_from_args
from services.procs import stop_process

VLLM_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"


class Server:
    """A child process that prints `ready_text` once it serves on `port`; stopped with SIGINT."""

    def __init__(self, name: str, argv: list[str], port: int, ready_text: str, log: Path) -> None:
        self.name, self.port, self.ready_text = name, port, ready_text
        self.log = log
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._ready = threading.Event()
        self._pump = threading.Thread(target=self._copy, daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        """Copies the children's output to the log (never letting the pipe fill up)."""
        assert self.proc.stdout is not None
        with open(self.log, "w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if self.ready_text in line:
                    self._ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not come up (exit {self.proc.poll()}); see {self.log}")

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=90)


SETUPS = ("colocated", "disaggregated", "disaggregated-fcfs", "vllm-pd", "vllm-pd-fp32-eager")


def setups(args: argparse.Namespace, out: Path) -> list[tuple[str, Any]]:
    """(name, a function starting the setup and returning its Server)."""
    pd = [sys.executable, "-m", "services.cli", "up", "--model", args.model_path,
          "--max-model-len", str(args.max_model_len), "--kv-cache-gib", str(args.kv_cache_gib),
          "--metrics-port-offset", "0", "--startup-timeout-s", str(args.startup_timeout_s)]

    def pdserve(name: str, port: int, extra: list[str]) -> Server:
        argv = [*pd, "--port", str(port), "--kvstore-port", str(port + 1), "--decode-port",
                str(port + 2), "--prefill-port", str(port + 3), *extra]
        return Server(name, argv, port, "pdserve is up", out / f"{name}.log")

    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    pre, dec = cores[:half], cores[half:] or cores[:half]
    as_list = ",".join
    named = {"prefill": as_list(map(str, pre)), "decode": as_list(map(str, dec)), "": ""}
    aux = []
    for flag, where in (("--kvstore-cpus", args.kvstore_cpus), ("--router-cpus", args.router_cpus)):
        cpus = named.get(where, where)
        aux += [flag, cpus] if cpus else []
    split = ["--num-threads", str(len(pre)), "--prefill-cpus", as_list(map(str, pre)),
             "--decode-cpus", as_list(map(str, dec)), "--local-prefill-tokens",
             str(args.local_prefill_tokens), *aux, *shlex.split(args.split_args)]
    runs: list[tuple[str, Any]] = [
        ("colocated", lambda: pdserve("colocated", args.base_port, [
            "--colocated", "--num-threads", str(len(cores)), "--decode-cpus", as_list(map(str, cores))])),
        ("disaggregated", lambda: pdserve("disaggregated", args.base_port + 10, split)),
        # An ablation: the split with the prefill worker scheduling as other engines do.
        ("disaggregated-fcfs", lambda: pdserve("disaggregated-fcfs", args.base_port + 30, [
            *split, "--prefill-scheduling-policy", "fcfs", "--prefill-max-num-batched-tokens",
            "2048"])),
    ]
    if args.vllm and VLLM_PYTHON.exists():
        def vllm_pd(name: str, port: int, extra: list[str]) -> Server:
            return Server(name, [
                str(VLLM_PYTHON), str(ROOT / "loadtest" / "peers" / "vllm_pd.py"), "--port", str(port),
                "--served-model-name", args.model, "--prefill-cpus", as_list(map(str, pre)),
                "--decode-cpus", as_list(map(str, dec)), "--max-model-len", str(args.max_model_len),
                *extra], port, "vllm pd is up", out / f"{name}.log")

        runs.append(("vllm-pd", lambda: vllm_pd("vllm-pd", args.base_port + 20, [])))
        runs.append(("vllm-pd-fp32-eager", lambda: vllm_pd("vllm-pd-fp32-eager", args.base_port + 40,
                                                           ["--fp32-eager"])))
    elif args.vllm:
        print(f"vllm-pd skipped: {VLLM_PYTHON} not found (bash loadtest/peers/install_vllm.sh)")
    return [(n, f) for n, f in runs if n in args.setups]


def ratios(s: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    if {"colocated", "disaggregated"} <= s.keys():
        c, d = s["colocated"], s["disaggregated"]
        lines.append(f"disaggregated / colocated: p99 ITL {d['itl_ms']['p99'] / c['itl_ms']['p99']:.2f} "
                     f"(target <= 0.5), p50 TTFT {d['ttft_ms']['p50'] / c['ttft_ms']['p50']:.2f}, "
                     f"goodput {d['goodput']:.2f} vs {c['goodput']:.2f}")
    if {"disaggregated-fcfs", "disaggregated"} <= s.keys():
        f, d = s["disaggregated-fcfs"], s["disaggregated"]
        lines.append(f"pdserve split / same with FCFS prefill: p50 TTFT "
                     f"{d['ttft_ms']['p50'] / f['ttft_ms']['p50']:.2f}, p99 ITL "
                     f"{d['itl_ms']['p99'] / f['itl_ms']['p99']:.2f}, goodput {d['goodput']:.2f} vs "
                     f"{f['goodput']:.2f}")
    for peer, label in (("vllm-pd", "vLLM split (its defaults)"),
                        ("vllm-pd-fp32-eager", "vLLM split (float32, eager)")):
        if {peer, "disaggregated"} <= s.keys():
            v, d = s[peer], s["disaggregated"]
            lines.append(f"pdserve split / {label}: p50 TTFT "
                         f"{d['ttft_ms']['p50'] / v['ttft_ms']['p50']:.2f}, p99 ITL "
                         f"{d['itl_ms']['p99'] / v['itl_ms']['p99']:.2f} (below 1 favours pdserve), "
                         f"throughput {d['out_tok_per_s'] / v['out_tok_per_s']:.2f}x, "
                         f"goodput {d['goodput']:.2f} vs {v['goodput']:.2f}")
    return lines


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over runs of one setup (request counts summed)."""
    out = dict(runs[0])
    out["requests"] = sum(r["requests"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    for key in ("duration_s", "req_per_s", "out_tok_per_s", "goodput"):
        out[key] = statistics.median(r[key] for r in runs)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        out[key] = {q: statistics.median(r[key][q] for r in runs) for q in runs[0][key]}
    out["goodput_by_ttft_slo"] = {k: statistics.median(r["goodput_by_ttft_slo"][k] for r in runs)
                                  for k in runs[0]["goodput_by_ttft_slo"]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_run_args(p)
    p.add_argument("--out", type=Path,
                   default=Path("loadtest-out") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--model-path", default=None, help="model folder or name for pdserve (default: --model)")
    p.add_argument("--setups", default="colocated,disaggregated,vllm-pd",
                   help=f"comma-separated, from {','.join(SETUPS)}")
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--local-prefill-tokens", type=int, default=0)
    p.add_argument("--kvstore-cpus", default="decode", metavar="LIST",
                   help="pdserve split: the KV store's CPUs ('prefill' / 'decode': that worker's, "
                        "'' = unpinned, or a list)")
    p.add_argument("--router-cpus", default="", metavar="LIST",
                   help="pdserve split: the router's CPUs (as --kvstore-cpus; default unpinned, "
                        "like the proxy in front of vLLM's split)")
    p.add_argument("--split-args", default="", metavar="ARGS",
                   help="more `pdserve up` options for the pdserve split, e.g. "
                        "'--prefill-max-num-batched-tokens 512'")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every setup this many times, interleaved; the table gives medians")
    args = p.parse_args(argv)
    args.model_path = args.model_path or args.model
    args.setups = args.setups.split(",")
    unknown = [n for n in args.setups if n not in SETUPS]
    if unknown:
        p.error(f"--setups: unknown {','.join(unknown)} (choose from {','.join(SETUPS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    slo = report.Slo(args.ttft_slo_ms, args.itl_slo_ms)
    rows: dict[str, list[dict[str, Any]]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}  # per setup, each repeat's summary
    for r in range(args.repeats):
        for name, start in setups(args, args.out):
            server = start()
            try:
                server.wait_ready(args.startup_timeout_s)
                spec = spec_from_args(args, f"http://127.0.0.1:{server.port}")
                print(f"[{r + 1}/{args.repeats}] {name}: {describe(spec)}", flush=True)
                sub = name if args.repeats == 1 else f"{name}-run{r + 1}"
                rows[name] = report.load(run_locust(spec, args.out / sub))
                runs.setdefault(name, []).append(report.summarize(rows[name], slo))
            finally:
                server.stop()
    summaries = {name: median_summary(rs) for name, rs in runs.items()}
    per_run = [f"run {r + 1}: " + "; ".join(ratios({n: rs[r] for n, rs in runs.items()}))
               for r in range(args.repeats)] if args.repeats > 1 else []
    text = "\n".join([f"comparison: {describe(spec_from_args(args, ''))}; SLOs TTFT <= "
                      f"{slo.ttft_ms:.0f} ms, ITL (per-request mean) <= {slo.itl_ms:.0f} ms; "
                      f"{args.repeats} interleaved run(s) per setup"
                      + (" (medians)" if args.repeats > 1 else ""),
                      report.table(summaries), *ratios(summaries), *per_run])
    (args.out / "summary.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=2))
    print(text)
    for path in report.plot(rows, slo, args.out):
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
