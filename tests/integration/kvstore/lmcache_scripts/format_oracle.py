"""Runs inside the LMCache 0.5.6 venv: answers format questions with LMCache's own code.

Usage: .peers/lmcache/bin/python format_oracle.py REQUEST.json ANSWER.json

The request holds lists of cases under "keys", "parse_keys", "chunk_hashes", "chunk_keys",
"metadata" and "parse_metadata"; the answer holds one result per case under the same names.
Dtypes travel as torch attribute names ("bfloat16"), metadata bytes as hex.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey, parse_cache_key
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info
from lmcache.v1.token_database import ChunkedTokenDatabase


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def key_string(case: dict[str, Any]) -> str:
    args = (case["model"], case["world_size"], case["worker_id"], case["hash"], _dtype(case["dtype"]),
            case.get("request_configs"))
    if case.get("layer_id") is None:
        return CacheEngineKey(*args).to_string()
    return LayerCacheEngineKey(*args, layer_id=case["layer_id"]).to_string()


def parse_key(s: str) -> dict[str, Any]:
    key = parse_cache_key(s)
    return {"type": type(key).__name__, "model": key.model_name, "world_size": key.world_size,
            "worker_id": key.worker_id, "hash": key.chunk_hash, "dtype": _dtype_name(key.dtype),
            "layer_id": getattr(key, "layer_id", None), "tags": [list(t) for t in key.tags or ()]}


def _database(case: dict[str, Any], metadata: LMCacheMetadata | None = None) -> ChunkedTokenDatabase:
    config = LMCacheEngineConfig.from_defaults(chunk_size=case["chunk_size"],
                                               save_unfull_chunk=case["save_unfull_chunk"])
    return ChunkedTokenDatabase(config, metadata)


def _tokens(case: dict[str, Any]) -> Any:
    return torch.tensor(case["tokens"], dtype=torch.long) if case.get("as_tensor") else case["tokens"]


def chunk_hashes(case: dict[str, Any]) -> list[list[int]]:
    db = _database(case)
    return [[start, end, h] for start, end, h in db.process_tokens(_tokens(case), make_key=False)]


def chunk_keys(case: dict[str, Any]) -> list[str]:
    metadata = LMCacheMetadata(model_name=case["model"], world_size=case["world_size"],
                               local_world_size=case["world_size"], worker_id=case["worker_id"],
                               local_worker_id=case["worker_id"], kv_dtype=_dtype(case["dtype"]),
                               kv_shape=(1, 2, case["chunk_size"], 1, 1), chunk_size=case["chunk_size"])
    db = _database(case, metadata)
    return [key.to_string() for _, _, key in db.process_tokens(_tokens(case))]


def metadata_bytes(case: dict[str, Any]) -> str:
    init_remote_metadata_info(len(case["shapes"]))
    meta = RemoteMetadata(case["length"], [torch.Size(s) for s in case["shapes"]],
                          [_dtype(d) for d in case["dtypes"]], MemoryFormat(case["fmt"]))
    return meta.serialize().hex()


def parse_metadata(hex_bytes: str) -> dict[str, Any]:
    data = bytes.fromhex(hex_bytes)
    init_remote_metadata_info((len(data) // 4 - 2) // 5)
    meta = RemoteMetadata.deserialize(data)
    return {"length": meta.length, "shapes": [list(s) for s in meta.shapes],
            "dtypes": [_dtype_name(d) for d in meta.dtypes], "fmt": meta.fmt.value}


HANDLERS = {"keys": key_string, "parse_keys": parse_key, "chunk_hashes": chunk_hashes,
            "chunk_keys": chunk_keys, "metadata": metadata_bytes, "parse_metadata": parse_metadata}


def main() -> None:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    answer = {name: [HANDLERS[name](case) for case in cases] for name, cases in request.items()}
    with open(sys.argv[2], "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main()
