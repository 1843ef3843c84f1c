"""RedisBackend and LMCache 0.5.6's own RedisConnector share objects through a real redis-server:
what our backend writes, LMCache reads back as the same tensor, and the other way round.

LMCache runs in its own venv (.peers/lmcache, made by kvstore/peers/install_lmcache.sh) through
lmcache_scripts/redis_peer.py; these tests skip when that venv is missing. Our writes carry a
header from `kvstore.lmcache_format.RemoteMetadata`; what LMCache writes is checked against the
layout in LMCache's `lmcache/v1/protocol.py`, built here with struct: native int32s
`length, fmt, dtype_code, d0, d1, d2, d3` for one group, shapes padded to 4 dims with zeros.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.backend import KVObject
from kvstore.backends import RedisBackend
from kvstore.lmcache_format import MemoryFormat, RemoteMetadata

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[3]
LMCACHE_PYTHON = Path(os.environ.get("PDSERVE_LMCACHE_PYTHON", REPO / ".peers/lmcache/bin/python"))
PEER_SCRIPT = Path(__file__).parent / "lmcache_scripts" / "redis_peer.py"

pytestmark = pytest.mark.skipif(
    not LMCACHE_PYTHON.exists(),
    reason=f"LMCache venv missing at {LMCACHE_PYTHON}: run `bash kvstore/peers/install_lmcache.sh`")

KV_2LTD = 1  # lmcache.v1.memory_management.MemoryFormat.KV_2LTD
# dtype -> (RemoteMetadata dtype code from lmcache.v1.protocol.DTYPE_TO_INT, key dtype string)
DTYPES = {"bfloat16": (3, "bfloat16"), "float16": (2, "half"), "float32": (4, "float")}
LAYERS, TOKENS, HEADS, HEAD_DIM = 2, 16, 4, 8


def kv_chunk(dtype_name: str, seed: int) -> torch.Tensor:
    """A KV_2LTD chunk: [2, layers, tokens, heads * head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, LAYERS, TOKENS, HEADS * HEAD_DIM)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(getattr(torch, dtype_name))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def lmcache_layout_metadata(tensor: torch.Tensor, dtype_code: int) -> bytes:
    return struct.pack("7i", tensor.numel() * tensor.element_size(), KV_2LTD, dtype_code,
                       *tensor.shape)


def our_metadata(tensor: torch.Tensor, dtype_name: str) -> bytes:
    return RemoteMetadata.single(tuple(tensor.shape), dtype_name, MemoryFormat.KV_2LTD).pack()


def run_peer(command: str, url: str, key: str, path: Path, dtype_name: str) -> dict[str, object]:
    args = [str(LMCACHE_PYTHON), str(PEER_SCRIPT), command, url, key, str(path), "--layers",
            str(LAYERS), "--tokens", str(TOKENS), "--heads", str(HEADS), "--head-dim", str(HEAD_DIM),
            "--dtype", dtype_name]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        pytest.fail(f"redis_peer.py {command} failed with {done.returncode}: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# One dtype each way by default (each case starts LMCache, ~5 s); the others with --runslow.
@pytest.mark.parametrize("dtype_name", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_lmcache_reads_what_our_backend_wrote(redis_url: str, tmp_path: Path, dtype_name: str) -> None:
    _, key_dtype = DTYPES[dtype_name]
    key = f"pdserve-compat@1@0@{0x5EED0001:x}@{key_dtype}"
    chunk = kv_chunk(dtype_name, seed=1)
    store = RedisBackend(redis_url)
    store.put(key, KVObject(metadata=our_metadata(chunk, dtype_name), data=raw_bytes(chunk)))
    store.close()

    out = tmp_path / "lmcache_got.bin"
    result = run_peer("get", redis_url, key, out, dtype_name)
    assert result == {"found": True, "shape": list(chunk.shape), "dtype": str(chunk.dtype),
                      "fmt": "KV_2LTD"}
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=chunk.dtype).view(chunk.shape)
    assert torch.equal(got, chunk)


@pytest.mark.parametrize("dtype_name", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_our_backend_reads_what_lmcache_wrote(redis_url: str, tmp_path: Path, dtype_name: str) -> None:
    code, key_dtype = DTYPES[dtype_name]
    key = f"pdserve-compat@1@0@{0x5EED0002:x}@{key_dtype}"
    chunk = kv_chunk(dtype_name, seed=2)
    src = tmp_path / "chunk.bin"
    src.write_bytes(raw_bytes(chunk))
    assert run_peer("put", redis_url, key, src, dtype_name)["found"] is True

    store = RedisBackend(redis_url)
    got = store.get(key)
    store.close()
    assert got is not None, "LMCache's object is not visible under its key"
    assert got.metadata == lmcache_layout_metadata(chunk, code)  # byte-identical header
    assert RemoteMetadata.unpack(got.metadata) == RemoteMetadata.single(
        tuple(chunk.shape), dtype_name, MemoryFormat.KV_2LTD)
    length, fmt, dtype_code, *dims = struct.unpack("7i", got.metadata)
    assert (length, fmt, dtype_code) == (len(got.data), KV_2LTD, code)
    rebuilt = torch.frombuffer(bytearray(bytes(got.data)), dtype=chunk.dtype).view(dims)
    assert torch.equal(rebuilt, chunk)


def test_lmcache_misses_a_key_our_backend_deleted(redis_url: str, tmp_path: Path) -> None:
    key = f"pdserve-compat@1@0@{0x5EED0003:x}@bfloat16"
    chunk = kv_chunk("bfloat16", seed=3)
    store = RedisBackend(redis_url)
    store.put(key, KVObject(metadata=our_metadata(chunk, "bfloat16"), data=raw_bytes(chunk)))
    assert store.delete([key]) == 1
    store.close()
    assert run_peer("get", redis_url, key, tmp_path / "none.bin", "bfloat16") == {"found": False}
