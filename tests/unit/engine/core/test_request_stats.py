"""vLLM's per-request and per-step metrics as the scheduler records them (engine/core/request_stats.py):
the four phase times of a finished request from its timestamps, the time between its tokens,
tokens per step, and a disaggregated request's decode half not counting its prompt again. The
expected values follow vLLM v1's definitions (vllm/v1/metrics/stats.py), worked out by hand."""

from __future__ import annotations

import math

from engine.core.outputs import Histogram, buckets_1_2_5
from engine.core.request import Request, RequestStatus
from engine.core.request_stats import SchedulerCounters
from engine.sampling_params import SamplingParams


def request(prompt_len: int, kv: dict[str, object] | None = None) -> Request:
    params = SamplingParams(max_tokens=8, ignore_eos=True, kv_transfer_params=kv)
    r = Request("r", list(range(100, 100 + prompt_len)), params, eos_token_id=0, arrival_time=100.0)
    r.times.first_scheduled_time = 100.5
    return r


def generate(counters: SchedulerCounters, r: Request, at: list[float]) -> None:
    """One token per step at each time in `at`, then the request finishes."""
    for now in at:
        counters.on_tokens(r, 1, now)
        r.append_output_token_ids([7])
        counters.end_step()
    r.times.finished_time = at[-1]
    counters.on_finished(r)


def only_value(h: Histogram) -> float:
    assert h.count == 1
    return h.total


def test_buckets_for_token_counts_are_vllms_1_2_5_series() -> None:
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(4096)[-1] == 2000


def test_a_finished_request_gives_queue_prefill_decode_and_inference_times() -> None:
    counters = SchedulerCounters.create(max_model_len=512)
    r = request(prompt_len=12)
    generate(counters, r, at=[101.0, 101.25, 101.75])  # arrival 100.0, scheduled 100.5
    h = counters.histograms
    assert only_value(h.queue_seconds) == 0.5  # arrival -> first scheduled
    assert only_value(h.prefill_seconds) == 0.5  # first scheduled -> first token
    assert only_value(h.decode_seconds) == 0.75  # first token -> last token
    assert only_value(h.inference_seconds) == 1.25  # first scheduled -> last token
    # Between consecutive tokens: 0.25 s and 0.5 s, none for the first.
    assert h.time_per_output_token.count == 2 and h.time_per_output_token.total == 0.75
    assert only_value(h.prompt_tokens) == 12 and only_value(h.generation_tokens) == 3
    assert only_value(h.max_num_generation_tokens) == 3 and only_value(h.params_n) == 1
    # Step tokens: the prompt with the first token, then one per step.
    assert h.iteration_tokens.count == 3 and h.iteration_tokens.total == 12 + 1 + 1 + 1
    assert (counters.prompt_tokens, counters.generation_tokens) == (12, 3)


def test_a_bound_counts_in_its_own_bucket_as_prometheus_le() -> None:
    counters = SchedulerCounters.create(max_model_len=512)
    generate(counters, request(prompt_len=10), at=[101.0])
    cumulative = dict(counters.histograms.prompt_tokens.cumulative())
    assert (cumulative[5.0], cumulative[10.0], cumulative[math.inf]) == (0, 1, 1)


def test_the_decode_half_of_a_disaggregated_request_does_not_count_its_prompt_again() -> None:
    counters = SchedulerCounters.create(max_model_len=512)
    kv = {"do_remote_prefill": True, "keys": [], "num_tokens": 12}
    r = request(prompt_len=13, kv=kv)  # the client's 12-token prompt and the prefill's first token
    generate(counters, r, at=[101.0, 101.5])
    h = counters.histograms
    assert counters.prompt_tokens == 0 and h.prompt_tokens.count == 0
    assert counters.generation_tokens == 2 and only_value(h.generation_tokens) == 2
    assert h.iteration_tokens.total == 2  # its steps counted only the tokens it generated
    assert only_value(h.queue_seconds) == 0.5 and only_value(h.decode_seconds) == 0.5


def test_a_request_failed_before_its_first_token_gives_only_its_queue_time() -> None:
    counters = SchedulerCounters.create(max_model_len=512)
    r = request(prompt_len=12)
    r.times.finished_time = 101.0
    counters.on_finished(r)
    h = counters.histograms
    assert only_value(h.queue_seconds) == 0.5
    assert h.prefill_seconds.count == h.decode_seconds.count == h.prompt_tokens.count == 0
    assert only_value(h.generation_tokens) == 0


def test_a_continued_sample_counts_once_with_its_whole_length() -> None:
    counters = SchedulerCounters.create(max_model_len=512)
    kv = {"do_remote_prefill": True, "keys": [], "num_tokens": 12}
    params = SamplingParams(max_tokens=8, ignore_eos=True, kv_transfer_params=kv)
    # the client's 12-token prompt and the prefill's first token, handed over as a prior output
    r = Request("r", list(range(100, 113)), params, eos_token_id=0, arrival_time=100.0, num_prior_outputs=1)
    r.times.first_scheduled_time = 100.5
    generate(counters, r, at=[101.0, 101.5])
    h = counters.histograms
    assert counters.generation_tokens == 2  # the tokens computed here
    assert only_value(h.generation_tokens) == 3 and only_value(h.max_num_generation_tokens) == 3


def _prefill_half(first: int, sample_max: int | None, sample_min: int = 0, ignore_eos: bool = False,
                  aborted: bool = False) -> SchedulerCounters:
    """The prefill half of a split sample (max_tokens 1, the client's limits as hints) whose
    first token is `first` (EOS is 0, stop token 5)."""
    counters = SchedulerCounters.create(max_model_len=512)
    kv = {"do_remote_decode": True, "transfer_id": "t", "sample_max_tokens": sample_max,
          "sample_min_tokens": sample_min}
    params = SamplingParams(max_tokens=1, min_tokens=min(sample_min, 1), ignore_eos=ignore_eos,
                            stop_token_ids=[5], kv_transfer_params=kv)
    r = Request("r", list(range(100, 112)), params, eos_token_id=0, arrival_time=100.0)
    r.times.first_scheduled_time = 100.5
    if aborted:
        r.status = RequestStatus.FINISHED_ABORTED
        counters.on_finished(r)
        return counters
    counters.on_tokens(r, 1, 101.0)
    r.append_output_token_ids([first])
    counters.on_finished(r)
    return counters


def test_a_prefill_half_counts_its_sample_only_when_its_first_token_ends_it() -> None:
    def counted(c: SchedulerCounters) -> int:
        h = c.histograms
        assert h.generation_tokens.count == h.max_num_generation_tokens.count == h.params_n.count
        return h.generation_tokens.count

    assert counted(_prefill_half(first=9, sample_max=16)) == 0  # the decode worker goes on
    assert counted(_prefill_half(first=9, sample_max=None)) == 0  # no limit: goes on
    assert counted(_prefill_half(first=9, sample_max=1)) == 1  # max_tokens 1: it ends here
    assert counted(_prefill_half(first=0, sample_max=16)) == 1  # EOS
    assert counted(_prefill_half(first=5, sample_max=16)) == 1  # a stop token
    assert counted(_prefill_half(first=0, sample_max=16, ignore_eos=True)) == 0
    assert counted(_prefill_half(first=0, sample_max=16, sample_min=3)) == 0  # EOS may not stop it yet
    assert counted(_prefill_half(first=9, sample_max=16, aborted=True)) == 0
    assert only_value(_prefill_half(first=9, sample_max=1).histograms.generation_tokens) == 1
    # its times and prompt still count on the prefill worker
    assert _prefill_half(first=9, sample_max=16).histograms.prompt_tokens.count == 1
