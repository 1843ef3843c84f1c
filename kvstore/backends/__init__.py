"""Storage backends of the KV store: `memory` (embedded, LRU) and `redis` (LMCache Redis layout)."""

from kvstore.backends.memory import MemoryBackend
from kvstore.backends.redis_backend import RedisBackend

__all__ = ["MemoryBackend", "RedisBackend"]
