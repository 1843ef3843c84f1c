"""Where the Redis Cluster backend (kvstore/backends/redis_cluster.py) puts one object's keys.

Two layouts:
- "slot" (the default): every key of an object carries the object key as a Redis hash tag,
  `{K}metadata`, `{K}kv_bytes`, `{K}checksum`, and its protection markers `{K}pdserve:pinned`,
  `{K}pdserve:leased`. Redis hashes only the part inside the first `{...}`, so all five keys
  live in one hash slot, on one master: a put or a get is one MULTI/EXEC there, and a pin or a
  lease is state beside the object that every front-end reads.
- "lmcache": LMCache 0.5.6's `RedisClusterConnector` keys byte for byte, `K + "metadata"` and
  `K + "kv_bytes"` with no tag (plus `K + "checksum"` and the markers, which LMCache ignores).
  The keys hash to different slots, so no transaction spans an object: the payload is written
  before the metadata (LMCache's order), and a reader that finds one without the other sees a
  miss. Use it only to share objects with LMCache clients that speak to the cluster directly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

LAYOUTS = ("slot", "lmcache")
META_SUFFIX = "metadata"
DATA_SUFFIX = "kv_bytes"
CHECKSUM_SUFFIX = "checksum"
PINNED_SUFFIX = "pdserve:pinned"
LEASED_SUFFIX = "pdserve:leased"


@dataclass(frozen=True)
class ObjectKeys:
    """The Redis keys of one object."""

    meta: str
    data: str
    checksum: str
    pinned: str
    leased: str

    @property
    def payload(self) -> tuple[str, str, str]:
        """The keys that hold the object itself (not its protection)."""
        return (self.meta, self.data, self.checksum)


@dataclass(frozen=True)
class KeyLayout:
    name: str = "slot"

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"redis cluster layout must be one of {LAYOUTS}, got {self.name!r}")

    @property
    def atomic(self) -> bool:
        """True when an object's keys share one slot (so one transaction covers them)."""
        return self.name == "slot"

    def keys(self, key: str) -> ObjectKeys:
        base = hash_tagged(key) if self.atomic else key
        return ObjectKeys(base + META_SUFFIX, base + DATA_SUFFIX, base + CHECKSUM_SUFFIX,
                          base + PINNED_SUFFIX, base + LEASED_SUFFIX)

    @property
    def meta_pattern(self) -> str:
        """SCAN pattern of every object's metadata key."""
        return "*}" + META_SUFFIX if self.atomic else "*" + META_SUFFIX

    @property
    def pinned_pattern(self) -> str:
        return "*" + PINNED_SUFFIX

    @property
    def leased_pattern(self) -> str:
        return "*" + LEASED_SUFFIX


def hash_tagged(key: str) -> str:
    """`{key}`: a prefix whose hash tag is the whole key. A key holding "}" would end the tag
    early (or, leading, leave it empty, so Redis hashes each whole name); such a key is tagged
    by its digest instead, and follows it, so different keys never share a name."""
    if "}" not in key:
        return "{" + key + "}"
    return "{" + hashlib.sha256(key.encode()).hexdigest()[:32] + "}" + key
