"""What changed in the prefix cache during a step, as events (vLLM's KV cache events).

The block pool reports every hash that leaves its map (the block was reallocated, so the cache
can no longer hit it) and the manager every run of blocks newly recorded under their hashes, in
the order they happen; `take` returns them with consecutive removals of one group merged.
Only hashes that enter or leave the map are events: a second block computed for a hash already
cached (two requests prefilled the same prefix at once) changes nothing a router could use.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

HASH_BYTES = 32  # a group-0 key is the bare SHA-256; others carry 2 bytes of group number


class KVEventRecorder:
    def __init__(self, block_size: int, num_groups: int, medium: str) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.medium = medium
        self._events: list[Event] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
               group: int) -> None:
        """`hashes`: consecutive full blocks (parent: the block before the first, None at the
        start of a prompt) whose tokens are `token_ids`."""
        if hashes:
            self._events.append(BlockStored(
                block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(token_ids),
                block_size=self.block_size, lora_id=None, medium=self.medium, lora_name=None,
                group_idx=self._group(group)))

    def removed(self, key: bytes) -> None:
        """A prefix-cache key (engine/core/kv_cache_manager.py `group_key`) left the cache."""
        group = int.from_bytes(key[HASH_BYTES:], "little") if len(key) > HASH_BYTES else 0
        block_hash, idx = key[:HASH_BYTES], self._group(group)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.group_idx == idx:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium,
                                             group_idx=idx))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _group(self, group: int) -> int | None:
        return group if self.num_groups > 1 else None
