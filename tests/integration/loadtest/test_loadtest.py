"""The load test for real: locust (headless, bounded) streaming from `pdserve up` on a tiny model;
the runner writes locust's CSVs, per-request records, a summary and PNG plots; an overloaded
router's refusals are counted as failed requests, not hidden."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loadtest import report
from loadtest.run import main as run_main
from loadtest.workloads import WORKLOADS, requests
from tests.integration.services.e2e_util import PdserveUp


def test_workloads_are_seeded_and_shaped() -> None:
    for name in WORKLOADS:
        a = [next(it) for it in [requests(name, 1000, seed=3)] for _ in range(20)]
        b = [s for s, _ in zip(requests(name, 1000, seed=3), range(20), strict=False)]
        assert a == b and all(100 <= t < 900 for s in a for t in s.prompt_ids)
    long = [s for s, _ in zip(requests("long-prompt", 1000), range(200), strict=False)]
    assert any(len(s.prompt_ids) == 2048 for s in long) and any(len(s.prompt_ids) < 800 for s in long)
    ratio = sum(len(s.prompt_ids) for s in long) / sum(s.max_tokens for s in long)
    assert 8 <= ratio <= 12  # about 10:1 input to output
    shared = [s for s, _ in zip(requests("shared-prefix", 1000), range(40), strict=False)]
    assert len({tuple(s.prompt_ids[:1024]) for s in shared}) == 4
    heavy = [s for s, _ in zip(requests("prompt-heavy", 1000), range(40), strict=False)]
    assert all(1024 <= len(s.prompt_ids) <= 2048 and s.max_tokens == 8 for s in heavy)


def test_summary_counts_failures_and_goodput() -> None:
    rows = [{"start": 0.0, "ok": True, "ttft": 0.1, "itls": [0.05, 0.05], "e2e": 0.2, "output_tokens": 3,
             "error": ""},
            {"start": 0.1, "ok": True, "ttft": 3.0, "itls": [0.05], "e2e": 3.05, "output_tokens": 2,
             "error": ""},
            {"start": 0.2, "ok": False, "ttft": None, "itls": [], "e2e": 0.01, "output_tokens": 0,
             "error": "HTTP 429: busy"}]
    s = report.summarize(rows, report.Slo(ttft_ms=1000, itl_ms=100))
    assert (s["requests"], s["failed"]) == (3, 1)
    assert s["goodput"] == pytest.approx(1 / 3)  # the slow TTFT and the failure miss
    # The curve over TTFT SLOs 0.5 / 1 / 2 / 4 s: the 3 s TTFT counts from 4 s on.
    assert list(s["goodput_by_ttft_slo"].values()) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 2 / 3])
    assert "| goodput at TTFT SLO 0.5 / 1 / 2 / 4 s | 0.33 / 0.33 / 0.33 / 0.67 |" in \
        report.table({"run": s})
    assert s["ttft_ms"]["p50"] == pytest.approx(1550)
    assert s["tpot_ms"]["p50"] == pytest.approx(50)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Callable[[str], Path]) -> Iterator[PdserveUp]:
    up = PdserveUp(str(tiny_model_dir("llama")), "--num-threads", "1", "--kv-cache-gib", "0.05",
                   "--max-model-len", "512", "--metrics-port-offset", "0")
    up.start()
    try:
        up.wait_ready(180)
        yield up
    finally:
        up.stop()


@pytest.mark.parametrize("mode", [["--users", "3"], ["--rate", "20"]], ids=["closed", "poisson"])
def test_a_bounded_run_reports_every_request(served: PdserveUp, tmp_path: Path, mode: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert run_main(["--host", f"http://127.0.0.1:{served.port}", "--workload", "smoke", "--model",
                     served.model, "--max-requests", "12", "--run-time", "60", "--out", str(out), *mode]) == 0
    rows = report.load(out / "requests.jsonl")
    assert len(rows) == 12 and all(r["ok"] for r in rows), [r["error"] for r in rows]
    assert all(r["output_tokens"] == 8 and len(r["itls"]) >= 1 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 0 and summary["ttft_ms"]["p50"] > 0 and summary["goodput"] > 0
    with open(out / "locust_stats.csv") as f:
        stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(stats[("TTFT", "smoke")]["Request Count"]) == 12
    assert int(stats[("E2E", "smoke")]["Failure Count"]) == 0
    assert int(stats[("ITL", "smoke")]["Request Count"]) >= 12
    for png in ("ttft_vs_itl.png", "cdf.png", "over_time.png"):
        assert (out / png).stat().st_size > 10_000
    assert "TTFT p50 / p90 / p99" in capsys.readouterr().out


@pytest.mark.slow  # ~31 s (a system of its own); test_summary_counts_failures_and_goodput: the sums
def test_refused_requests_are_counted_as_failures(tiny_model_dir: Callable[[str], Path],
                                                  tmp_path: Path) -> None:
    """A router that admits one request at a time (max_inflight 1) under 6 users refuses most
    with 429: the run still ends within its bounds and the refusals show as failures."""
    from services.router.app import RouterConfig
    from services.router.dispatch.dispatcher import DispatchOptions
    from tests.integration.services.router_util import ServedRouter

    model = tiny_model_dir("llama")
    # --no-auth: the test's own router below calls the worker `up` started
    up = PdserveUp(str(model), "--num-threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "512",
                   "--metrics-port-offset", "0", "--no-auth", colocated=True)
    up.start()
    try:
        up.wait_ready(180)
        config = RouterConfig(model="tiny", tokenizer=str(model), max_model_len=512, max_inflight=1,
                              dispatch=DispatchOptions(decode=(up.decode_target,)))
        with ServedRouter(config) as router:
            out = tmp_path / "overload"
            run_main(["--host", router.url, "--workload", "smoke", "--model", "tiny", "--users", "6",
                      "--max-requests", "30", "--run-time", "60", "--out", str(out)])
    finally:
        up.stop()
    rows = report.load(out / "requests.jsonl")
    failed = [r for r in rows if not r["ok"]]
    assert len(rows) == 30 and failed and all("429" in r["error"] for r in failed)
    assert json.loads((out / "summary.json").read_text())["failed"] == len(failed)
