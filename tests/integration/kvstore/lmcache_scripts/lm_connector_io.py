"""Runs in the LMCache 0.5.6 venv: drives LMCache's own `lm://` connector (`CreateConnector`,
i.e. `LMCServerConnector`, with a CPU `LocalCPUBackend`) against a server, for the compat tests.

    python lm_connector_io.py lm://127.0.0.1:PORT WORKDIR < plan.json > result.json

plan: {"put": [{"key": K, "fmt": "KV_2LTD", "dtype": "float32", "shape": [...], "seed": N}],
       "get": [K, ...], "exists": [K, ...]}
Puts go first (each a seeded random tensor, its bytes also written to WORKDIR/put-N.bin), then
exists, then gets (bytes written to WORKDIR/get-N.bin). Result: {"put": [{"key", "file"}],
"exists": {K: bool}, "get": {K: null | {"file", "fmt", "dtype", "shape"}}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from pathlib import Path

import torch
from lmcache.utils import parse_cache_key
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

TIMEOUT_S = 30


def main() -> None:
    logging.disable(logging.WARNING)
    url, workdir = sys.argv[1], Path(sys.argv[2])
    plan = json.load(sys.stdin)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=False, max_local_cpu_size=0.1,
                                               remote_url=url)
    metadata = LMCacheMetadata(model_name="compat", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float32, kv_shape=(2, 2, 16, 2, 8))
    cpu = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
    connector = CreateConnector(url, loop, cpu, config, metadata)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(TIMEOUT_S)

    result: dict = {"put": [], "exists": {}, "get": {}}
    for i, item in enumerate(plan.get("put", [])):
        shape = torch.Size(item["shape"])
        dtype = getattr(torch, item["dtype"])
        obj = cpu.allocate(shape, dtype, MemoryFormat[item["fmt"]])
        gen = torch.Generator().manual_seed(item["seed"])
        obj.tensor.copy_(torch.randn(shape, generator=gen).to(dtype))
        path = workdir / f"put-{i}.bin"
        path.write_bytes(bytes(obj.byte_array))
        run(connector.put(parse_cache_key(item["key"]), obj))
        result["put"].append({"key": item["key"], "file": str(path)})
    for key in plan.get("exists", []):
        result["exists"][key] = bool(run(connector.exists(parse_cache_key(key))))
    for i, key in enumerate(plan.get("get", [])):
        got = run(connector.get(parse_cache_key(key)))
        if got is None:
            result["get"][key] = None
            continue
        path = workdir / f"get-{i}.bin"
        path.write_bytes(bytes(got.byte_array))
        result["get"][key] = {"file": str(path), "fmt": got.get_memory_format().name,
                              "dtype": str(got.get_dtype()).removeprefix("torch."),
                              "shape": list(got.get_shape())}
    run(connector.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
