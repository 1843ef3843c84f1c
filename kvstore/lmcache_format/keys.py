"""LMCache 0.5.6 cache keys (`lmcache/utils.py` CacheEngineKey / LayerCacheEngineKey) as strings.

    CacheEngineKey       model@world_size@worker_id@chunk_hash_hex@dtype[@tag%value...]
    LayerCacheEngineKey  model@world_size@worker_id@chunk_hash_hex@dtype@layer_id[@tag%value...]

`chunk_hash_hex` is `f"{chunk_hash:x}"` (a negative hash keeps its sign: "-1f"); dtype is
LMCache's key spelling ("half", "bfloat16", "float", ...); tags come from request configs named
`lmcache.tag.<name>`, in their order. `to_string` gives LMCache's exact string; `from_string`
accepts only canonical strings (so `from_string(s).to_string() == s`) and raises ValueError
saying which field is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

from kvstore.lmcache_format.dtypes import KEY_DTYPE_STRINGS, KEY_STRING_DTYPES, dtype_name

TAG_CONFIG_PREFIX = "lmcache.tag."
_DECIMAL = re.compile(r"0|-?[1-9][0-9]*")
_HEX = re.compile(r"0|-?[1-9a-f][0-9a-f]*")
_KEY_FORMAT = "model@world_size@worker_id@chunk_hash@dtype"

Tags = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CacheEngineKey:
    """Key of one chunk of KV (all layers). `dtype` is a canonical name ("bfloat16"); a
    torch.dtype or an alias ("half") is accepted and normalized."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    tags: Tags = ()

    def __post_init__(self) -> None:
        if not self.model_name or "@" in self.model_name:
            raise ValueError(f"model_name {self.model_name!r} must be non-empty and free of '@'")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.worker_id < 0:
            raise ValueError(f"worker_id must be >= 0, got {self.worker_id}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "tags", _check_tags(self.tags))

    @property
    def chunk_hash_hex(self) -> str:
        return f"{self.chunk_hash:x}"

    @property
    def dtype_string(self) -> str:
        """LMCache's key spelling of the dtype ("half" for float16)."""
        return KEY_DTYPE_STRINGS[self.dtype]

    def to_string(self) -> str:
        return "@".join([*self._base_fields(), *_tag_fields(self.tags)])

    @classmethod
    def from_string(cls, s: str) -> Self:
        parts = s.split("@")
        if len(parts) < 5:
            raise ValueError(f"malformed CacheEngineKey {s!r}: expected {_KEY_FORMAT}[@tag%value...], "
                             f"got {len(parts)} '@'-separated fields")
        try:
            return cls(*_parse_base(parts), tags=_parse_tags(parts[5:]))
        except ValueError as exc:
            raise ValueError(f"malformed CacheEngineKey {s!r}: {exc}") from None

    def layer(self, layer_id: int) -> LayerCacheEngineKey:
        return LayerCacheEngineKey(self.model_name, self.world_size, self.worker_id, self.chunk_hash,
                                   self.dtype, self.tags, layer_id)

    def split_layers(self, num_layers: int) -> list[LayerCacheEngineKey]:
        """One key per layer, as LMCache's `split_layers`."""
        return [self.layer(i) for i in range(num_layers)]

    def _base_fields(self) -> list[str]:
        return [self.model_name, str(self.world_size), str(self.worker_id), self.chunk_hash_hex,
                self.dtype_string]


@dataclass(frozen=True)
class LayerCacheEngineKey(CacheEngineKey):
    """Key of one layer of one chunk (LMCache's layerwise mode)."""

    layer_id: int = 0

    def __post_init__(self) -> None:
        CacheEngineKey.__post_init__(self)
        if self.layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {self.layer_id}")

    def to_string(self) -> str:
        return "@".join([*self._base_fields(), str(self.layer_id), *_tag_fields(self.tags)])

    @classmethod
    def from_string(cls, s: str) -> Self:
        parts = s.split("@")
        if len(parts) < 6:
            raise ValueError(f"malformed LayerCacheEngineKey {s!r}: expected {_KEY_FORMAT}@layer_id"
                             f"[@tag%value...], got {len(parts)} '@'-separated fields")
        try:
            layer_id = _parse_decimal("layer_id", parts[5])
            return cls(*_parse_base(parts), tags=_parse_tags(parts[6:]), layer_id=layer_id)
        except ValueError as exc:
            raise ValueError(f"malformed LayerCacheEngineKey {s!r}: {exc}") from None

    def chunk_key(self) -> CacheEngineKey:
        """The all-layers key of the same chunk."""
        return CacheEngineKey(self.model_name, self.world_size, self.worker_id, self.chunk_hash,
                              self.dtype, self.tags)


def parse_key(s: str) -> CacheEngineKey:
    """Either key kind, decided as LMCache's `parse_cache_key` does: a decimal 6th field is a
    layer id."""
    parts = s.split("@")
    if len(parts) >= 6 and parts[5].isascii() and parts[5].isdigit():
        return LayerCacheEngineKey.from_string(s)
    return CacheEngineKey.from_string(s)


def tags_from_request_configs(configs: Mapping[str, object] | None) -> Tags:
    """The tags LMCache derives from request configs: entries named `lmcache.tag.<name>`."""
    if not configs:
        return ()
    return tuple((k[len(TAG_CONFIG_PREFIX):], str(v)) for k, v in configs.items()
                 if k.startswith(TAG_CONFIG_PREFIX))


def _check_tags(tags: Sequence[Sequence[str]]) -> Tags:
    result = []
    for tag in tags:
        name, value = tag
        if "@" in name or "%" in name or "@" in value:
            raise ValueError(f"tag {name!r}={value!r}: names may not hold '@' or '%', values not '@'")
        result.append((str(name), str(value)))
    return tuple(result)


def _tag_fields(tags: Tags) -> list[str]:
    return [f"{name}%{value}" for name, value in tags]


def _parse_base(parts: list[str]) -> tuple[str, int, int, int, str]:
    if parts[4] not in KEY_STRING_DTYPES:
        raise ValueError(f"dtype {parts[4]!r} is not an LMCache dtype string "
                         f"(known: {', '.join(KEY_STRING_DTYPES)})")
    world_size = _parse_decimal("world_size", parts[1])
    worker_id = _parse_decimal("worker_id", parts[2])
    if not _HEX.fullmatch(parts[3]):
        raise ValueError(f"chunk_hash {parts[3]!r} is not lowercase hex")
    return parts[0], world_size, worker_id, int(parts[3], 16), KEY_STRING_DTYPES[parts[4]]


def _parse_decimal(field: str, text: str) -> int:
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"{field} {text!r} is not a decimal integer")
    return int(text)


def _parse_tags(fields: list[str]) -> Tags:
    tags = []
    for field in fields:
        name, sep, value = field.partition("%")
        if not sep:
            raise ValueError(f"tag {field!r} has no '%' (expected name%value)")
        tags.append((name, value))
    return tuple(tags)
