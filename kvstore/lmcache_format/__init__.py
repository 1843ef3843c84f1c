"""Byte-exact LMCache 0.5.6 formats: cache keys, chunk hashes, the RemoteMetadata header, memory
formats and KV payload layouts, plus zero-copy tensor <-> pyarrow.Buffer views.

Does not import torch; the tensor helpers import it when called.
"""

from kvstore.lmcache_format.buffers import (
    buffer_to_numpy,
    buffer_to_tensor,
    numpy_to_buffer,
    tensor_to_buffer,
)
from kvstore.lmcache_format.dtypes import (
    CODE_DTYPES,
    DTYPE_CODES,
    KEY_DTYPE_STRINGS,
    KEY_STRING_DTYPES,
    DTypeLike,
    code_dtype,
    dtype_code,
    dtype_name,
    item_size,
    key_dtype_string,
    torch_dtype,
)
from kvstore.lmcache_format.hashing import (
    DEFAULT_CHUNK_SIZE,
    NONE_HASH,
    chunk_hashes,
    chunk_keys,
    chunk_spans,
    hash_chunk,
    salt_prefix_hash,
)
from kvstore.lmcache_format.keys import (
    CacheEngineKey,
    LayerCacheEngineKey,
    parse_key,
    tags_from_request_configs,
)
from kvstore.lmcache_format.layouts import (
    MemoryFormat,
    kv_2ltd_shape,
    kv_2td_shape,
    kv_mla_shape,
    kv_t2d_shape,
    payload_nbytes,
)
from kvstore.lmcache_format.metadata import RemoteMetadata, metadata_nbytes

__all__ = [
    "CODE_DTYPES",
    "DEFAULT_CHUNK_SIZE",
    "DTYPE_CODES",
    "KEY_DTYPE_STRINGS",
    "KEY_STRING_DTYPES",
    "NONE_HASH",
    "CacheEngineKey",
    "DTypeLike",
    "LayerCacheEngineKey",
    "MemoryFormat",
    "RemoteMetadata",
    "buffer_to_numpy",
    "buffer_to_tensor",
    "chunk_hashes",
    "chunk_keys",
    "chunk_spans",
    "code_dtype",
    "dtype_code",
    "dtype_name",
    "hash_chunk",
    "item_size",
    "key_dtype_string",
    "kv_2ltd_shape",
    "kv_2td_shape",
    "kv_mla_shape",
    "kv_t2d_shape",
    "metadata_nbytes",
    "numpy_to_buffer",
    "parse_key",
    "payload_nbytes",
    "salt_prefix_hash",
    "tags_from_request_configs",
    "tensor_to_buffer",
    "torch_dtype",
]
