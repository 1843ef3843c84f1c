"""Drives LMCache 0.5.6's own `RedisConnector` against a Redis server, or its
`RedisClusterConnector` against a Redis Cluster when URL is `redis-cluster://h:p[,h:p...]` (built
by LMCache's own `RedisClusterConnectorAdapter`); runs in the LMCache venv.

    redis_peer.py put URL KEY IN_FILE  --layers L --tokens T --heads H --head-dim D --dtype DT
    redis_peer.py get URL KEY OUT_FILE --layers L --tokens T --heads H --head-dim D --dtype DT

`put` fills a MemoryObj (KV_2LTD, [2, L, T, H*D]) allocated by a real LocalCPUBackend with the
raw tensor bytes in IN_FILE and stores it through the connector. `get` reads KEY through the
connector and writes the tensor LMCache reconstructed to OUT_FILE. Both print one JSON line:
{"found": bool, "shape": [...], "dtype": "torch.bfloat16", "fmt": "KV_2LTD"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorContext
from lmcache.v1.storage_backend.connector.redis_adapter import RedisClusterConnectorAdapter
from lmcache.v1.storage_backend.connector.redis_connector import RedisClusterConnector, RedisConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

Connector = RedisConnector | RedisClusterConnector


def build_connector(args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> Connector:
    dtype = getattr(torch, args.dtype)
    config = LMCacheEngineConfig.from_defaults(chunk_size=args.tokens, local_cpu=False,
                                               max_local_cpu_size=0.1, remote_url=args.url)
    metadata = LMCacheMetadata(model_name="pdserve-compat", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=dtype,
                               kv_shape=(args.layers, 2, args.tokens, args.heads, args.head_dim),
                               chunk_size=args.tokens)
    local_cpu = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
    adapter = RedisClusterConnectorAdapter()
    if adapter.can_parse(args.url):
        context = ConnectorContext(url=args.url, loop=loop, local_cpu_backend=local_cpu, config=config,
                                   metadata=metadata)
        connector = adapter.create_connector(context)
        assert isinstance(connector, RedisClusterConnector)
        return connector
    return RedisConnector(args.url, loop, local_cpu)


def describe(memory_obj: MemoryObj | None) -> dict[str, object]:
    if memory_obj is None:
        return {"found": False}
    tensor = memory_obj.tensor
    assert tensor is not None
    return {"found": True, "shape": list(tensor.shape), "dtype": str(tensor.dtype),
            "fmt": memory_obj.get_memory_format().name}


async def put(connector: Connector, args: argparse.Namespace) -> MemoryObj:
    dtype = getattr(torch, args.dtype)
    shape = torch.Size([2, args.layers, args.tokens, args.heads * args.head_dim])
    memory_obj = connector.local_cpu_backend.allocate([shape], [dtype], MemoryFormat.KV_2LTD)
    assert memory_obj is not None and memory_obj.tensor is not None
    raw = bytearray(Path(args.file).read_bytes())
    memory_obj.tensor.copy_(torch.frombuffer(raw, dtype=dtype).view(shape))
    await connector.put(CacheEngineKey.from_string(args.key), memory_obj)
    return memory_obj


async def get(connector: Connector, args: argparse.Namespace) -> MemoryObj | None:
    memory_obj = await connector.get(CacheEngineKey.from_string(args.key))
    if memory_obj is not None and memory_obj.tensor is not None:
        Path(args.file).write_bytes(memory_obj.tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return memory_obj


async def shut_down(connector: Connector) -> None:
    # Not connector.close(): in 0.5.6 it calls the executor's blocking shutdown() on the loop's
    # own thread and deadlocks; these are the two steps it means to take.
    await connector.pq_executor.shutdown_async(wait=False)
    if isinstance(connector, RedisClusterConnector):
        await connector.cluster.aclose()
    else:
        await connector.connection.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["put", "get"])
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("file")
    for name in ("--layers", "--tokens", "--heads", "--head-dim"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--dtype", required=True)
    args = parser.parse_args()

    loop = asyncio.new_event_loop()  # the connector's executor needs a loop running elsewhere
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    connector = build_connector(args, loop)
    try:
        job = put(connector, args) if args.command == "put" else get(connector, args)
        memory_obj = asyncio.run_coroutine_threadsafe(job, loop).result(timeout=60)
        print(json.dumps(describe(memory_obj)), flush=True)
    finally:
        asyncio.run_coroutine_threadsafe(shut_down(connector), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
