"""Headless load-test runner: runs locust against an OpenAI-compatible server, writes locust's
CSVs and per-request JSON lines, prints the summary table and writes PNG plots.

    python -m loadtest.run --host http://127.0.0.1:8000 --workload long-prompt \\
        --users 4 --max-requests 60 --run-time 300 --out loadtest-out/run1
    python -m loadtest.run --host ... --rate 0.5 ...          # open loop: Poisson arrivals

Always bounded: locust stops at `--run-time` seconds or once `--max-requests` requests ended,
whichever comes first (and the whole locust process is killed `--grace-s` after that). Only
loopback hosts are accepted unless `--allow-remote` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from loadtest import report
from loadtest.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunSpec:
    host: str
    workload: str = "random"
    users: int = 4
    rate: float | None = None  # requests/s (open loop); None = closed loop with `users`
    max_requests: int = 50
    run_time_s: int = 300
    model: str = "smollm2-135m-instruct"
    vocab_size: int = 49152
    seed: int = 0
    api: str = "completions"
    tokenizer: str = ""
    timeout_s: float = 300.0
    api_key: str = ""
    grace_s: float = 60.0


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--users", type=int, default=4, help="closed loop: concurrent users")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--max-requests", type=int, default=50)
    p.add_argument("--run-time", type=int, default=300, help="seconds")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default="", help="tokenizer folder (needed for --api chat)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=200.0)
    p.add_argument("--allow-remote", action="store_true")


def check_host(host: str, allow_remote: bool) -> None:
    hostname = urlparse(host).hostname or ""
    if not allow_remote and not (hostname == "localhost" or hostname.startswith("127.")):
        raise SystemExit(f"refusing to load {host}: only loopback hosts (use --allow-remote to override)")


def run_locust(spec: RunSpec, out_dir: Path) -> Path:
    """Runs one bounded locust run; returns the per-request JSON-lines file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "requests.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LT_WORKLOAD": spec.workload,
           "PDSERVE_LT_MODEL": spec.model, "PDSERVE_LT_VOCAB": str(spec.vocab_size),
           "PDSERVE_LT_SEED": str(spec.seed), "PDSERVE_LT_API": spec.api,
           "PDSERVE_LT_MAX_REQUESTS": str(spec.max_requests), "PDSERVE_LT_TIMEOUT_S": str(spec.timeout_s),
           "PDSERVE_LT_LOG": str(log), "PDSERVE_LT_RATE": str(spec.rate or 1.0),
           "PDSERVE_LT_TOKENIZER": spec.tokenizer, "PDSERVE_LT_API_KEY": spec.api_key}
    user_class, users = ("PoissonUser", 1) if spec.rate else ("StreamingUser", spec.users)
    argv = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), user_class,
            "--headless", "--host", spec.host, "-u", str(users), "-r", str(users),
            "--run-time", f"{spec.run_time_s}s", "--stop-timeout", str(int(spec.timeout_s)),
            "--csv", str(out_dir / "locust"), "--only-summary", "--loglevel", "WARNING",
            "--exit-code-on-error", "0"]
    with open(out_dir / "locust.log", "w") as logfile:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logfile, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=spec.run_time_s + spec.timeout_s + spec.grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    if not log.exists():
        raise RuntimeError(f"locust wrote no request log; see {out_dir / 'locust.log'}")
    return log


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, default=Path("loadtest-out") / time.strftime("%Y%m%d-%H%M%S"))
    p.add_argument("--name", default="run", help="the column name in the summary")
    add_run_args(p)
    args = p.parse_args(argv)
    check_host(args.host, args.allow_remote)
    spec = spec_from_args(args, args.host)
    log = run_locust(spec, args.out)
    rows = report.load(log)
    slo = report.Slo(args.ttft_slo_ms, args.itl_slo_ms)
    summary = report.summarize(rows, slo)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = describe(spec) + "\n" + report.table({args.name: summary})
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    for path in report.plot({args.name: rows}, slo, args.out):
        print(f"plot: {path}")
    return 0


def spec_from_args(args: argparse.Namespace, host: str) -> RunSpec:
    return RunSpec(host=host, workload=args.workload, users=args.users, rate=args.rate,
                   max_requests=args.max_requests, run_time_s=args.run_time, model=args.model,
                   vocab_size=args.vocab_size, seed=args.seed, api=args.api, tokenizer=args.tokenizer,
                   timeout_s=args.timeout_s, api_key=os.environ.get("PDSERVE_API_KEY", ""))


def describe(spec: RunSpec) -> str:
    load = f"Poisson {spec.rate}/s" if spec.rate else f"{spec.users} users (closed loop)"
    return (f"workload {spec.workload}, {load}, at most {spec.max_requests} requests / "
            f"{spec.run_time_s} s, model {spec.model}, api {spec.api}")


if __name__ == "__main__":
    raise SystemExit(main())
