"""LMCache 0.5.6 memory formats (`lmcache/v1/memory_management.py` MemoryFormat) and the shapes
of the KV payloads stored under each.

hidden_dim below is num_kv_heads * head_dim; a payload is the tensor's bytes, C-contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum

from kvstore.lmcache_format.dtypes import DTypeLike, item_size


class MemoryFormat(IntEnum):
    """LMCache's MemoryFormat values (its `fmt` field on the wire)."""

    UNDEFINED = 0
    KV_2LTD = 1  # [2, num_layers, num_tokens, hidden_dim]: one chunk, all layers
    KV_T2D = 2  # [num_tokens, 2, hidden_dim]: one chunk of one layer (layerwise)
    KV_2TD = 3  # [2, num_tokens, hidden_dim]
    BINARY = 4  # compressed bytes, shape [length, 0, 0, 0]
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6  # [1, num_layers, num_tokens, aligned_head_size]
    EC_TD = 7  # [num_tokens, hidden_dim]: encoder cache
    HS_TD = 8  # [num_tokens, hidden_dim]: hidden states

    def token_dim(self) -> int:
        """Axis that indexes tokens (LMCache `token_dim`)."""
        return _TOKEN_DIMS.get(self, 0)


_TOKEN_DIMS = {MemoryFormat.KV_2LTD: 2, MemoryFormat.KV_T2D: 1, MemoryFormat.KV_MLA_FMT: 2}


def kv_2ltd_shape(num_layers: int, num_tokens: int, hidden_dim: int) -> tuple[int, int, int, int]:
    return (2, num_layers, num_tokens, hidden_dim)


def kv_t2d_shape(num_tokens: int, hidden_dim: int) -> tuple[int, int, int]:
    return (num_tokens, 2, hidden_dim)


def kv_2td_shape(num_tokens: int, hidden_dim: int) -> tuple[int, int, int]:
    return (2, num_tokens, hidden_dim)


def kv_mla_shape(num_layers: int, num_tokens: int, head_size: int) -> tuple[int, int, int, int]:
    return (1, num_layers, num_tokens, head_size)


def payload_nbytes(shape: Sequence[int], dtype: DTypeLike) -> int:
    """Bytes of a C-contiguous tensor of `shape` and `dtype`."""
    return math.prod(shape) * item_size(dtype)
