"""KV cache blocks, their LRU free queue, and the pool that hands them out (pure Python).

A block with `ref_cnt == 0` sits in the free queue. Freed blocks keep their prefix-cache hash
until they are handed out again, so a later request can still hit them; the free queue is
ordered so the least recently used block is reallocated (and its hash evicted) first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_events.recorder import KVEventRecorder


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_hash", "block_id", "is_null", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: pop from the front, append at the back, O(1) remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from the front (next to be reused) to the back; for tests and stats."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All `num_blocks` blocks; block 0 is the null block and is never handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.recorder: KVEventRecorder | None = None  # KV cache events (engine/kv_events/)

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of usable blocks in use (0.0 .. 1.0)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Takes n blocks from the front of the free queue, evicting their cached hashes."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            self._evict_hash(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the back of the free queue in
        the given order (so the first given is evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Records a full block under its hash (a block already cached keeps its first hash).
        True when the hash is new to the cache (a later request can now hit it)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self.cached_block_hash_to_block.setdefault(block_hash, block) is block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.recorder is not None:
            self.recorder.cleared()
        return True

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.recorder is not None:
                self.recorder.removed(block.block_hash)
        block.block_hash = None
