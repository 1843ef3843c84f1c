from __future__ import annotations

import hashlib
import struct

import pytest

from engine.core.kv_cache_manager import (
    NONE_HASH,
    KVCacheManager,
    block_hashes_for,
    hash_block_tokens,
)
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8))


def test_hash_chain_is_sha256_over_parent_and_tokens() -> None:
    expected = hashlib.sha256(NONE_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) == expected
    chain = block_hashes_for([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(chain) == 2  # only full blocks
    assert chain[1] == hash_block_tokens(chain[0], [5, 6, 7, 8])


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    a = block_hashes_for([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_hashes_for([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert block_hashes_for([1, 2, 3, 4, 9, 9, 9, 9], 4) == a


def test_cache_salt_enters_the_first_block_so_the_whole_chain_differs() -> None:
    tokens = list(range(12))
    plain = block_hashes_for(tokens, 4)
    a = block_hashes_for(tokens, 4, cache_salt="a")
    assert a[0] == hash_block_tokens(NONE_HASH, tokens[:4], cache_salt="a")
    assert a[1] == hash_block_tokens(a[0], tokens[4:8])  # later blocks chain as usual
    b = block_hashes_for(tokens, 4, cache_salt="b")
    assert len({*plain, *a, *b}) == 9  # no block shared between salts, or with no salt
    assert block_hashes_for(tokens, 4, cache_salt="a") == a


def test_a_salted_request_hits_only_blocks_of_its_own_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    first = Request("a", tokens, SamplingParams(max_tokens=8), cache_salt="t1")
    kv.allocate_slots(first, 9)
    assert first.block_hashes == block_hashes_for(tokens, 4, cache_salt="t1")
    for salt, hit in ((None, 0), ("t2", 0), ("t1", 8)):
        other = Request(f"b-{salt}", tokens, SamplingParams(max_tokens=8), cache_salt=salt)
        assert kv.get_computed_blocks(other)[1] == hit


def test_allocate_assigns_blocks_in_free_queue_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))
    blocks = (kv.allocate_slots(req, 10) or [[]])[0]
    assert [b.block_id for b in blocks] == [1, 2, 3]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == [[]]  # the third block still has room
    assert [b.block_id for b in (kv.allocate_slots(req, 3) or [[]])[0]] == [4]
    assert kv.num_free_blocks == 3


def test_allocate_returns_none_and_changes_nothing_when_it_does_not_fit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots(make_request("a", list(range(13))), 13) is None
    assert kv.num_free_blocks == 3
    assert kv.get_block_ids("a") == [[]]


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert [h.block_id for h in hits[0]] == [1, 2] and n == 8
    new = kv.allocate_slots(b, 4, n, hits)
    assert new is not None and [blk.block_id for blk in new[0]] == [4]
    assert kv.get_block_ids("b") == [[1, 2, 4]]
    assert [blk.ref_cnt for blk in hits[0]] == [2, 2]


def test_freed_request_blocks_stay_cached_and_tail_blocks_are_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=7, block_size=4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.free(a)
    # Freed in reverse: block 3 (the tail) is evicted before 2 and 1; 4..6 were never used.
    assert kv.block_pool.free_block_queue.block_ids() == [4, 5, 6, 3, 2, 1]
    b = make_request("b", [*list(range(12)), 99])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits[0]] == [1, 2, 3] and n == 12
    assert kv.allocate_slots(b, 1, n, hits) is not None
    assert kv.get_block_ids("b") == [[1, 2, 3, 4]]
    assert kv.block_pool.free_block_queue.block_ids() == [5, 6]


def test_hits_on_free_blocks_count_against_what_fits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)) + list(range(100, 109)))  # 17 tokens: 5 blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 9, n, hits) is None
    assert kv.num_free_blocks == 3 and all(h.ref_cnt == 0 for h in hits[0])


def test_eviction_drops_the_hash_of_a_reallocated_block() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)  # 2 usable blocks
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.free(a)
    c = make_request("c", [7, 7, 7, 7, 7, 7, 7, 7])
    kv.allocate_slots(c, 8)  # takes both blocks, evicting a's cached first block
    kv.free(c)
    hits, n = kv.get_computed_blocks(make_request("d", [1, 2, 3, 4, 5]))
    assert hits == [[]] and n == 0


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)


def test_decode_tokens_fill_and_cache_blocks_as_they_complete() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    a.append_output_token_ids([4])
    kv.allocate_slots(a, 1)  # computes token 4: block 1 is now full and cached
    assert kv.block_pool.get_cached_block(hash_block_tokens(NONE_HASH, [1, 2, 3, 4])) is not None
    assert a.block_hashes == block_hashes_for([1, 2, 3, 4], 4)


def test_stats_count_queried_and_hit_tokens_of_recorded_lookups_only() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(make_request("a", list(range(9))), 9)
    b = make_request("b", list(range(9)))
    _, num_hit_tokens = kv.get_computed_blocks(b)
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)  # the scheduler records what it acts on
    kv.record_lookup(b, num_hit_tokens)
    assert (kv.stats.queries, kv.stats.hits) == (9, 8)
    off = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    off.record_lookup(b, 0)
    assert (off.stats.queries, off.stats.hits) == (0, 0)  # no prefix cache, no queries (as vLLM)


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
def test_block_hashes_for_equals_the_block_by_block_chain(salt: str | None) -> None:
    """The packed-in-one-call chain (what the router hashes prompts with) gives the digests of
    `hash_block_tokens` block by block (what the engine's requests keep)."""
    import random

    from engine.core.kv_cache_manager import NONE_HASH, block_hashes_for, hash_block_tokens

    rng = random.Random(7)
    for n in (0, 3, 16, 17, 100, 1030):
        ids = [rng.randrange(0, 250_000) for _ in range(n)]
        for bs in (1, 4, 16):
            parent, want = NONE_HASH, []
            for start in range(0, n - bs + 1, bs):
                parent = hash_block_tokens(parent, ids[start:start + bs],
                                           cache_salt=salt if start == 0 else None)
                want.append(parent)
            assert block_hashes_for(ids, bs, cache_salt=salt) == want
