from __future__ import annotations

from dataclasses import replace

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import FinishReason, ModelRunnerOutput, SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    cfg = replace(EngineConfig(model="x", max_model_len=64, block_size=block_size), **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching))


def req(req_id: str, n_prompt: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
        **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    prompt = [100 + int.from_bytes(req_id.encode(), "little") % 50 + i for i in range(n_prompt)]
    return Request(req_id, prompt, sp, eos_token_id=EOS, arrival_time=arrival, priority=priority)


def run_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    """One step with a stand-in runner that samples `token` for requests that reached their end."""
    out = s.schedule()
    ids, sampled = [], []
    for req_id, _n in out.num_scheduled_tokens.items():
        r = s.requests[req_id]
        ids.append(req_id)
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    core_out = s.update_from_output(out, ModelRunnerOutput(ids, sampled))
    return out, core_out.outputs


def test_prefill_is_chunked_by_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(req("a", 20))
    out, res = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8} and res == []
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 8
    out, res = run_step(s)
    assert out.num_scheduled_tokens == {"a": 4}
    assert res[0].new_token_ids == [7]


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(req("a", 6))
    run_step(s)
    s.add_request(req("b", 30))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    for name in "abc":
        s.add_request(req(name, 3))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"] and s.num_waiting == 1


def test_long_prefill_threshold_caps_one_prefill_per_step() -> None:
    s = make_scheduler(long_prefill_token_threshold=5)
    s.add_request(req("a", 12))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 5}


def test_preemption_frees_the_last_running_request_and_requeues_it_first() -> None:
    # 6 usable blocks of 4 tokens. a and b take 2 blocks each; as they decode they need more.
    s = make_scheduler(num_blocks=7, max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12))
    s.add_request(req("c", 3, max_tokens=1))
    run_step(s)
    assert s.kv.num_free_blocks == 2  # a and b hold 2 blocks each; c finished and freed its one
    preempted_once = False
    for _ in range(30):
        out, _ = run_step(s)
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"b"}
            b = next(r for r in s.waiting if r.request_id == "b")
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert s.waiting.peek() is b
            assert s.kv.get_block_ids("b") == [[]]
            preempted_once = True
            break
    assert preempted_once
    # b comes back as a new request to the runner (all its tokens), after a finishes.
    resumed = None
    for _ in range(40):
        out, _ = run_step(s)
        resumed = resumed or next((n for n in out.scheduled_new_reqs if n.req_id == "b"), None)
        if not s.has_unfinished_requests():
            break
    assert resumed is not None and len(resumed.token_ids) > 8
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 6


def test_priority_policy_schedules_lower_values_first_and_preempts_the_lowest() -> None:
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(req("low", 3, priority=5, arrival=1.0))
    s.add_request(req("high", 3, priority=0, arrival=2.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["high"]

    s = make_scheduler(num_blocks=5, scheduling_policy="priority", enable_prefix_caching=False)
    s.add_request(req("p0", 7, priority=0, max_tokens=10))
    s.add_request(req("p9", 7, priority=9, max_tokens=10))
    preempted: set[str] = set()
    for _ in range(6):
        out, _ = run_step(s)
        preempted |= out.preempted_req_ids
    assert preempted == {"p9"}


def test_abort_frees_blocks_and_tells_the_runner() -> None:
    s = make_scheduler()
    s.add_request(req("a", 9))
    s.add_request(req("w", 9))
    free0 = s.kv.num_free_blocks
    run_step(s)
    s.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == free0 and not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"a", "w"}


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back() -> None:
    s = make_scheduler()
    s.add_request(req("a", 3, max_tokens=5))
    _, res = run_step(s, token=EOS)
    assert res[0].finish_reason == FinishReason.STOP and res[0].stop_reason is None

    s.add_request(req("b", 3, max_tokens=5, ignore_eos=True))
    s.add_request(req("c", 3, max_tokens=5, min_tokens=2))
    _, res = run_step(s, token=EOS)
    assert [o.finish_reason for o in res] == [None, None]
    _, res = run_step(s, token=EOS)
    assert [o.finish_reason for o in res] == [None, FinishReason.STOP]


def test_stop_token_ids_and_max_tokens_end_requests() -> None:
    s = make_scheduler()
    s.add_request(req("a", 3, max_tokens=5, stop_token_ids=[42]))
    s.add_request(req("b", 3, max_tokens=2))
    _, res = run_step(s, token=42)
    assert res[0].finish_reason == FinishReason.STOP and res[0].stop_reason == 42
    assert res[1].finish_reason is None
    _, res = run_step(s, token=42)
    assert res[0].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished_requests()


def test_max_model_len_caps_generation() -> None:
    s = make_scheduler()  # max_model_len 64
    s.add_request(req("a", 62, max_tokens=50))
    run_step(s)
    _, res = run_step(s)
    assert res[0].finish_reason == FinishReason.LENGTH and res[0].times is not None
    assert res[0].times.first_token_time > 0


def test_prefix_hits_are_counted_as_cached_tokens() -> None:
    s = make_scheduler()
    s.add_request(req("a", 13))
    run_step(s)
    b = req("b", 13)
    b.prompt_token_ids = list(s.requests["a"].prompt_token_ids)
    b.all_token_ids = list(b.prompt_token_ids)
    s.add_request(b)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens["b"] == 1
    assert s.requests["b"].times.num_cached_tokens == 12


def test_scheduler_output_holds_only_plain_values() -> None:
    s = make_scheduler()
    s.add_request(req("a", 5))
    out = s.schedule()
    plain = (str, int, float, bool, type(None), list, dict, set, tuple)
    for nr in out.scheduled_new_reqs:
        for v in vars(nr).values():
            assert isinstance(v, (plain, SamplingParams))
