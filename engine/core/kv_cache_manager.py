"""Which blocks each request holds, with prefix caching over full blocks (pure Python)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
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
    """The hash chain of every full block of `token_ids` (the salt enters block 0's hash): the
    same digests as `hash_block_tokens` block by block, with the tokens packed in one call (the
    router hashes every prompt on its event loop)."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    packed = struct.pack(f"<{n * block_size}q", *token_ids[:n * block_size])
    width = 8 * block_size
    hashes = []
    for i in range(n):
        h = hashlib.sha256(parent)
        h.update(packed[i * width:(i + 1) * width])
        if i == 0 and cache_salt is not None:
            salt = cache_salt.encode()
            h.update(b"|salt|" + struct.pack("<q", len(salt)) + salt)
        parent = h.digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    """Allocates blocks for requests; finds and records prefix-cache hits.

    A request holds one list of blocks per KV cache group (engine/core/kv_layout.py: one group,
    unless the model is hybrid); each covers its tokens in order. `allocate_slots` grows them for
    the tokens scheduled in a step and records every block that becomes full under its hash
    (keyed by group: a page of one group holds other layers than another's).

    A group with a window (`group_windows`; `sliding_window` for the one group of a model whose
    every layer has one) frees, before a request's next tokens get blocks, its blocks that lie
    wholly before the window of the first new token, and puts the null block in their place
    (vLLM's sliding-window manager). Freed blocks keep their hash (a later request may still hit
    them until they are evicted); the attention backends never read a block that left every
    window of its layers. A prefix hit of `k` blocks needs every kept group's first `k` blocks
    and each windowed group's blocks within the window of the token after them (vLLM's hybrid
    rule: the longest such `k`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None) -> None:
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window (one group) or group_windows, not both")
        windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        if not windows:
            raise ValueError("at least one KV cache group is needed")
        for w in windows:
            if w is not None and w < 1:
                raise ValueError(f"sliding_window must be at least 1, got {w}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = windows
        self.num_groups = len(windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
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

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Cached blocks for the longest prefix of the request every group can start from (per
        group; null blocks before a windowed group's window), and its token count.

        At least the last token is always left to compute, so the request gets logits. Not
        counted in `stats`: the scheduler records the lookup it acts on (`record_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        pool = self.block_pool
        found: list[list[KVCacheBlock | None]] = [[] for _ in self.windows]
        length = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:  # a kept group: its leading run of hits (stops at the first miss)
                for i, h in enumerate(hashes[:length]):
                    block = pool.get_cached_block(group_key(h, g))
                    if block is None:
                        length = i
                        break
                    found[g].append(block)
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        for g in windowed:  # within what the kept groups allow
            found[g] = [pool.get_cached_block(group_key(h, g)) for h in hashes[:length]]
        runs = {g: _runs_ending_at(found[g][:length]) for g in windowed}
        while length > 0 and not all(
                runs[g][length - 1] >= length - self._first_useful(g, length * self.block_size)
                for g in windowed):
            length -= 1
        null = pool.null_block
        hits = []
        for g in range(self.num_groups):
            first = self._first_useful(g, length * self.block_size)
            blocks = found[g][first:length]
            assert all(b is not None for b in blocks)
            hits.append([null] * first + [b for b in blocks if b is not None])
        return hits, length * self.block_size

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
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        cache: bool = True,
        num_external_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones, per group; None if
        they do not fit (nothing is changed then, but blocks that left a window). The
        `new_computed_blocks` (per group, from `get_computed_blocks`) are prefix-cache hits
        covering `num_new_computed_tokens` tokens, taken over by the request. `cache=False`
        leaves the new blocks out of the prefix cache (KV still arriving from a connector);
        `cache_blocks` records them once their content is there. The first
        `num_external_tokens` of the new tokens arrive from a connector: in a windowed group, the
        blocks wholly before the window of the first token computed here are never allocated
        (null blocks), so a connector loads only what that window needs."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        fresh = req_blocks is None
        if req_blocks is None:
            req_blocks = [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        for g, window in enumerate(self.windows):
            if window is not None and req_blocks[g]:
                self._free_skipped_blocks(req_blocks[g], g, num_computed)
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        plans = []
        num_new_total = num_free_hits = 0
        for g in range(self.num_groups):
            hits = new_computed_blocks[g] if new_computed_blocks else []
            # Blocks wholly before the window of the first token computed here (after the hits
            # and the connector's tokens) are null: hits there are not taken, and new blocks
            # there not allocated.
            first_useful = self._first_useful(g, num_computed + num_external_tokens)
            base = len(req_blocks[g])
            num_null_hits = min(len(hits), max(0, first_useful - base))
            kept = hits[num_null_hits:]
            num_skipped = max(0, first_useful - base - len(hits))
            num_new = max(0, num_required - base - len(hits) - num_skipped)
            plans.append((num_null_hits, kept, num_skipped, num_new))
            num_new_total += num_new
            num_free_hits += sum(1 for b in kept if b.ref_cnt == 0 and not b.is_null)  # they
            # leave the free queue
        if num_new_total > self.block_pool.num_free_blocks - num_free_hits:
            return None
        null = self.block_pool.null_block
        # Every group's hits leave the free queue before any group takes new blocks from it: a
        # later group's hit must never be handed out as an earlier group's new block.
        for _, kept, _, _ in plans:
            self.block_pool.touch(b for b in kept if not b.is_null)
        new_blocks = []
        for g, (num_null_hits, kept, num_skipped, num_new) in enumerate(plans):
            new = self.block_pool.get_new_blocks(num_new)
            req_blocks[g].extend([null] * num_null_hits + kept + [null] * num_skipped + new)
            new_blocks.append(new)
        if fresh:
            self.req_to_blocks[request.request_id] = req_blocks
        if self.enable_caching and cache:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Records the request's full blocks covering its first `num_tokens` tokens."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def _first_useful(self, group: int, num_computed: int) -> int:
        """The first block of `group` the token at `num_computed` sees (0 without a window)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def _free_skipped_blocks(self, blocks: list[KVCacheBlock], group: int, num_computed: int) -> None:
        """Frees the group's blocks wholly before the window of the token at `num_computed` (the
        first to compute next: it sees positions `num_computed - window + 1 ..`), last first."""
        first_useful = self._first_useful(group, num_computed)
        skipped = []
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:  # everything before was freed in an earlier step
                break
            skipped.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(skipped)

    def has_null_blocks(self, request_id: str) -> bool:
        """Whether some of the request's blocks were freed or never allocated (a window)."""
        return any(b.is_null for blocks in self.req_to_blocks.get(request_id, []) for b in blocks)

    def window_has_null_blocks(self, request_id: str, num_computed: int) -> bool:
        """Whether the token at `num_computed` would see a null block: in some windowed group,
        a block in its window was never allocated (a load planned to end later, cut short)."""
        groups = self.req_to_blocks.get(request_id, [])
        for g, blocks in enumerate(groups):
            first = self._first_useful(g, num_computed)
            last = min(len(blocks), num_computed // self.block_size + 1)
            if any(b.is_null for b in blocks[first:last]):
                return True
        return False

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in all groups (null blocks standing in for freed ones not
        counted)."""
        return sum(1 for blocks in self.req_to_blocks.get(request_id, []) for b in blocks
                   if not b.is_null)

    def trim(self, request: Request, num_tokens: int) -> list[int] | None:
        """Frees the request's blocks past those its first `num_tokens` tokens need (blocks that
        only rejected draft tokens filled; never recorded in the prefix cache). Returns the
        blocks kept per group, or None when none was freed."""
        groups = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not groups or all(len(blocks) <= keep for blocks in groups):
            return None
        for blocks in groups:
            extra = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free_blocks(b for b in reversed(extra) if not b.is_null)
        return [len(blocks) for blocks in groups]

    def free(self, request: Request) -> None:
        """Returns the request's blocks; the last ones become the first to be evicted."""
        groups = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        for blocks in groups:
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per group (0: the null block)."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return [[] for _ in self.windows]
        return [[b.block_id for b in blocks] for blocks in groups]

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
        pool, hashes = self.block_pool, request.block_hashes
        for g, blocks in enumerate(self.req_to_blocks[request.request_id]):
            new = [i for i in range(start, num_full)  # (a null block left the window unrecorded)
                   if not blocks[i].is_null and pool.cache_full_block(blocks[i], group_key(hashes[i], g))]
            if new and pool.recorder is not None:
                self._record_stored(request, new, g)
        self.num_cached_blocks[request.request_id] = num_full

    def _record_stored(self, request: Request, new: list[int], group: int) -> None:
        """KV events: one BlockStored per run of consecutive blocks new to the cache."""
        assert self.block_pool.recorder is not None
        bs, hashes, run = self.block_size, request.block_hashes, [new[0]]
        for i in [*new[1:], -1]:
            if i == run[-1] + 1:
                run.append(i)
                continue
            first, end = run[0], run[-1] + 1
            self.block_pool.recorder.stored(hashes[first:end], hashes[first - 1] if first else None,
                                            request.all_token_ids[first * bs:end * bs], group)
            run = [i]


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group` (group 0's is the block hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def _runs_ending_at(blocks: list[KVCacheBlock | None]) -> list[int]:
    """For each index, how many blocks up to and including it are all found."""
    runs, run = [], 0
    for b in blocks:
        run = run + 1 if b is not None else 0
        runs.append(run)
    return runs
