"""kvstore.lmcache_format against the real lmcache==0.5.6: key strings, chunk hashes and keys, and
RemoteMetadata bytes are equal to what LMCache's own code produces, and LMCache parses ours back.

LMCache runs in its own venv (`bash kvstore/peers/install_lmcache.sh`) through
lmcache_scripts/format_oracle.py, once per module, with a PYTHONHASHSEED different from ours.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore.lmcache_format import (
    CacheEngineKey,
    MemoryFormat,
    RemoteMetadata,
    chunk_hashes,
    chunk_keys,
    chunk_spans,
    parse_key,
    payload_nbytes,
    tags_from_request_configs,
)

ROOT = Path(__file__).resolve().parents[3]
LMCACHE_PYTHON = Path(os.environ.get("LMCACHE_PEER_PYTHON", ROOT / ".peers/lmcache/bin/python"))
ORACLE = Path(__file__).parent / "lmcache_scripts" / "format_oracle.py"

pytestmark = pytest.mark.skipif(
    not LMCACHE_PYTHON.exists(),
    reason=f"LMCache peer venv missing ({LMCACHE_PYTHON}); "
           "create it with: bash kvstore/peers/install_lmcache.sh")

MODELS = ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
          "org/sub/model-v1.5_x", "/models/local/llama"]
HASHES = [0, 1, -1, 2**63 - 1, -(2**63), 0xDEADBEEF, 2**64 - 1, hash((0, (1, 2, 3), ()))]
KEY_DTYPES = ["bfloat16", "float16", "float32", "uint8", "float64", "int8", "int64", "bool", "float8_e4m3fn"]
WORLD = [(1, 0), (2, 1), (8, 7), (4, 0)]
LAYERS = [None, 0, 29, 127, None]
TAG_CONFIGS = [None, {"lmcache.tag.user": "alice", "other.setting": 5, "lmcache.tag.tier": "gold%1"}]


def _key_cases() -> list[dict[str, Any]]:
    cases = []
    for i, (model, h) in enumerate(itertools.product(MODELS, HASHES)):
        world_size, worker_id = WORLD[i % len(WORLD)]
        cases.append({"model": model, "world_size": world_size, "worker_id": worker_id, "hash": h,
                      "dtype": KEY_DTYPES[i % len(KEY_DTYPES)], "layer_id": LAYERS[i % len(LAYERS)],
                      "request_configs": TAG_CONFIGS[(i // 3) % len(TAG_CONFIGS)]})
    return cases


def _chunk_cases() -> list[dict[str, Any]]:
    rng = random.Random(4)
    cases = []
    for n in (0, 1, 255, 256, 257, 1000):
        cases.append({"tokens": [rng.randrange(49152) for _ in range(n)], "chunk_size": 256,
                      "save_unfull_chunk": True})
    big = [2**31 - 1, 151_000, 0, 7] * 100
    longest = cases[-1]["tokens"]
    cases += [{"tokens": longest, "chunk_size": 256, "save_unfull_chunk": False},
              {"tokens": longest, "chunk_size": 256, "save_unfull_chunk": True, "as_tensor": True},
              {"tokens": big, "chunk_size": 16, "save_unfull_chunk": True}]
    return cases


def _chunk_key_cases() -> list[dict[str, Any]]:
    rng = random.Random(5)
    tokens = [rng.randrange(49152) for _ in range(600)]
    return [{"tokens": tokens, "chunk_size": 256, "save_unfull_chunk": True, "model": MODELS[1],
             "world_size": 2, "worker_id": 1, "dtype": "bfloat16"},
            {"tokens": tokens[:100], "chunk_size": 16, "save_unfull_chunk": False, "model": MODELS[2],
             "world_size": 1, "worker_id": 0, "dtype": "float16"}]


def _meta(shapes: list[list[int]], dtypes: list[str | None], fmt: MemoryFormat,
          length: int | None = None, expect_shapes: list[list[int]] | None = None) -> dict[str, Any]:
    if length is None:
        length = sum(payload_nbytes(s, d) for s, d in zip(shapes, dtypes, strict=True) if d is not None)
    return {"length": length, "shapes": shapes, "dtypes": dtypes, "fmt": int(fmt),
            "expect_shapes": expect_shapes or shapes}


METADATA_CASES = [
    _meta([[2, 30, 256, 192]], ["bfloat16"], MemoryFormat.KV_2LTD),
    _meta([[256, 2, 192]], ["float16"], MemoryFormat.KV_T2D),
    _meta([[2, 2, 17, 64]], ["float32"], MemoryFormat.KV_2LTD),
    _meta([[2, 16, 128]], ["uint8"], MemoryFormat.KV_2TD),
    _meta([[3, 2, 8]], ["float64"], MemoryFormat.KV_T2D),
    _meta([[1, 30, 256, 576]], ["float8_e4m3fn"], MemoryFormat.KV_MLA_FMT),
    _meta([[2, 4, 16, 64], [2, 2, 16, 32]], ["bfloat16", "float32"], MemoryFormat.KV_2LTD),
    _meta([[1234]], ["uint8"], MemoryFormat.BINARY, 1234, expect_shapes=[[1234, 0, 0, 0]]),
    _meta([[4096, 0, 0, 0]], [None], MemoryFormat.BINARY_BUFFER, 4096),
]

REQUEST: dict[str, list[Any]] = {
    "keys": _key_cases(), "chunk_hashes": _chunk_cases(), "chunk_keys": _chunk_key_cases(),
    "metadata": [{k: v for k, v in c.items() if k != "expect_shapes"} for c in METADATA_CASES],
}


def _our_key(case: dict[str, Any]) -> CacheEngineKey:
    key = CacheEngineKey(case["model"], case["world_size"], case["worker_id"], case["hash"], case["dtype"],
                         tags_from_request_configs(case["request_configs"]))
    return key if case["layer_id"] is None else key.layer(case["layer_id"])


def _our_metadata(case: dict[str, Any]) -> RemoteMetadata:
    return RemoteMetadata(case["length"], case["shapes"], case["dtypes"], MemoryFormat(case["fmt"]))


def _run_oracle(request: dict[str, list[Any]], tmp: Path) -> dict[str, list[Any]]:
    (tmp / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "PYTHONHASHSEED": "2024" if os.environ.get("PYTHONHASHSEED") != "2024" else "7"}
    cmd = [str(LMCACHE_PYTHON), str(ORACLE), str(tmp / "request.json"), str(tmp / "answer.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp)
    assert proc.returncode == 0, f"LMCache oracle failed:\n{proc.stderr[-4000:]}"
    answer: dict[str, list[Any]] = json.loads((tmp / "answer.json").read_text())
    return answer


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """LMCache's answers to REQUEST plus its parse of our keys and metadata bytes."""
    ours = {"parse_keys": [_our_key(c).to_string() for c in REQUEST["keys"]],
            "parse_metadata": [_our_metadata(c).pack().hex() for c in METADATA_CASES]}
    return _run_oracle({**REQUEST, **ours}, tmp_path_factory.mktemp("lmcache_oracle"))


@pytest.mark.parametrize("i", range(len(REQUEST["keys"])))
def test_key_string_equals_lmcache(lmcache: dict[str, list[Any]], i: int) -> None:
    case = REQUEST["keys"][i]
    ours = _our_key(case)
    assert ours.to_string() == lmcache["keys"][i]
    assert parse_key(lmcache["keys"][i]) == ours


@pytest.mark.parametrize("i", range(len(REQUEST["keys"])))
def test_lmcache_parses_our_key(lmcache: dict[str, list[Any]], i: int) -> None:
    case = REQUEST["keys"][i]
    parsed = lmcache["parse_keys"][i]
    expected_type = "CacheEngineKey" if case["layer_id"] is None else "LayerCacheEngineKey"
    assert (parsed["type"], parsed["model"], parsed["world_size"], parsed["worker_id"], parsed["hash"],
            parsed["dtype"], parsed["layer_id"]) == (expected_type, case["model"], case["world_size"],
                                                     case["worker_id"], case["hash"], case["dtype"],
                                                     case["layer_id"])
    assert [tuple(t) for t in parsed["tags"]] == list(tags_from_request_configs(case["request_configs"]))


@pytest.mark.parametrize("i", range(len(REQUEST["chunk_hashes"])))
def test_chunk_hashes_equal_lmcache(lmcache: dict[str, list[Any]], i: int) -> None:
    case = REQUEST["chunk_hashes"][i]
    theirs = lmcache["chunk_hashes"][i]
    ours = chunk_hashes(case["tokens"], case["chunk_size"], save_unfull_chunk=case["save_unfull_chunk"])
    assert ours == [h for _, _, h in theirs]
    spans = chunk_spans(len(case["tokens"]), case["chunk_size"], case["save_unfull_chunk"])
    assert spans == [(start, end) for start, end, _ in theirs]


@pytest.mark.parametrize("i", range(len(REQUEST["chunk_keys"])))
def test_chunk_keys_equal_lmcache(lmcache: dict[str, list[Any]], i: int) -> None:
    case = REQUEST["chunk_keys"][i]
    ours = chunk_keys(case["tokens"], case["model"], case["world_size"], case["worker_id"], case["dtype"],
                      case["chunk_size"], save_unfull_chunk=case["save_unfull_chunk"])
    assert [k.to_string() for k in ours] == lmcache["chunk_keys"][i]
    assert len(ours) > 1


@pytest.mark.parametrize("i", range(len(METADATA_CASES)))
def test_remote_metadata_bytes_equal_lmcache(lmcache: dict[str, list[Any]], i: int) -> None:
    ours = _our_metadata(METADATA_CASES[i])
    theirs = bytes.fromhex(lmcache["metadata"][i])
    assert ours.pack() == theirs
    assert RemoteMetadata.unpack(theirs).pack() == theirs


@pytest.mark.parametrize("i", range(len(METADATA_CASES)))
def test_lmcache_parses_our_metadata(lmcache: dict[str, list[Any]], i: int) -> None:
    case = METADATA_CASES[i]
    parsed = lmcache["parse_metadata"][i]
    assert parsed == {"length": case["length"], "shapes": case["expect_shapes"], "dtypes": case["dtypes"],
                      "fmt": case["fmt"]}
