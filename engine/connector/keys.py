"""What a prompt's KV is stored under, and what binds it to the prompt's tokens (no tensors).

    scheme = KeyScheme(model_name="m", dtype="float32", chunk_size=256)
    keys = scheme.chunk_keys(token_ids, salt)        # LMCache CacheEngineKey strings, one per chunk
    digests = scheme.token_digests(token_ids, salt)  # 32 bytes per chunk, bound into its checksums

Keys: LMCache's chunk-hash chain (kvstore/lmcache_format/hashing.py), from the salt's hash when
the prompt has one, so any engine of the same model finds what another saved. That chain uses
Python's builtin hash, which is not collision-resistant: two prompts can be made to share a key.
So each chunk also has a token digest, a BLAKE3 chain over the same tokens (and salt):

    d_0 = BLAKE3("pdserve.kv.tokens.v1\\0" || salt)
    d_c = BLAKE3(d_{c-1} || tokens of chunk c as little-endian int64)

A producer binds d_c into the keyed checksum of every object of chunk c (kvstore/integrity.py);
a consumer verifies with the digest of its own tokens, so KV computed for other tokens never
verifies, whatever key it was put or found under. And a consumer loads under the keys of its own
tokens: a `kv_transfer_params.keys` that disagrees with them is refused (`check_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import numpy as np

if TYPE_CHECKING:
    from engine.config import EngineConfig

_DIGEST_DOMAIN = b"pdserve.kv.tokens.v1\0"


def store_model_name(model: str) -> str:
    """The model part of the keys: a local folder's name (the same wherever it is mounted), else
    the model id as given."""
    return Path(model).name if Path(model).exists() else model


class ForeignKeys(ValueError):
    """A transfer's keys are another engine's scheme: nothing to load here, compute the prompt."""


def key_scheme(config: EngineConfig) -> KeyScheme:
    """What an engine with `config` stores a prompt's KV under (producers and consumers alike)."""
    return KeyScheme(store_model_name(config.model), config.dtype, config.kv_chunk_size,
                     config.tensor_parallel_size)


@dataclass(frozen=True)
class KeyScheme:
    """`chunk_keys` are rank 0's keys (worker id 0) with the engine's tensor-parallel size as the
    world size; each rank's object of a chunk is under its own worker id (kv_shards.rank_key)."""

    model_name: str
    dtype: str
    chunk_size: int
    world_size: int = 1

    def chunk_keys(self, token_ids: Sequence[int], salt: str | None) -> list[str]:
        """One LMCache key per chunk of `token_ids` (the last, shorter one too)."""
        from kvstore.lmcache_format import NONE_HASH, CacheEngineKey, chunk_hashes, salt_prefix_hash

        first = salt_prefix_hash(salt) if salt is not None else NONE_HASH
        return [CacheEngineKey(self.model_name, self.world_size, 0, h, self.dtype).to_string()
                for h in chunk_hashes(token_ids, self.chunk_size, save_unfull_chunk=True,
                                      prefix_hash=first)]

    def token_digests(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """The token digest of each chunk (the module's docstring)."""
        tokens = np.asarray(token_ids, dtype="<i8")
        digest = blake3.blake3(_DIGEST_DOMAIN + (salt or "").encode()).digest()
        out = []
        for start in range(0, len(tokens), self.chunk_size):
            digest = blake3.blake3(digest + tokens[start:start + self.chunk_size].tobytes()).digest()
            out.append(digest)
        return out

    def check_keys(self, keys: Sequence[str], token_ids: Sequence[int], salt: str | None) -> None:
        """ValueError unless `keys` are the first chunk keys of `token_ids` under `salt` (a remote
        prefill's keys: those of its prompt, whose length the caller cut `token_ids` to);
        ForeignKeys when they are another engine's (another model name or dtype: a deployment
        whose producer and consumer disagree, whose KV this engine cannot use anyway)."""
        from kvstore.lmcache_format import CacheEngineKey

        if keys:
            first = CacheEngineKey.from_string(str(keys[0]))
            mine = CacheEngineKey(self.model_name, 1, 0, 0, self.dtype)
            if (first.model_name, first.dtype) != (mine.model_name, mine.dtype):
                raise ForeignKeys(f"kv_transfer_params.keys are for model {first.model_name!r} in "
                                  f"{first.dtype}, this engine stores {mine.model_name!r} in {mine.dtype}")
        # another TP size's keys (world size, worker id) name the same chunks
        own = [_rank_free(k) for k in self.chunk_keys(token_ids, salt)]
        keys = [_rank_free(str(k)) for k in keys]
        if list(keys) != own[:len(keys)]:
            bad = next(i for i, (k, o) in enumerate(zip(keys, own, strict=False)) if k != o) \
                if len(keys) <= len(own) else len(own)
            raise ValueError(f"kv_transfer_params.keys[{bad}]: not the key of the prompt's tokens "
                             f"(LMCache's chunk hash of its token ids, its cache_salt included): "
                             f"KV of another prompt")


def _rank_free(key: str) -> str:
    """A chunk key without its world size and worker id (a malformed key stays as it is)."""
    parts = key.split("@")
    return "@".join([parts[0], *parts[3:]]) if len(parts) >= 5 else key
