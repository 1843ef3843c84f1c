"""Summaries and plots of a load-test run, from the per-request JSON lines the locustfile writes.

Per run: p50 / p90 / p99 of TTFT, ITL (every gap between streamed chunks, pooled), TPOT (per
request: (E2E - TTFT) / (tokens - 1)) and E2E; throughput (requests and output tokens per second
over the run's span); errors; goodput: the share of all requests (failed ones count as missing)
that met both SLOs: TTFT <= ttft_slo and the request's TPOT (its mean ITL) <= itl_slo; and the
same at TTFT SLOs scaled by SLO_SCALES (a goodput curve: one SLO alone is a coarse count where
two systems' TTFT distributions cross).
Plots (PNG): TTFT against mean ITL per request, CDFs of TTFT and ITL, and both over time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    itl_ms: float


SLO_SCALES = (0.5, 1.0, 2.0, 4.0)  # TTFT SLO multipliers of the goodput curve


def goodput(rows: list[dict[str, Any]], slo: Slo) -> float:
    """Share of all rows (failures count as missing) with TTFT <= slo.ttft_ms and mean ITL
    (TPOT) <= slo.itl_ms."""
    good = sum(1 for r in rows if r["ok"] and r["ttft"] * 1e3 <= slo.ttft_ms
               and ((t := tpot(r)) is None or t * 1e3 <= slo.itl_ms))
    return good / len(rows) if rows else 0.0


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def tpot(row: dict[str, Any]) -> float | None:
    if not row["ok"] or row["output_tokens"] < 2 or row["ttft"] is None:
        return None
    return float((row["e2e"] - row["ttft"]) / (row["output_tokens"] - 1))


def summarize(rows: list[dict[str, Any]], slo: Slo) -> dict[str, Any]:
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    itl = [g * 1e3 for r in ok for g in r["itls"]]
    tp = [t * 1e3 for r in ok if (t := tpot(r)) is not None]
    e2e = [r["e2e"] * 1e3 for r in ok]
    span = (max(r["start"] + r["e2e"] for r in rows) - min(r["start"] for r in rows)) if rows else 0.0
    out: dict[str, Any] = {
        "requests": len(rows), "failed": len(rows) - len(ok),
        "errors": sorted({r["error"][:80] for r in rows if not r["ok"]})[:5],
        "duration_s": span,
        "req_per_s": len(ok) / span if span else 0.0,
        "out_tok_per_s": sum(r["output_tokens"] for r in ok) / span if span else 0.0,
        "goodput": goodput(rows, slo),
        "goodput_by_ttft_slo": {scale: goodput(rows, Slo(slo.ttft_ms * scale, slo.itl_ms))
                                for scale in SLO_SCALES},
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
    }
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tp), ("e2e_ms", e2e)):
        out[name] = {f"p{q}": _pct(values, q) for q in (50, 90, 99)}
    return out


ROWS = [("TTFT p50 / p90 / p99 (ms)", "ttft_ms"), ("ITL p50 / p90 / p99 (ms)", "itl_ms"),
        ("TPOT p50 / p90 / p99 (ms)", "tpot_ms"), ("E2E p50 / p90 / p99 (ms)", "e2e_ms")]


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """One markdown table, one column per run."""
    names = list(summaries)
    lines = ["| measure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in ROWS:
        cells = [" / ".join(f"{s[key][f'p{q}']:.0f}" for q in (50, 90, 99)) for s in summaries.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| requests (failed) | " + " | ".join(f"{s['requests']} ({s['failed']})"
                                                     for s in summaries.values()) + " |")
    for label, key, fmt in (("throughput (req/s)", "req_per_s", ".2f"),
                            ("output tokens/s", "out_tok_per_s", ".1f"), ("goodput", "goodput", ".2f"),
                            ("run span (s)", "duration_s", ".0f")):
        cells = [format(s[key], fmt) for s in summaries.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    first = next(iter(summaries.values()), None)
    if first is not None and "goodput_by_ttft_slo" in first:
        ttft = first["slo"]["ttft_ms"]
        label = " / ".join(f"{ttft * k / 1e3:g}" for k in first["goodput_by_ttft_slo"])
        cells = [" / ".join(f"{g:.2f}" for g in s["goodput_by_ttft_slo"].values())
                 for s in summaries.values()]
        lines.append(f"| goodput at TTFT SLO {label} s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], slo: Slo, out_dir: Path) -> list[Path]:
    """TTFT vs ITL scatter, CDFs, and time series; one PNG each, every run in its own colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, rows in runs.items():
        ok = [r for r in rows if r["ok"] and tpot(r) is not None]
        ax.scatter([r["ttft"] * 1e3 for r in ok], [tpot(r) * 1e3 for r in ok],  # type: ignore[operator]
                   s=12, alpha=0.6, label=name)
    ax.axvline(slo.ttft_ms, color="grey", ls="--", lw=1)
    ax.axhline(slo.itl_ms, color="grey", ls="--", lw=1)
    ax.set(xlabel="TTFT (ms)", ylabel="mean ITL of the request (ms)", title="TTFT against ITL per request",
           xscale="log")
    ax.legend()
    paths.append(_save(fig, out_dir / "ttft_vs_itl.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, rows in runs.items():
        ok = [r for r in rows if r["ok"]]
        for ax, values in ((axes[0], [r["ttft"] * 1e3 for r in ok]),
                           (axes[1], [g * 1e3 for r in ok for g in r["itls"]])):
            if values:
                v = np.sort(values)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    axes[0].set(xlabel="TTFT (ms)", ylabel="share of requests", title="CDF of TTFT", xscale="log")
    axes[1].set(xlabel="ITL (ms)", ylabel="share of gaps", title="CDF of ITL", xscale="log")
    for ax, limit in ((axes[0], slo.ttft_ms), (axes[1], slo.itl_ms)):
        ax.axvline(limit, color="grey", ls="--", lw=1)
        ax.legend()
    paths.append(_save(fig, out_dir / "cdf.png"))

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, rows in runs.items():
        ok = sorted((r for r in rows if r["ok"]), key=lambda r: r["start"])
        if not ok:
            continue
        t0 = min(r["start"] for r in rows)
        axes[0].plot([r["start"] - t0 for r in ok], [r["ttft"] * 1e3 for r in ok], ".", label=name)
        gaps = [(r["start"] + r["ttft"] + sum(r["itls"][:i + 1]) - t0, g * 1e3)
                for r in ok for i, g in enumerate(r["itls"])]
        if gaps:
            xs, ys = zip(*sorted(gaps), strict=True)
            axes[1].plot(xs, ys, ".", ms=2, label=name)
    axes[0].set(ylabel="TTFT (ms)", yscale="log", title="over time (s from each run's start)")
    axes[1].set(ylabel="ITL (ms)", xlabel="seconds", yscale="log")
    for ax, limit in ((axes[0], slo.ttft_ms), (axes[1], slo.itl_ms)):
        ax.axhline(limit, color="grey", ls="--", lw=1)
        ax.legend()
    paths.append(_save(fig, out_dir / "over_time.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
