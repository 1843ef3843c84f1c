"""The KV cache manager of a model whose every layer has a sliding window: blocks wholly before
the window of a request's next token are freed (the null block stands in for them), once each;
freed full blocks stay hittable in the prefix cache until evicted; freeing the request later
returns only what it still holds."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 4


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=64))


def _step(kv: KVCacheManager, request: Request, n: int) -> None:
    assert kv.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


def test_blocks_behind_the_window_are_freed_as_decoding_moves_on() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, sliding_window=6)
    request = _request("a", 10)
    _step(kv, request, 10)  # the prompt: blocks 0..2 (positions 0..11)
    assert kv.num_held_blocks("a") == 3
    held = []
    for _ in range(14):  # decode positions 10..23
        request.append_output_token_ids([7])
        _step(kv, request, 1)
        held.append(kv.num_held_blocks("a"))
    # the token at position p sees p-5..p: blocks wholly before p-5 go
    [ids] = kv.get_block_ids("a")
    assert ids[:3] == [0, 0, 0] and all(i != 0 for i in ids[4:])
    assert max(held) <= 3 and kv.num_free_blocks == 31 - kv.num_held_blocks("a")
    kv.free(request)
    assert kv.num_free_blocks == 31


def test_freed_full_blocks_stay_hittable_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, sliding_window=4)
    first = _request("a", 12)
    _step(kv, first, 11)
    _step(kv, first, 1)
    first.append_output_token_ids([5])
    _step(kv, first, 1)  # computed 12: blocks before (12-4+1)//4 = 2 are freed
    assert kv.get_block_ids("a")[0][:2] == [0, 0]
    again = _request("b", 12)  # the same prompt: a hit of its first two blocks, of which only
    # the second is in the window of token 8 (positions 5..8): the first is the null block
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8 and hits[0][0].is_null and not hits[0][1].is_null


def test_without_a_window_nothing_is_freed() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    request = _request("a", 10)
    _step(kv, request, 10)
    for _ in range(14):
        request.append_output_token_ids([7])
        _step(kv, request, 1)
    assert kv.num_held_blocks("a") == 6 and 0 not in kv.get_block_ids("a")[0]


def test_a_load_from_a_connector_never_allocates_what_the_window_does_not_reach() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, sliding_window=6)
    request = _request("a", 30)
    # 29 tokens arrive from a connector: the first token computed here (29) sees 24..29
    new = kv.allocate_slots(request, 29, cache=False, num_external_tokens=29)
    assert new is not None and len(new[0]) == 2  # blocks 6 and 7 (positions 24..31); 0..5 null
    assert kv.get_block_ids("a")[0][:6] == [0] * 6 and kv.has_null_blocks("a")
    request.num_computed_tokens = 29
    kv.cache_blocks(request, 29)  # the loaded blocks' hashes: never the null ones
    assert kv.num_prefix_cached_blocks == 1  # block 6 (24..27); block 7 is not full
    assert kv.allocate_slots(request, 1) is not None
    kv.free(request)
    assert kv.num_free_blocks == 31


def test_without_a_window_a_load_allocates_every_block() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    request = _request("a", 30)
    assert len((kv.allocate_slots(request, 29, cache=False, num_external_tokens=29) or [[]])[0]) == 8
    assert not kv.has_null_blocks("a")
