"""Engine stats accounting: histogram buckets, the scheduler's token and preemption counters, its
prefix-cache lookups counted once per admission, the prefix cache's block count, and the stats
message crossing the process boundary intact."""

from __future__ import annotations

import math
from typing import Any

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import (
    EngineStats,
    Histogram,
    KVTransferStats,
    ModelRunnerOutput,
    RequestHistograms,
)
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from engine.serial import STATS, MessageCodec


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   enable_prefix_caching: bool = True, policy: str = "fcfs") -> Scheduler:
    cfg = EngineConfig(model="x", max_model_len=64, block_size=block_size,
                       max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=enable_prefix_caching,
                       scheduling_policy=policy)  # type: ignore[arg-type]
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching))


def req(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, prompt, params, eos_token_id=0)


def run_step(s: Scheduler) -> None:
    """One step with a stand-in runner that samples token 7 for requests at their end."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if s.requests[i].num_computed_tokens >= s.requests[i].num_tokens else []
               for i in ids]
    s.update_from_output(out, ModelRunnerOutput(ids, sampled))


def test_histogram_counts_values_in_le_buckets_and_keeps_sum_and_count() -> None:
    h = Histogram.with_bounds((0.01, 0.1, 1.0))
    for v in (0.005, 0.01, 0.05, 0.1, 0.5, 3.0):  # a bound belongs to its own bucket (le)
        h.observe(v)
    assert h.counts == [2, 2, 1, 1]
    assert h.cumulative() == [(0.01, 2), (0.1, 4), (1.0, 5), (math.inf, 6)]
    assert h.count == 6 and math.isclose(h.total, 3.665)
    snapshot = h.copy()
    h.observe(0.2)
    assert snapshot.count == 6 and snapshot.counts == [2, 2, 1, 1]


def _run_to_end(s: Any, max_steps: int) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests()


def test_scheduler_counts_prompt_and_generated_tokens_once_per_request() -> None:
    s = make_scheduler(max_num_batched_tokens=8)  # a's 10-token prompt takes two steps
    s.add_request(req("a", list(range(100, 110)), max_tokens=3))
    s.add_request(req("b", list(range(200, 205)), max_tokens=2))
    _run_to_end(s, 20)
    assert s.counters.prompt_tokens == 15
    assert s.counters.generation_tokens == 5
    assert s.counters.preemptions == 0
    finished = s.counters.histograms
    assert finished.prompt_tokens.count == 2 and finished.prompt_tokens.total == 15
    assert finished.generation_tokens.total == 5 and finished.time_per_output_token.count == 5 - 2


def test_scheduler_counts_preemptions() -> None:
    # 6 usable blocks of 4 tokens: two requests of 8 prompt tokens each outgrow them decoding.
    s = make_scheduler(num_blocks=7, max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add_request(req("a", list(range(100, 108)), max_tokens=12))
    s.add_request(req("b", list(range(200, 208)), max_tokens=12))
    _run_to_end(s, 80)
    assert s.counters.preemptions >= 1
    assert s.counters.generation_tokens == 24  # a preempted request's tokens are not recounted
    assert s.counters.prompt_tokens == 16


def test_a_queue_head_held_back_for_steps_is_looked_up_in_the_prefix_cache_once() -> None:
    """Shortest-first: the 40-token prompt waits while the 30-token one prefills in chunks of
    16; vLLM's queries count each admitted request's tokens once, so 30 + 40 here."""
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=16, policy="sjf")
    s.add_request(req("a", list(range(100, 130)), max_tokens=1))
    s.add_request(req("b", list(range(200, 240)), max_tokens=1))
    _run_to_end(s, 20)
    assert (s.kv.stats.queries, s.kv.stats.hits) == (70, 0)
    assert s.counters.prompt_tokens == 70


def test_prefix_cached_blocks_count_full_blocks_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = req("a", list(range(100, 110)), max_tokens=1)  # 10 tokens: 2 full blocks, 3 allocated
    assert kv.allocate_slots(a, 10) is not None
    assert kv.num_prefix_cached_blocks == 2
    kv.free(a)
    assert kv.num_prefix_cached_blocks == 2  # freed blocks stay findable
    b = req("b", list(range(300, 316)), max_tokens=1)  # needs all 4 blocks: evicts a's hashes
    assert kv.allocate_slots(b, 16) is not None
    assert kv.num_prefix_cached_blocks == 4


def test_engine_stats_cross_the_process_boundary_unchanged() -> None:
    step = Histogram.with_bounds((0.01, 0.1))
    step.observe(0.05)
    transfer = KVTransferStats(load_bytes=4096, save_bytes=8192, load_failures=1)
    transfer.save_seconds.observe(0.002)
    requests = RequestHistograms.create(max_model_len=512)
    requests.prompt_tokens.observe(40)
    requests.queue_seconds.observe(0.2)
    stats = EngineStats(num_waiting=1, num_running=2, num_free_blocks=3, num_total_blocks=4,
                        kv_usage=0.25, prefix_cache_queries=64, prefix_cache_hits=32,
                        num_cached_blocks=5, num_prompt_tokens=64, num_generation_tokens=9,
                        num_preemptions=1, step_seconds=step, kv_transfer=transfer,
                        requests=requests)
    codec = MessageCodec()
    kind, decoded = codec.decode(codec.encode(STATS, stats))
    assert kind == STATS and decoded == stats
    assert decoded.kv_transfer.save_seconds.count == 1
    assert decoded.requests.prompt_tokens.bounds[-1] == 500 and decoded.requests.prompt_tokens.count == 1
    legacy = EngineStats(0, 0, 3, 4, 0.0, 0, 0)  # the old fields only: defaults fill the rest
    assert codec.decode(codec.encode(STATS, legacy))[1].step_seconds.count == 0
