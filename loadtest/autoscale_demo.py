"""Autoscaling run (issue #8): `pdserve up --autoscale` (local processes) under a load step, then a
PNG of replicas, load and TTFT / ITL p90 against their targets over time, and the time from the
load step to the targets being met again.

    python -m loadtest.autoscale_demo --model PATH_OR_NAME --ttft-ms 1500 --itl-ms 150 \\
        --low-users 1 --high-users 6 --phase-s 60,120,90 --out loadtest-out/autoscale

Phases: low load, high load (the step), idle; each bounded in time. The autoscaler's own log
(one JSON line per interval: observation and decisions with reasons) is the record.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.compare import Server
from loadtest.run import ROOT, RunSpec, run_locust

SETTLED = 5  # intervals in a row within both targets that count as "met again"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workload", default="long-prompt")
    p.add_argument("--ttft-ms", type=float, default=1500)
    p.add_argument("--itl-ms", type=float, default=150)
    p.add_argument("--low-users", type=int, default=1)
    p.add_argument("--high-users", type=int, default=6)
    p.add_argument("--phase-s", default="60,120,90", help="low, high, idle seconds")
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--max-decode", type=int, default=2)
    p.add_argument("--interval-s", type=float, default=3)
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("loadtest-out") / f"autoscale-{time.strftime('%H%M%S')}")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "autoscaler.jsonl"
    log.unlink(missing_ok=True)
    low_s, high_s, idle_s = (int(x) for x in args.phase_s.split(","))
    argv_up = [str(ROOT / ".venv" / "bin" / "python"), "-m", "services.cli", "up", "--model", args.model,
               "--port", str(args.port), "--kvstore-port", str(args.port + 1), "--decode-port",
               str(args.port + 2), "--prefill-port", str(args.port + 10), "--num-threads", "1",
               "--kv-cache-gib", "0.5", "--max-model-len", str(args.max_model_len), "--metrics-port-offset",
               "0", "--autoscale", "--max-prefill", str(args.max_prefill), "--max-decode",
               str(args.max_decode), "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
               "--autoscale-interval-s", str(args.interval_s), "--up-cooldown-s", str(3 * args.interval_s),
               "--down-cooldown-s", str(6 * args.interval_s), "--autoscale-log", str(log)]
    server = Server("pdserve-autoscale", argv_up, args.port, "pdserve is up", args.out / "pdserve.log")
    phases: list[tuple[str, float]] = []
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready(600)
        host = f"http://127.0.0.1:{args.port}"
        for name, users, seconds in (("low", args.low_users, low_s), ("high", args.high_users, high_s)):
            phases.append((name, time.time()))
            spec = RunSpec(host=host, workload=args.workload, users=users, max_requests=100_000,
                           run_time_s=seconds, model=args.model, timeout_s=300, grace_s=30)
            rows += _load(run_locust(spec, args.out / name))
        phases.append(("idle", time.time()))
        time.sleep(idle_s)
        phases.append(("end", time.time()))
    finally:
        server.stop()
    timeline = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    summary = summarize(timeline, phases, rows, args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"plot: {plot(timeline, phases, args, args.out / 'autoscale.png')}")
    return 0


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(timeline: list[dict[str, Any]], phases: list[tuple[str, float]], rows: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    marks = dict(phases)
    step, step_end = marks["high"], marks["idle"]
    met = [(r["wall"], _ok(r["ttft_p90_ms"], args.ttft_ms) and _ok(r["itl_p90_ms"], args.itl_ms))
           for r in timeline if step <= r["wall"] < step_end]
    broken = next((t for t, ok in met if not ok), None)  # the step's load first breaks a target
    met_again = None
    if broken is not None:
        after = [(t, ok) for t, ok in met if t > broken]
        for i in range(len(after) - SETTLED + 1):  # SETTLED intervals in a row within both targets
            if all(ok for _, ok in after[i:i + SETTLED]):
                met_again = after[i][0] - broken
                break
    t0 = timeline[0]["wall"]
    decisions = [{"t": round(r["wall"] - t0, 1), **d} for r in timeline for d in r["decisions"]]
    return {"requests": len(rows), "failed": sum(not r["ok"] for r in rows),
            "seconds_from_step_to_first_breach": None if broken is None else broken - step,
            "seconds_from_breach_to_targets_met_again": met_again,  # None: not within the high phase
            "decisions": decisions,
            "targets": {"ttft_p90_ms": args.ttft_ms, "itl_p90_ms": args.itl_ms}}


def _ok(value: float | None, target: float) -> bool:
    return value is not None and value <= target


def plot(timeline: list[dict[str, Any]], phases: list[tuple[str, float]], args: argparse.Namespace,
         path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline[0]["wall"]
    t = [r["wall"] - t0 for r in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].step(t, [r["prefill_workers"] for r in timeline], where="post", label="prefill")
    axes[0].step(t, [r["decode_workers"] for r in timeline], where="post", label="decode")
    axes[0].set(ylabel="workers")
    axes[1].plot(t, [r["prompt_tokens_per_s"] for r in timeline], label="prompt tokens/s")
    axes[1].set(ylabel="prompt tok/s")
    for ax, key, target, label in ((axes[2], "ttft_p90_ms", args.ttft_ms, "TTFT p90 (ms)"),
                                   (axes[3], "itl_p90_ms", args.itl_ms, "ITL p90 (ms)")):
        ax.plot(t, [r[key] if r[key] is not None else float("nan") for r in timeline], ".-")
        ax.axhline(target, color="red", ls="--", lw=1, label="target")
        ax.set(ylabel=label, yscale="log")
    for ax in axes:
        for name, start in phases:
            ax.axvline(start - t0, color="grey", lw=0.8)
            if ax is axes[0]:
                ax.text(start - t0, ax.get_ylim()[1] if ax.get_ylim()[1] else 1, name, fontsize=8, va="top")
        ax.legend(loc="upper right", fontsize=8)
    axes[3].set(xlabel="seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
