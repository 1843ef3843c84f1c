from __future__ import annotations

import sys

import pytest

from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_pops_in_order_and_removes_from_the_middle_in_constant_time() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 0]
    assert q.num_free_blocks == 4
    assert [b.block_id for b in q.popleft_n(2)] == [1, 3]


def test_free_queue_refuses_more_than_it_has() -> None:
    q = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    with pytest.raises(ValueError, match="only 1 left"):
        q.popleft_n(2)


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 3
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.num_free_blocks == 0


def test_ref_counts_decide_when_a_block_returns_to_the_free_queue() -> None:
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1, b2])
    assert b1.ref_cnt == 1 and b2.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [3, 2]
    pool.free_blocks([b1])
    assert pool.free_block_queue.block_ids() == [3, 2, 1]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([b1])


def test_freed_blocks_keep_their_hash_until_reallocated() -> None:
    pool = BlockPool(3)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, b"h1")
    pool.free_blocks([b1, b2])
    assert pool.get_cached_block(b"h1") is b1  # still findable while free
    pool.touch([b1])  # a hit takes it back out of the free queue
    assert b1.ref_cnt == 1 and pool.free_block_queue.block_ids() == [2]
    pool.free_blocks([b1])
    # LRU: block 2 was freed first, so it is reused first; block 1 keeps its hash.
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 2 and pool.get_cached_block(b"h1") is b1
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 1 and new.block_hash is None and pool.get_cached_block(b"h1") is None


def test_usage_counts_blocks_in_use() -> None:
    pool = BlockPool(5)
    assert pool.usage == 0.0
    pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)


def test_core_imports_no_torch() -> None:
    import subprocess

    code = ("import sys, engine.core.scheduler, engine.core.kv_cache_manager; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
