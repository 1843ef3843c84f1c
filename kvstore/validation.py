"""Checks the server applies to objects before storing them: LMCache key strings, and LMCache
`RemoteMetadata` headers whose payload length matches the bytes that came with them, and
checksums of a bounded length (the store keeps them without interpreting them)."""

from __future__ import annotations

from kvstore.backend import InvalidRequestError

MAX_KEY_LENGTH = 4096
MAX_CHECKSUM_BYTES = 64  # kvstore/integrity.py writes 32


def check_key(key: str) -> None:
    """Raises InvalidRequestError unless `key` is a CacheEngineKey or LayerCacheEngineKey string."""
    from kvstore.lmcache_format import CacheEngineKey, LayerCacheEngineKey

    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidRequestError(f"key must be 1..{MAX_KEY_LENGTH} characters, got {len(key)}")
    errors = []
    for parser in (CacheEngineKey.from_string, LayerCacheEngineKey.from_string):
        try:
            parser(key)
            return
        except ValueError as exc:
            errors.append(str(exc))
    raise InvalidRequestError(f"malformed key {key[:200]!r}: not an LMCache CacheEngineKey "
                              f"(model@world_size@worker_id@hash@dtype[@layer]): {errors[0]}")


def check_metadata(key: str, metadata: bytes, payload_size: int) -> None:
    """Raises InvalidRequestError unless `metadata` is a RemoteMetadata of `payload_size` bytes."""
    from kvstore.lmcache_format import RemoteMetadata

    try:
        meta = RemoteMetadata.unpack(metadata)
    except ValueError as exc:
        raise InvalidRequestError(f"put {key[:200]!r}: bad metadata: {exc}") from exc
    if meta.length != payload_size:
        raise InvalidRequestError(f"put {key[:200]!r}: metadata says {meta.length} payload bytes, "
                                  f"{payload_size} arrived")


def check_checksum(key: str, checksum: bytes) -> None:
    """Raises InvalidRequestError when `checksum` is longer than MAX_CHECKSUM_BYTES."""
    if len(checksum) > MAX_CHECKSUM_BYTES:
        raise InvalidRequestError(f"put {key[:200]!r}: checksum of {len(checksum)} bytes, at most "
                                  f"{MAX_CHECKSUM_BYTES}")
