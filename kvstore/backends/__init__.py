"""Storage backends of the KV store: `memory` (embedded, LRU), `redis` (LMCache Redis layout) and
`redis-cluster` (front-ends over a Redis Cluster)."""

from kvstore.backends.memory import MemoryBackend
from kvstore.backends.redis_backend import RedisBackend
from kvstore.backends.redis_cluster import RedisClusterBackend

__all__ = ["MemoryBackend", "RedisBackend", "RedisClusterBackend"]
