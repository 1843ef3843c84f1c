"""LMCache 0.5.6 chunk hashes (`lmcache/v1/token_database.py` ChunkedTokenDatabase).

Tokens are cut into chunks of `chunk_size` (256 by default); the last, shorter chunk counts too
when `save_unfull_chunk` (LMCache's value without a config, and what P/D needs). Each chunk's
hash chains over the prefix:

    h_0 = NONE_HASH = 0
    h_i = hash((h_{i-1}, tuple(tokens_i), tuple(extra_keys)))

with Python's builtin `hash` (LMCache's "builtin" algorithm, used whenever vLLM is absent). The
hash of a tuple of ints does not depend on PYTHONHASHSEED, so any CPython 3.11 process on a
64-bit host computes the same values. A hash function returning bytes (vLLM's sha256_cbor) is
folded to an int from its first 8 bytes, big-endian, as LMCache does.

A salted prompt (vLLM's `cache_salt`, pdserve's tenant isolation) starts its chain from
`salt_prefix_hash(salt)` instead of NONE_HASH, so its chunk keys share nothing with unsalted
prompts or other salts; an unsalted prompt keeps LMCache's exact keys.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.lmcache_format.dtypes import DTypeLike, dtype_name
from kvstore.lmcache_format.keys import CacheEngineKey, Tags

NONE_HASH = 0
DEFAULT_CHUNK_SIZE = 256

HashFunc = Callable[[Any], "int | bytes"]


def hash_chunk(tokens: Iterable[int], prefix_hash: int = NONE_HASH, extra_keys: Sequence[Any] = (),
               hash_func: HashFunc = hash) -> int:
    """Hash of one chunk given the previous chunk's hash (LMCache `_hash_tokens`)."""
    value = hash_func((prefix_hash, tuple(map(operator.index, tokens)), tuple(extra_keys)))
    if isinstance(value, bytes):
        return int.from_bytes(value[:8], "big")
    return value


def salt_prefix_hash(cache_salt: str) -> int:
    """The chain's h_0 for a salted prompt: the first 8 bytes of
    SHA-256("pdserve.cache_salt.v1\\0" || salt), as a signed 64-bit int (the range of a builtin
    hash), the same in every process."""
    digest = hashlib.sha256(b"pdserve.cache_salt.v1\0" + cache_salt.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def chunk_spans(num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                save_unfull_chunk: bool = True) -> list[tuple[int, int]]:
    """[start, end) token ranges of the chunks LMCache hashes."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    end = num_tokens if save_unfull_chunk else num_tokens - num_tokens % chunk_size
    return [(start, min(start + chunk_size, num_tokens)) for start in range(0, end, chunk_size)]


def chunk_hashes(tokens: Sequence[int] | Any, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                 save_unfull_chunk: bool = True, prefix_hash: int = NONE_HASH,
                 hash_func: HashFunc = hash) -> list[int]:
    """Prefix hashes of every chunk of `tokens` (a list, a numpy array or a 1-D tensor), as
    LMCache's `process_tokens(tokens, make_key=False)` yields them."""
    token_list = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    hashes = []
    h = prefix_hash
    for start, end in chunk_spans(len(token_list), chunk_size, save_unfull_chunk):
        h = hash_chunk(token_list[start:end], h, (), hash_func)
        hashes.append(h)
    return hashes


def chunk_keys(tokens: Sequence[int] | Any, model_name: str, world_size: int, worker_id: int,
               dtype: DTypeLike, chunk_size: int = DEFAULT_CHUNK_SIZE, *, save_unfull_chunk: bool = True,
               tags: Tags = (), hash_func: HashFunc = hash) -> list[CacheEngineKey]:
    """The CacheEngineKey of every chunk of `tokens` (LMCache `process_tokens(tokens)`)."""
    hashes = chunk_hashes(tokens, chunk_size, save_unfull_chunk=save_unfull_chunk, hash_func=hash_func)
    return [CacheEngineKey(model_name, world_size, worker_id, h, dtype_name(dtype), tags) for h in hashes]
