"""An approximate per-worker record of the prompt prefixes a worker has computed, so the router can
send a prompt where its prefix is most likely still cached.

Prompts are cut into blocks of `block_size` tokens (the engine's KV block size) and each full
block gets the engine's own prefix-cache hash (the SHA-256 chain of engine/core/
kv_cache_manager.py, the hashes its KV events name: dispatch/kv_events.py); a worker's
index remembers the chained hashes of prompts sent to it (least recently used dropped beyond
`max_blocks`). A match is the number of leading blocks found, so it is what the worker's prefix
cache would hit if it had not evicted them since: approximate by design (no feedback from the
worker), cheap (a dict lookup per block), and never wrong about correctness, only placement.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.core.kv_cache_manager import block_hashes_for


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The engine's hashes of the full blocks of `token_ids` (a salt enters the first block's, as
    in the workers' prefix caches, so a prompt never matches another salt's blocks)."""
    return block_hashes_for(list(token_ids), block_size, cache_salt=cache_salt or None)


class PrefixIndex:
    def __init__(self, block_size: int = 16, max_blocks: int = 200_000) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size}, {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many tokens, from the first, this worker has likely cached."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, hashes: Sequence[bytes]) -> int:
        """Records a prompt sent to this worker (its blocks become the most recently used);
        returns what `match` would have returned before."""
        matched, leading = 0, True
        for h in hashes:
            leading = leading and h in self._blocks
            matched += leading
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return matched * self.block_size

    def clear(self) -> None:
        """Forgets everything (the worker restarted or was marked unhealthy)."""
        self._blocks.clear()
