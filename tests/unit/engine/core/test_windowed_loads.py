"""A consumer of a windowed model loads only what the window of its first computed token needs:
the blocks before it are never allocated (the connector is handed null blocks there and starts
its load after them). A load of that kind cut short starts the request again locally: the tokens
it would compute next would see the skipped positions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from engine.connector.base import KVConnectorOutput, KVConnectorScheduler
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import ModelRunnerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from tests.unit.engine.core.test_scheduler import req

BLOCK, WINDOW = 4, 6


class Loading(KVConnectorScheduler):
    """Offers every prompt but its last token from the 'store', loaded asynchronously."""

    def __init__(self) -> None:
        self.block_ids: dict[str, list[int]] = {}  # the one group's

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return request.num_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        self.block_ids[request.request_id] = list(block_ids[0])

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[list[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def _scheduler() -> Scheduler:
    cfg = replace(EngineConfig(model="x", max_model_len=64, block_size=BLOCK), max_num_batched_tokens=64)
    s = Scheduler(cfg, KVCacheManager(64, BLOCK, cfg.enable_prefix_caching, sliding_window=WINDOW))
    s.connector = Loading()
    return s


def _step(s: Scheduler, connector_output: KVConnectorOutput | None = None) -> Any:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if s.requests[i].num_computed_tokens >= s.requests[i].num_tokens else [] for i in ids]
    s.update_from_output(out, ModelRunnerOutput(ids, sampled, kv_connector_output=connector_output))
    return out


def test_the_load_skips_what_the_window_does_not_reach() -> None:
    s = _scheduler()
    s.add_request(req("a", 30, max_tokens=3))
    _step(s)  # allocates for the 29 external tokens and starts the load
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.connector.block_ids["a"][:6] == [0] * 6  # type: ignore[union-attr]
    assert all(b != 0 for b in s.connector.block_ids["a"][6:])  # type: ignore[union-attr]
    out = _step(s, KVConnectorOutput(finished_recving={"a"}))
    out = _step(s)
    assert s.requests["a"].num_computed_tokens >= 29 and out.num_scheduled_tokens.get("a") == 1


def test_a_windowed_load_cut_short_computes_the_request_again_from_the_start() -> None:
    s = _scheduler()
    free = s.kv.num_free_blocks
    s.add_request(req("a", 30, max_tokens=3))
    _step(s)
    _step(s, KVConnectorOutput(finished_recving={"a"}, valid_loaded_tokens={"a": 26},
                               load_errors={"a": "chunk 1 missing"}))
    assert not s.kv.has_null_blocks("a")
    out = _step(s)  # computed here, from token 0, in blocks of its own
    assert out.num_scheduled_tokens == {"a": 30}
    assert not s.kv.has_null_blocks("a")  # no block skipped this time
    while s.has_unfinished_requests():
        _step(s)
    assert s.kv.num_free_blocks == free


def test_prefix_hits_before_the_window_are_not_taken() -> None:
    """A long cached prefix in a cache sized for windows: the request takes only the hits its
    window reaches (a deadlock before: it took them all and never fit)."""
    cfg = replace(EngineConfig(model="x", max_model_len=200, block_size=BLOCK), max_num_batched_tokens=16)
    s = Scheduler(cfg, KVCacheManager(13, BLOCK, True, sliding_window=8))
    prompt = list(range(100, 140))  # 10 of the 12 usable blocks
    for rid, tokens in (("a", prompt), ("b", prompt + list(range(200, 240)))):
        s.add_request(Request(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=9999))
        for _ in range(60):
            if not s.has_unfinished_requests():
                break
            _step(s)
        assert not s.has_unfinished_requests(), f"{rid} never finished"
    assert s.kv.num_free_blocks == 12


def test_a_load_after_prefix_hits_starts_after_the_skipped_blocks() -> None:
    s = _scheduler()
    s.add_request(req("first", 8, max_tokens=1))  # caches the first two blocks of its prompt
    while s.has_unfinished_requests():
        _step(s, KVConnectorOutput(finished_recving={"first"}))
    prompt = list(req("first", 8).prompt_token_ids) + list(range(500, 522))
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=2), eos_token_id=9999))
    _step(s)
    ids = s.connector.block_ids["b"]  # type: ignore[union-attr]
    assert ids[:6] == [0] * 6 and all(b != 0 for b in ids[6:])  # the hits before the window too
