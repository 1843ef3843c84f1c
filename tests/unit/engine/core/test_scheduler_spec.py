"""The scheduler's side of speculative decoding: drafts scheduled within the budget, the
length limits and the batch-size rule; rejected drafts rolled back and their blocks freed (the
runner told); tokens after a stop dropped; counters (engine/core/scheduler_spec.py)."""

from __future__ import annotations

from dataclasses import replace

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig

EOS = 0


def make(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    spec = kw.pop("spec", SpeculativeConfig(num_speculative_tokens=4))
    cfg = replace(EngineConfig(model="x", max_model_len=64, block_size=block_size), **kw,
                  speculative_config=spec)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching))


def req(req_id: str, n_prompt: int = 6, max_tokens: int = 20, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return Request(req_id, [100 + i for i in range(n_prompt)], sp, eos_token_id=EOS)


def step(s: Scheduler, emitted: dict[str, list[int]], drafts: dict[str, list[int]] | None = None
         ) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    """One step: requests that sample emit `emitted[req]` (default [7]); the runner proposes
    `drafts` for the next step."""
    out = s.schedule()
    ids, sampled = [], []
    for req_id in out.num_scheduled_tokens:
        r = s.requests[req_id]
        ids.append(req_id)
        sampled.append(emitted.get(req_id, [7]) if r.num_computed_tokens >= r.num_tokens else [])
    core = s.update_from_output(out, ModelRunnerOutput(ids, sampled, spec_token_ids=drafts or {}))
    return out, {o.request_id: o.new_token_ids for o in core.outputs}


def test_drafts_join_a_decode_and_rejected_ones_are_computed_again() -> None:
    s = make()
    s.add_request(req("a"))
    step(s, {}, {"a": [11, 12, 13, 14]})  # prefill; drafts for the next step
    a = s.requests["a"]
    assert a.spec_token_ids == [11, 12, 13, 14]
    out, got = step(s, {"a": [11, 12, 9]})  # two drafts kept, the third rejected (9 sampled)
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14]}
    assert got == {"a": [11, 12, 9]}
    assert a.output_token_ids == [7, 11, 12, 9]
    assert a.num_computed_tokens == a.num_tokens - 1  # the last token is computed next step
    stats = s.spec_stats
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.accepted_per_pos == [1, 1, 0, 0]
    out, _ = step(s, {})  # no drafts proposed: a plain decode
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}


def test_drafts_are_cut_to_the_budget_max_tokens_and_max_model_len() -> None:
    s = make(max_num_batched_tokens=3)
    s.add_request(req("a", n_prompt=3))
    step(s, {}, {"a": [1, 2, 3, 4]})
    out, _ = step(s, {"a": [1, 2, 3]})
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}  # budget 3 = the token + 2 drafts
    s = make()
    s.add_request(req("b", max_tokens=3))
    step(s, {}, {"b": [1, 2, 3, 4]})  # one output; two more allowed: one draft + the bonus
    out, got = step(s, {"b": [1, 2]})
    assert out.scheduled_spec_decode_tokens == {"b": [1]} and got == {"b": [1, 2]}
    assert "b" not in s.requests  # finished at max_tokens
    s = make(max_model_len=10)
    s.add_request(req("c", n_prompt=6))
    step(s, {}, {"c": [1, 2, 3, 4]})  # 7 tokens known, positions up to 9 (max_model_len 10)
    out, _ = step(s, {"c": [1, 2, 3]})
    assert out.scheduled_spec_decode_tokens == {"c": [1, 2]}


def test_each_request_gets_its_share_of_the_steps_draft_tokens() -> None:
    s = make(spec=SpeculativeConfig(num_speculative_tokens=4, max_draft_tokens_per_step=5))
    for r in "abc":
        s.add_request(req(r))
    step(s, {}, {r: [1, 2, 3, 4] for r in "abc"})
    out, _ = step(s, {})
    assert out.scheduled_spec_decode_tokens == {r: [1] for r in "abc"}  # 5 // 3 each


def test_no_drafts_when_more_requests_decode_than_disable_by_batch_size() -> None:
    s = make(spec=SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=1))
    s.add_request(req("a"))
    s.add_request(req("b"))
    step(s, {}, {"a": [1, 2], "b": [3, 4]})
    out, _ = step(s, {})
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_stop_token_inside_the_emitted_tokens_drops_those_after_it() -> None:
    s = make()
    s.add_request(req("a", stop_token_ids=[42]))
    step(s, {}, {"a": [42, 5, 6]})
    _, got = step(s, {"a": [42, 5, 6, 8]})
    assert got == {"a": [42]}
    assert "a" not in s.requests
    assert s.kv.num_free_blocks == 63  # every block back (one is the null block)


def test_blocks_only_rejected_drafts_filled_are_freed_and_the_runner_is_told() -> None:
    s = make(block_size=4)
    s.add_request(req("a", n_prompt=3))  # 3 prompt tokens: block 0
    step(s, {}, {"a": [1, 2, 3, 4]})  # 4 tokens known
    step(s, {"a": [9]})  # 4 drafts (positions 4..7: block 1) all rejected
    # the next token (position 4) needs block 1: it is kept, nothing freed, the runner not told
    assert s.requests["a"].num_tokens == 5 and len(s.kv.get_block_ids("a")[0]) == 2
    out, _ = step(s, {})
    assert out.scheduled_cached_reqs[0].num_kept_blocks is None
    # drafts reaching a third block: positions 5..12 with 8 drafts need blocks 1..3
    s2 = make(block_size=4, spec=SpeculativeConfig(num_speculative_tokens=8))
    s2.add_request(req("b", n_prompt=3))
    step(s2, {}, {"b": list(range(1, 9))})
    out, _ = step(s2, {"b": [50]})
    assert out.scheduled_spec_decode_tokens == {"b": list(range(1, 9))}
    assert len(s2.kv.get_block_ids("b")[0]) == 2  # blocks 2 and 3 freed
    out, _ = step(s2, {})
    cached = {c.req_id: c for c in out.scheduled_cached_reqs}
    assert cached["b"].num_kept_blocks == [2]
