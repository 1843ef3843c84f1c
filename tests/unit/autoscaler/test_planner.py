"""The SLO planner on recorded metric series: what it decides, and that cooldown, hysteresis and
bounds keep it from flapping."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from services.autoscaler.planner import Decision, Observation, Planner, PlannerConfig

CFG = PlannerConfig(ttft_ms=1000, itl_ms=100, min_prefill=1, max_prefill=4, min_decode=1, max_decode=4,
                    prefill_tokens_per_s=1000, prefill_utilization=0.8, decode_capacity=16,
                    up_intervals=2, down_intervals=3, up_cooldown_s=10, down_cooldown_s=20)
QUIET = Observation(time_s=0, prefill_workers=1, decode_workers=1, prompt_tokens_per_s=100,
                    requests_per_s=1, ttft_p90_ms=300, itl_p90_ms=60, prefill_waiting=0,
                    decode_running=4, decode_waiting=0)


def run(planner: Planner, series: list[Observation], apply: bool = True) -> list[Decision]:
    """Feeds the series every 5 s; applies each decision to the later observations' counts."""
    counts = {"prefill": series[0].prefill_workers, "decode": series[0].decode_workers}
    out = []
    for i, obs in enumerate(series):
        obs = replace(obs, time_s=5.0 * i, prefill_workers=counts["prefill"], decode_workers=counts["decode"])
        for d in planner.plan(obs):
            out.append(d)
            if apply:
                counts[d.pool] = d.target
    return out


def test_a_burst_of_long_prompts_grows_prefill_and_leaves_decode() -> None:
    burst = replace(QUIET, prompt_tokens_per_s=2500, ttft_p90_ms=4000, prefill_waiting=12)
    decisions = run(Planner(CFG), [QUIET] * 3 + [burst] * 6)
    assert decisions and all(d.pool == "prefill" and d.delta > 0 for d in decisions)
    assert decisions[0].target == 4  # 2500 tok/s at 1000 x 0.8 per worker needs 4: one step
    assert "TTFT p90 4000 ms > target 1000 ms" in decisions[0].reason
    assert "needs 4 workers" in decisions[0].reason


def test_many_concurrent_decodes_over_the_itl_target_grow_decode_only() -> None:
    busy = replace(QUIET, itl_p90_ms=250, decode_running=40, decode_waiting=8)
    decisions = run(Planner(CFG), [busy] * 10)
    assert decisions and all(d.pool == "decode" for d in decisions)
    assert decisions[0].target >= 2 and "ITL p90 250 ms > target 100 ms" in decisions[0].reason
    times = [d.time_s for d in decisions]
    assert all(b - a >= CFG.up_cooldown_s for a, b in itertools.pairwise(times))


def test_idle_shrinks_both_pools_to_their_minimum_one_worker_at_a_time() -> None:
    idle = replace(QUIET, prefill_workers=3, decode_workers=3, prompt_tokens_per_s=0, requests_per_s=0,
                   ttft_p90_ms=None, itl_p90_ms=None, decode_running=0)
    decisions = run(Planner(CFG), [idle] * 40)
    for pool in ("prefill", "decode"):
        mine = [d for d in decisions if d.pool == pool]
        assert [d.target for d in mine] == [2, 1]
        assert mine[1].time_s - mine[0].time_s >= CFG.down_cooldown_s
    assert all(d.delta == -1 for d in decisions)


def test_steady_load_near_the_target_never_changes_anything() -> None:
    """Signals between half the target and the target: neither low enough to shrink nor high
    enough to grow (hysteresis), whatever the noise."""
    steady = [replace(QUIET, prefill_workers=2, decode_workers=2, prompt_tokens_per_s=1000 + 150 * (i % 3),
                      ttft_p90_ms=600 + 100 * (i % 4), itl_p90_ms=55 + 20 * (i % 3), decode_running=20)
              for i in range(60)]
    assert run(Planner(CFG), steady) == []


def test_a_single_spike_does_not_scale_up() -> None:
    spike = replace(QUIET, ttft_p90_ms=5000)
    assert run(Planner(CFG), [QUIET, spike, QUIET, spike, QUIET]) == []


def test_bounds_hold_and_a_lost_worker_is_replaced_at_once() -> None:
    flood = replace(QUIET, prompt_tokens_per_s=50_000, ttft_p90_ms=9000, itl_p90_ms=900, decode_running=500,
                    decode_waiting=100)
    decisions = run(Planner(CFG), [flood] * 30)
    assert max(d.target for d in decisions) == 4 and all(d.target <= 4 for d in decisions)
    planner = Planner(CFG)
    assert planner.plan(replace(QUIET, prefill_workers=0)) == []  # one interval: maybe a late report
    lost = planner.plan(replace(QUIET, time_s=5, prefill_workers=0))
    assert [(d.pool, d.target) for d in lost] == [("prefill", 1)] and "minimum" in lost[0].reason


def test_decode_capacity_is_learned_from_what_met_the_target() -> None:
    p = Planner(CFG)
    p.plan(replace(QUIET, decode_running=40, itl_p90_ms=80))  # 40 on one worker met 100 ms
    assert p.decode_capacity == 40
    p.plan(replace(QUIET, decode_running=30, itl_p90_ms=150))  # 30 did not
    assert p.decode_capacity == 30


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_prefill"):
        PlannerConfig(min_prefill=3, max_prefill=2)
    with pytest.raises(ValueError, match="positive"):
        PlannerConfig(ttft_ms=0)


def test_quantiles_come_from_the_buckets_filled_in_the_interval() -> None:
    from services.autoscaler.observe import quantile

    before = [(0.1, 10.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)]
    after = [(0.1, 10.0), (0.5, 20.0), (1.0, 30.0), (float("inf"), 30.0)]  # 10 in (0.1,0.5], 10 in (0.5,1]
    assert quantile(0.5, before, after) == pytest.approx(0.5)
    assert quantile(0.9, before, after) == pytest.approx(0.5 + 0.5 * 0.8)
    assert quantile(0.9, after, after) is None  # nothing new
    assert quantile(0.99, [], [(1.0, 0.0), (float("inf"), 5.0)]) == 1.0  # beyond the last bucket


def test_autoscale_options_read_the_pdserve_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from services.autoscaler.local import add_autoscale_args, planner_config

    monkeypatch.setenv("PDSERVE_AUTOSCALE", "true")
    monkeypatch.setenv("PDSERVE_TTFT_MS", "1234")
    monkeypatch.setenv("PDSERVE_MAX_DECODE", "5")
    p = argparse.ArgumentParser()
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    add_autoscale_args(p)
    args = p.parse_args(["--itl-ms", "99"])
    assert args.autoscale and args.ttft_ms == 1234 and args.itl_ms == 99 and args.max_decode == 5
    cfg = planner_config(args)
    assert (cfg.min_decode, cfg.max_decode, cfg.ttft_ms) == (2, 5, 1234)
    monkeypatch.setenv("PDSERVE_MAX_PREFILL", "lots")
    with pytest.raises(ValueError, match="PDSERVE_MAX_PREFILL"):
        add_autoscale_args(argparse.ArgumentParser())


def test_prefill_throughput_is_measured_from_the_workers_busy_counters() -> None:
    from services.autoscaler.observe import RouterObserver

    obs = RouterObserver("http://127.0.0.1:1")  # no request is sent: only the counter arithmetic
    w = {"target": "a:1", "prompt_tokens": 0, "busy_seconds": 0.0}
    assert obs._busy_throughput([w]) is None  # the first reading has nothing to compare with
    assert obs._busy_throughput([{**w, "prompt_tokens": 3000, "busy_seconds": 2.0}]) == 1500
    # an idle interval, and one with too little busy time, say nothing about capacity
    assert obs._busy_throughput([{**w, "prompt_tokens": 3000, "busy_seconds": 2.0}]) is None
    assert obs._busy_throughput([{**w, "prompt_tokens": 3100, "busy_seconds": 2.1}]) is None
    # two workers pool their tokens and busy time; a restarted one (counters back at zero) is skipped
    both = [{**w, "prompt_tokens": 6100, "busy_seconds": 4.1}, {"target": "b:2", "prompt_tokens": 0,
                                                                   "busy_seconds": 0.0}]
    assert obs._busy_throughput(both) == pytest.approx(1500)
    again = [{**w, "prompt_tokens": 100, "busy_seconds": 0.1}, {"target": "b:2", "prompt_tokens": 2000,
                                                                  "busy_seconds": 1.0}]
    assert obs._busy_throughput(again) == pytest.approx(2000)


def test_measured_prefill_throughput_moves_the_planners_estimate() -> None:
    p = Planner(CFG)  # configured estimate: 1000 tokens/s per worker
    for _ in range(10):
        p.plan(replace(QUIET, prefill_busy_tokens_per_s=400.0))
    assert p.prefill_tps == pytest.approx(400, rel=0.05)
    # at 400 tok/s per worker and 80% utilization, 700 tok/s of prompts need 3 workers
    decisions = run(p, [replace(QUIET, prompt_tokens_per_s=700, prefill_busy_tokens_per_s=400.0)] * 3)
    assert [(d.pool, d.target) for d in decisions] == [("prefill", 3)]
