"""Which blocks each request holds, with prefix caching over full blocks (pure Python)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request

NONE_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes, token_ids: list[int] | tuple[int, ...],
                      extra_keys: tuple[int, ...] = (), cache_salt: str | None = None) -> bytes:
    """h_i = SHA-256(h_{i-1} || tokens_i || extra_keys [|| "salt" || cache_salt]): equal
    prefixes give equal chains. The salt goes into the first block only (as vLLM's extra keys
    of block 0): every later hash chains over it, so salts never share a block."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(b"|")
        h.update(struct.pack(f"<{len(extra_keys)}q", *extra_keys))
    if cache_salt is not None:
        salt = cache_salt.encode()
        h.update(b"|salt|" + struct.pack("<q", len(salt)) + salt)
    return h.digest()


def block_hashes_for(token_ids: list[int], block_size: int, parent: bytes = NONE_HASH,
                     cache_salt: str | None = None) -> list[bytes]:
    """The hash chain of every full block of `token_ids` (the salt enters block 0's hash)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        salt = cache_salt if start == 0 else None
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], cache_salt=salt)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    """Allocates blocks for requests; finds and records prefix-cache hits.

    A request's blocks cover its tokens in order; `allocate_slots` grows them for the tokens
    scheduled in a step and records every block that becomes full under its hash.

    `sliding_window` (a model whose every layer sees only its last `sliding_window` positions,
    vLLM's sliding-window manager): before a request's next tokens get blocks, the blocks that
    lie wholly before the window of its first new token are freed and replaced by the null
    block in its list. Freed blocks keep their hash (a later request may still hit them until
    they are evicted); the attention backends never read a block that left every window.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_prefix_cached_blocks(self) -> int:
        """Blocks a later request can hit: full blocks recorded under their hash."""
        return len(self.block_pool.cached_block_hash_to_block)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request, and its token count.

        At least the last token is always left to compute, so the request gets logits. Not
        counted in `stats`: the scheduler records the lookup it acts on (`record_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts the lookup of a request being scheduled (or starting its KV load): its tokens
        as queries, `num_hit_tokens` as hits (vLLM's prefix_cache_queries / hits, in tokens).
        A queue head looked up again and again while it waits (no blocks, or shortest-first
        holding it back) counts once; a preempted request counts again when it resumes."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        cache: bool = True,
        num_external_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones; None if they do not
        fit (nothing is changed then). `new_computed_blocks` are prefix-cache hits covering
        `num_new_computed_tokens` tokens, taken over by the request. `cache=False` leaves the
        new blocks out of the prefix cache (KV still arriving from a connector); `cache_blocks`
        records them once their content is there. The first `num_external_tokens` of the new
        tokens arrive from a connector: with a sliding window, the blocks wholly before the
        window of the first token computed here are never allocated (null blocks), so a
        connector loads only what that window needs."""
        computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if req_blocks and self.sliding_window is not None:
            self._free_skipped_blocks(req_blocks, num_computed)
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        # With a window, blocks wholly before the window of the first token computed here (after
        # the hits and the connector's tokens) are null: hits there are not taken, and new
        # blocks there not allocated.
        first_useful = 0
        if self.sliding_window is not None:
            first_useful = max(0, num_computed + num_external_tokens - self.sliding_window + 1
                               ) // self.block_size
        base = len(req_blocks)
        num_null_hits = min(len(computed_blocks), max(0, first_useful - base))
        kept_hits = computed_blocks[num_null_hits:]
        num_skipped = max(0, first_useful - base - len(computed_blocks))
        num_new_blocks = num_required - base - len(computed_blocks) - num_skipped
        # Hits that are free right now leave the free queue when taken.
        num_free_hits = sum(1 for b in kept_hits if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        null = self.block_pool.null_block
        self.block_pool.touch(kept_hits)
        req_blocks.extend([null] * num_null_hits + kept_hits + [null] * num_skipped)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Records the request's full blocks covering its first `num_tokens` tokens."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def _free_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Frees the blocks wholly before the window of the token at `num_computed` (the first
        to compute next: it sees positions `num_computed - window + 1 ..`), last first."""
        assert self.sliding_window is not None
        first_useful = max(0, num_computed - self.sliding_window + 1) // self.block_size
        skipped = []
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:  # everything before was freed in an earlier step
                break
            skipped.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(skipped)

    def has_null_blocks(self, request_id: str) -> bool:
        """Whether some of the request's blocks were freed or never allocated (a window)."""
        return any(b.is_null for b in self.req_to_blocks.get(request_id, []))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (the null blocks standing in for freed ones not counted)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, []) if not b.is_null)

    def free(self, request: Request) -> None:
        """Returns the request's blocks; the last ones become the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        num_full = request.num_tokens // self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else NONE_HASH
        for i in range(len(hashes), num_full):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block_tokens(parent, tokens,
                                       cache_salt=request.cache_salt if i == 0 else None)
            hashes.append(parent)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            if not blocks[i].is_null:  # freed (left the window) before its KV was recorded
                self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
