"""The KV cache manager of a hybrid model (full groups beside windowed ones, vLLM's hybrid
allocator): the windowed groups free what their window has left while the full ones keep
everything; a prefix hit is the longest prefix every group can start from; allocation is all
groups or nothing."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager, group_key
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 4
GROUPS = (None, 4, 4)  # one full group, two with a 4-key window


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=64))


def _step(kv: KVCacheManager, request: Request, n: int) -> None:
    assert kv.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


def test_windowed_groups_free_while_the_full_group_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=GROUPS)
    request = _request("a", 10)
    _step(kv, request, 10)
    assert kv.num_held_blocks("a") == 3 * 3
    for _ in range(20):  # decode positions 10..29
        request.append_output_token_ids([7])
        _step(kv, request, 1)
    full, win1, win2 = kv.get_block_ids("a")
    assert len(full) == len(win1) == len(win2) == 8  # positions 0..30
    assert 0 not in full
    # the token at 30 sees 27..30: blocks 0..5 of each windowed group are gone
    assert win1[:6] == [0] * 6 and win2[:6] == [0] * 6 and 0 not in win1[6:] + win2[6:]
    assert kv.num_held_blocks("a") == 8 + 2 + 2
    assert kv.num_free_blocks == 63 - 12
    # the groups never share a block
    held = [b for ids in (full, win1, win2) for b in ids if b != 0]
    assert len(set(held)) == len(held)
    kv.free(request)
    assert kv.num_free_blocks == 63


def test_a_hit_is_the_longest_prefix_every_group_can_start_from() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=GROUPS)
    first = _request("a", 12)
    _step(kv, first, 12)
    first.append_output_token_ids([5])
    _step(kv, first, 1)  # token 12 sees 9..12: the windowed groups free blocks 0 and 1
    kv.free(first)  # freed blocks keep their hashes
    again = _request("b", 13)  # the same 12 tokens and one more
    hits, n = kv.get_computed_blocks(again)
    assert n == 12
    assert [b.is_null for b in hits[0]] == [False] * 3
    # token 12 sees 9..12 in a windowed group: only its block 2 is needed
    assert [b.is_null for b in hits[1]] == [True, True, False] == [b.is_null for b in hits[2]]

    # group 1's copy of block 2 is evicted: a hit of 2 blocks (token 8 sees 5..8: block 1) is
    # what all groups can start from, though the full group holds 3
    del kv.block_pool.cached_block_hash_to_block[group_key(again.block_hashes[2], 1)]
    hits, n = kv.get_computed_blocks(again)
    assert n == 8 and [b.is_null for b in hits[1]] == [True, False]
    assert all(not b.is_null for b in hits[0])

    # the full group's block 1 is evicted: one block at most
    del kv.block_pool.cached_block_hash_to_block[group_key(again.block_hashes[1], 0)]
    hits, n = kv.get_computed_blocks(again)
    assert n == 4 and [len(h) for h in hits] == [1, 1, 1]

    # taking the hit: the null entries stay null, the rest are referenced
    assert kv.allocate_slots(again, 9, n, hits) is not None
    assert kv.get_block_ids("b")[0][0] == hits[0][0].block_id and hits[0][0].ref_cnt == 1
    kv.free(again)
    assert kv.num_free_blocks == 63


def test_allocation_is_all_groups_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, group_windows=GROUPS)  # 7 usable
    request = _request("a", 12)
    assert kv.allocate_slots(request, 12) is None  # 3 groups x 3 blocks do not fit
    assert kv.num_free_blocks == 7 and kv.get_block_ids("a") == [[], [], []]
    assert kv.allocate_slots(request, 8) is not None  # 3 x 2 do
    assert kv.num_free_blocks == 1


def test_loaded_tokens_fill_every_full_block_and_only_the_window_of_the_rest() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=GROUPS)
    request = _request("a", 30)
    # 29 tokens arrive from a connector: token 29 sees 26..29, in blocks 6 and 7
    new = kv.allocate_slots(request, 29, cache=False, num_external_tokens=29)
    assert new is not None and [len(g) for g in new] == [8, 2, 2]
    full, win1, _ = kv.get_block_ids("a")
    assert 0 not in full and win1[:6] == [0] * 6
    request.num_computed_tokens = 29
    kv.cache_blocks(request, 29)  # full blocks 0..6 of the full group, block 6 of each windowed
    assert kv.num_prefix_cached_blocks == 7 + 1 + 1


def test_a_later_groups_hit_is_never_handed_out_as_an_earlier_groups_new_block() -> None:
    """Found in review: with the free queue full of cached blocks, group 0's new blocks were
    taken before group 1's hits left the queue, so a page of group 1's prefix became group 0's
    new block too (two groups writing one page: wrong tokens)."""
    kv = KVCacheManager(num_blocks=11, block_size=BLOCK, group_windows=(None, 8))
    a = Request("A", list(range(12)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    kv.free(a)
    c = Request("C", list(range(100, 108)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(c, 8) is not None
    kv.free(c)
    b = Request("B", [*range(12), 50, 51, 52, 53, 54], SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    assert kv.allocate_slots(b, 17 - n, n, hits) is not None
    pages = [i for ids in kv.get_block_ids("B") for i in ids if i != 0]
    assert len(pages) == len(set(pages))
    assert all(blk.ref_cnt <= 1 for blk in kv.block_pool.blocks)


def test_a_cut_short_load_restarts_only_when_the_window_meets_a_null_block() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=GROUPS)
    request = _request("a", 30)
    assert kv.allocate_slots(request, 29, cache=False, num_external_tokens=29) is not None
    # blocks 0..5 of the windowed groups are null: a load cut at 27 (token 27 sees 24..27, in
    # block 6) computes on; one cut at 24 (21..24: block 5) starts again
    assert not kv.window_has_null_blocks("a", 29) and not kv.window_has_null_blocks("a", 27)
    assert kv.window_has_null_blocks("a", 24) and kv.window_has_null_blocks("a", 20)
