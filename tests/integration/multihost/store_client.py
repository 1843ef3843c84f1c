"""A client of the KV store with a worker's credential: puts one object, reads it back byte for
byte, and says which path its payload took ("shm": the store's shared-memory directory was
visible here, "flight": over the network). In-process, or on another host as

    python -m tests.integration.multihost.store_client URL TOKEN_FILE CHUNK
"""

from __future__ import annotations

import sys

import numpy as np

from kvstore.client import KVStoreClient
from kvstore.lmcache_format import CacheEngineKey, MemoryFormat, RemoteMetadata


def put_and_get(url: str, token: str, chunk: int) -> str:
    key = CacheEngineKey("tiny", 1, 0, chunk, "float32").layer(0).to_string()
    payload = np.arange(4096, dtype=np.float32)  # one [16, 2, 128] KV layer
    meta = RemoteMetadata.single((16, 2, 128), "float32", MemoryFormat.KV_T2D).pack()
    with KVStoreClient(url, token=token) as client:
        client.put([(key, meta, payload)])
        (got,) = client.get([key])
        assert got is not None and bytes(got.data) == payload.tobytes()
        return "shm" if client.shm_dir() else "flight"


if __name__ == "__main__":
    url, token_file, chunk = sys.argv[1:4]
    with open(token_file) as f:
        print(put_and_get(url, f.read().strip(), int(chunk)))
