"""loadtest.compare's figures: medians over interleaved runs, the ratios against each vLLM split
setup; and vLLM's split command line at its defaults (bf16, compiled) or forced to float32 eager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.compare import median_summary, ratios
from loadtest.peers.vllm_pd import Instance, PeerConfig, serve_command


def run(ttft: float, itl: float, tok_s: float, goodput: float) -> dict[str, Any]:
    pct = {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3}
    return {"requests": 10, "failed": 0, "duration_s": 60.0, "req_per_s": 1.0, "out_tok_per_s": tok_s,
            "goodput": goodput, "goodput_by_ttft_slo": {1: goodput, 2: goodput},
            "ttft_ms": pct, "itl_ms": {"p50": itl, "p90": itl, "p99": itl * 2},
            "tpot_ms": pct, "e2e_ms": pct}


def test_median_summary_takes_each_figure_s_median_and_sums_requests() -> None:
    m = median_summary([run(100, 10, 50, 0.5), run(300, 30, 70, 0.9), run(200, 20, 60, 0.7)])
    assert m["ttft_ms"]["p50"] == 200 and m["itl_ms"]["p99"] == 40
    assert m["out_tok_per_s"] == 60 and m["goodput"] == 0.7 and m["requests"] == 30


def test_ratios_name_both_vllm_setups() -> None:
    lines = ratios({"disaggregated": run(100, 10, 80, 0.8), "vllm-pd": run(200, 20, 40, 0.4),
                    "vllm-pd-fp32-eager": run(400, 40, 20, 0.2)})
    assert any("vLLM split (its defaults)" in x and "p50 TTFT 0.50" in x and "throughput 2.00x" in x
               for x in lines)
    assert any("vLLM split (float32, eager)" in x and "p50 TTFT 0.25" in x for x in lines)


def test_vllm_split_runs_at_its_defaults_unless_told_fp32_eager(tmp_path: Path) -> None:
    def config(fp32_eager: bool) -> PeerConfig:
        return PeerConfig(model="m", served_model_name="m", port=1, colocated=False, direct=False,
                          instances=(Instance("prefill", 2, (0,)), Instance("decode", 3, (1,))),
                          max_model_len=4096, kv_cache_gib=1, storage_dir=tmp_path, log_dir=tmp_path,
                          startup_timeout_s=1, extra_args=(), fp32_eager=fp32_eager)

    default = serve_command(config(False), Instance("prefill", 2, (0,)))
    assert "--dtype" not in default and "--enforce-eager" not in default
    forced = serve_command(config(True), Instance("prefill", 2, (0,)))
    assert forced[forced.index("--dtype") + 1] == "float32" and "--enforce-eager" in forced
