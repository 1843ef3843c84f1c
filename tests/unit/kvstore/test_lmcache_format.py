"""kvstore.lmcache_format without LMCache: key strings and their errors, the chunk hash chain,
RemoteMetadata packing, and zero-copy tensor <-> Buffer views. Byte equality with the real
package is proven in tests/integration/kvstore/test_lmcache_format_compat.py."""

from __future__ import annotations

import gc
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kvstore.lmcache_format import (
    CacheEngineKey,
    LayerCacheEngineKey,
    MemoryFormat,
    RemoteMetadata,
    chunk_hashes,
    chunk_keys,
    kv_2ltd_shape,
    kv_t2d_shape,
    metadata_nbytes,
    parse_key,
    payload_nbytes,
    tags_from_request_configs,
)

ROOT = Path(__file__).resolve().parents[3]

# ---- keys ----


def test_key_string_is_model_world_worker_hexhash_lmcache_dtype() -> None:
    assert CacheEngineKey("org/m", 2, 1, 255, "float16").to_string() == "org/m@2@1@ff@half"
    assert CacheEngineKey("m", 1, 0, -31, "float32").to_string() == "m@1@0@-1f@float"


def test_layer_key_puts_layer_id_before_tags() -> None:
    key = LayerCacheEngineKey("m", 1, 0, 16, "bfloat16", (("user", "a"),), layer_id=3)
    assert key.to_string() == "m@1@0@10@bfloat16@3@user%a"


@pytest.mark.parametrize("key", [
    CacheEngineKey("HuggingFaceTB/SmolLM2-135M-Instruct", 1, 0, 0, "bfloat16"),
    CacheEngineKey("m", 8, 7, -(2**63), "uint8", (("tier", "gold%1"), ("empty", ""))),
    CacheEngineKey("/models/x", 4, 2, 2**64 - 1, "float8_e4m3fn"),
    LayerCacheEngineKey("a/b/c", 2, 1, 12345, "float16", layer_id=29),
    LayerCacheEngineKey("m", 2, 1, -5, "float64", (("k", "v"),), layer_id=0),
])
def test_key_round_trips_through_its_string(key: CacheEngineKey) -> None:
    s = key.to_string()
    assert type(key).from_string(s) == key
    assert parse_key(s) == key
    assert parse_key(s).to_string() == s


def test_dtype_aliases_and_torch_dtypes_normalize_to_one_name() -> None:
    torch = pytest.importorskip("torch")
    keys = [CacheEngineKey("m", 1, 0, 1, d) for d in ("float16", "half", torch.float16, torch.half)]
    assert {k.dtype for k in keys} == {"float16"}
    assert len({k.to_string() for k in keys}) == 1


def test_layer_and_chunk_keys_convert_both_ways() -> None:
    key = CacheEngineKey("m", 2, 1, 99, "bfloat16", (("u", "x"),))
    layers = key.split_layers(3)
    assert [k.layer_id for k in layers] == [0, 1, 2]
    assert all(k.chunk_key() == key for k in layers)
    assert layers[0] != key


def test_tags_come_from_lmcache_tag_request_configs_in_order() -> None:
    configs = {"lmcache.tag.user": "alice", "other": 1, "lmcache.tag.n": 5}
    assert tags_from_request_configs(configs) == (("user", "alice"), ("n", "5"))
    assert tags_from_request_configs(None) == ()


@pytest.mark.parametrize(("kind", "s", "what"), [
    (CacheEngineKey, "m@1@0@ff", "got 4 '@'-separated fields"),
    (CacheEngineKey, "m@x@0@ff@half", "world_size 'x' is not a decimal integer"),
    (CacheEngineKey, "m@1@+1@ff@half", "worker_id '+1'"),
    (CacheEngineKey, "m@01@0@ff@half", "world_size '01'"),
    (CacheEngineKey, "m@1@0@FF@half", "chunk_hash 'FF' is not lowercase hex"),
    (CacheEngineKey, "m@1@0@0x1f@half", "chunk_hash '0x1f'"),
    (CacheEngineKey, "m@1@0@ff@float16", "dtype 'float16' is not an LMCache dtype string"),
    (CacheEngineKey, "m@1@0@ff@half@3", "tag '3' has no '%'"),
    (CacheEngineKey, "@1@0@ff@half", "model_name ''"),
    (CacheEngineKey, "m@0@0@ff@half", "world_size must be >= 1"),
    (LayerCacheEngineKey, "m@1@0@ff@half", "got 5 '@'-separated fields"),
    (LayerCacheEngineKey, "m@1@0@ff@half@x", "layer_id 'x'"),
    (LayerCacheEngineKey, "m@1@0@ff@half@-1", "layer_id must be >= 0"),
    (LayerCacheEngineKey, "m@1@0@ff@half@1@tag", "tag 'tag' has no '%'"),
])
def test_malformed_key_string_raises_value_error_naming_the_field(
        kind: type[CacheEngineKey], s: str, what: str) -> None:
    with pytest.raises(ValueError, match="malformed") as info:
        kind.from_string(s)
    assert what in str(info.value)


def test_key_fields_that_cannot_round_trip_are_rejected() -> None:
    with pytest.raises(ValueError, match="'@'"):
        CacheEngineKey("a@b", 1, 0, 1, "half")
    with pytest.raises(ValueError, match="tag"):
        CacheEngineKey("m", 1, 0, 1, "half", (("a@", "b"),))
    with pytest.raises(ValueError, match="unsupported dtype"):
        CacheEngineKey("m", 1, 0, 1, "complex64")


# ---- chunk hashes ----


def test_chunk_hashes_chain_builtin_hash_over_the_prefix() -> None:
    tokens = list(range(1000, 1600))
    h1 = hash((0, tuple(tokens[:256]), ()))
    h2 = hash((h1, tuple(tokens[256:512]), ()))
    h3 = hash((h2, tuple(tokens[512:]), ()))
    assert chunk_hashes(tokens) == [h1, h2, h3]


@pytest.mark.parametrize(("n", "full", "unfull"), [(0, 0, 0), (1, 0, 1), (255, 0, 1), (256, 1, 1),
                                                   (257, 1, 2), (1000, 3, 4)])
def test_chunk_count_depends_on_save_unfull_chunk(n: int, full: int, unfull: int) -> None:
    tokens = [7] * n
    assert len(chunk_hashes(tokens, save_unfull_chunk=False)) == full
    assert len(chunk_hashes(tokens)) == unfull


def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes() -> None:
    tokens = list(range(700))
    assert chunk_hashes(tokens[:512]) == chunk_hashes(tokens)[:2]
    assert chunk_hashes(tokens[:300])[1] != chunk_hashes(tokens)[1]


def test_list_numpy_and_tensor_tokens_hash_alike() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    tokens = list(range(40_000, 40_600))
    expected = chunk_hashes(tokens, 128)
    assert chunk_hashes(np.array(tokens, dtype=np.int64), 128) == expected
    assert chunk_hashes(torch.tensor(tokens), 128) == expected
    assert chunk_hashes(tuple(tokens), 128) == expected


def test_non_integer_tokens_are_rejected() -> None:
    with pytest.raises(TypeError):
        chunk_hashes([1.0, 2.0])


def test_hashes_do_not_depend_on_pythonhashseed() -> None:
    code = "from kvstore.lmcache_format import chunk_hashes; print(chunk_hashes(list(range(600)), 100))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           timeout=60, cwd=ROOT, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
            for seed in ("0", "1", "random")}
    assert outs == {f"{chunk_hashes(list(range(600)), 100)}\n"}


def test_bytes_hash_function_folds_to_first_8_bytes_big_endian() -> None:
    def sha(obj: object) -> bytes:
        return hashlib.sha256(repr(obj).encode()).digest()

    first = sha((0, (1, 2, 3), ()))
    assert chunk_hashes([1, 2, 3], hash_func=sha) == [int.from_bytes(first[:8], "big")]


def test_chunk_keys_wrap_chunk_hashes() -> None:
    tokens = list(range(300))
    keys = chunk_keys(tokens, "org/m", 2, 1, "bfloat16")
    assert [k.chunk_hash for k in keys] == chunk_hashes(tokens)
    assert keys[0].to_string() == f"org/m@2@1@{chunk_hashes(tokens)[0]:x}@bfloat16"


# ---- RemoteMetadata ----


def test_metadata_packs_int32_length_fmt_then_dtype_code_and_four_dims() -> None:
    meta = RemoteMetadata.single((2, 30, 256, 192), "bfloat16", MemoryFormat.KV_2LTD)
    assert meta.length == 2 * 30 * 256 * 192 * 2
    assert meta.pack() == struct.pack("<7i", meta.length, 1, 3, 2, 30, 256, 192)
    assert len(meta.pack()) == metadata_nbytes(1) == 28


def test_short_shapes_are_padded_with_zeros_and_stripped_back() -> None:
    meta = RemoteMetadata(12, ((256, 2, 192),), ("float16",), MemoryFormat.KV_T2D)
    assert meta.pack() == struct.pack("<7i", 12, 2, 2, 256, 2, 192, 0)
    assert RemoteMetadata.unpack(meta.pack()) == meta


def test_binary_formats_keep_their_zero_dims() -> None:
    packed = RemoteMetadata(1234, ((1234,),), ("uint8",), MemoryFormat.BINARY).pack()
    assert RemoteMetadata.unpack(packed).shapes == ((1234, 0, 0, 0),)


def test_several_groups_round_trip_from_any_buffer_type() -> None:
    meta = RemoteMetadata(100, ((2, 4, 16, 64), (2, 2, 16, 32)), ("bfloat16", None), MemoryFormat.KV_2LTD)
    packed = meta.pack()
    assert len(packed) == 48
    for data in (packed, memoryview(packed), pa.py_buffer(packed), bytearray(packed)):
        assert RemoteMetadata.unpack(data) == meta
    assert RemoteMetadata.unpack(packed, num_groups=2) == meta
    into = bytearray(60)
    meta.pack_into(into, 12)
    assert bytes(into[12:]) == packed


@pytest.mark.parametrize("size", [0, 4, 27, 29, 47, 100])
def test_metadata_of_wrong_length_raises_value_error(size: int) -> None:
    with pytest.raises(ValueError, match=f"got {size}"):
        RemoteMetadata.unpack(bytes(size))


def test_metadata_group_count_is_checked_when_given() -> None:
    packed = RemoteMetadata(4, ((1,),), ("float32",), MemoryFormat.KV_2LTD).pack()
    with pytest.raises(ValueError, match="2 group"):
        RemoteMetadata.unpack(packed, num_groups=2)


def test_unknown_format_and_dtype_codes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="MemoryFormat 99"):
        RemoteMetadata.unpack(struct.pack("<7i", 4, 99, 4, 1, 0, 0, 0))
    with pytest.raises(ValueError, match="dtype code 42"):
        RemoteMetadata.unpack(struct.pack("<7i", 4, 1, 42, 1, 0, 0, 0))
    with pytest.raises(ValueError, match="non-negative"):
        RemoteMetadata.unpack(struct.pack("<7i", -4, 1, 4, 1, 0, 0, 0))


def test_float16_is_written_as_code_2_and_code_1_reads_as_float16() -> None:
    assert RemoteMetadata(2, ((1,),), ("half",), MemoryFormat.KV_T2D).pack()[8:12] == struct.pack("<i", 2)
    assert RemoteMetadata.unpack(struct.pack("<7i", 2, 2, 1, 1, 0, 0, 0)).dtypes == ("float16",)


@pytest.mark.parametrize(("shapes", "dtypes", "length", "what"), [
    (((1, 2, 3, 4, 5),), ("float32",), 0, "1..4 dims"),
    (((1,),), ("int32",), 4, "no LMCache RemoteMetadata code"),
    (((2**31,),), ("uint8",), 0, "int32"),
    (((1,),), ("uint8", "uint8"), 1, "one dtype per shape"),
    ((), (), 0, "at least one group"),
])
def test_metadata_that_lmcache_cannot_encode_is_rejected(
        shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...], length: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        RemoteMetadata(length, shapes, dtypes, MemoryFormat.KV_2LTD)


# ---- layouts and zero-copy buffers ----


def test_layout_shapes_and_sizes() -> None:
    assert kv_2ltd_shape(30, 256, 192) == (2, 30, 256, 192)
    assert kv_t2d_shape(256, 192) == (256, 2, 192)
    assert payload_nbytes(kv_2ltd_shape(30, 256, 192), "bfloat16") == 2 * 30 * 256 * 192 * 2
    assert [MemoryFormat.KV_2LTD, MemoryFormat.KV_T2D, MemoryFormat.BINARY] == [1, 2, 4]
    assert MemoryFormat.KV_2LTD.token_dim() == 2 and MemoryFormat.KV_T2D.token_dim() == 1


def test_tensor_to_buffer_shares_memory_and_sees_writes() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import tensor_to_buffer

    t = torch.zeros(kv_t2d_shape(16, 8), dtype=torch.float32)
    buf = tensor_to_buffer(t)
    assert buf.address == t.data_ptr() and buf.size == t.numel() * 4
    t[0, 0, 0] = 42.0
    assert struct.unpack_from("<f", buf, 0) == (42.0,)


def test_buffer_keeps_its_tensor_alive() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import tensor_to_buffer

    buf = tensor_to_buffer(torch.arange(1 << 16, dtype=torch.int32))
    gc.collect()
    _churn = [torch.full((1 << 16,), -1, dtype=torch.int32) for _ in range(8)]
    assert bytes(buf) == torch.arange(1 << 16, dtype=torch.int32).numpy().tobytes()


def test_buffer_to_tensor_shares_memory() -> None:
    pytest.importorskip("torch")
    from kvstore.lmcache_format import buffer_to_tensor

    data = bytearray(struct.pack("<4f", 1, 2, 3, 4))
    t = buffer_to_tensor(data, "float32", (2, 2))
    data[0:4] = struct.pack("<f", 9.0)
    assert t.tolist() == [[9.0, 2.0], [3.0, 4.0]]
    buf = pa.py_buffer(bytes(data))
    assert buffer_to_tensor(buf, "float32", (4,)).data_ptr() == buf.address


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8", "float8_e4m3fn"])
def test_tensor_buffer_tensor_round_trip_is_bitwise(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import buffer_to_tensor, tensor_to_buffer, torch_dtype

    t = (torch.randn(kv_2ltd_shape(2, 5, 12), generator=torch.Generator().manual_seed(0)) * 50)
    t = t.to(torch_dtype(dtype))
    back = buffer_to_tensor(tensor_to_buffer(t), dtype, t.shape)
    assert back.dtype == t.dtype and back.shape == t.shape and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_bfloat16_reaches_numpy_as_uint16_words() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import buffer_to_numpy, numpy_to_buffer, tensor_to_buffer

    t = torch.randn(3, 4).to(torch.bfloat16)
    words = buffer_to_numpy(tensor_to_buffer(t), "bfloat16", (3, 4))
    assert str(words.dtype) == "uint16"
    assert words.tobytes() == t.view(torch.int16).numpy().tobytes()
    assert numpy_to_buffer(words).address == t.data_ptr()


def test_payload_after_a_header_is_viewed_at_an_offset() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import buffer_to_tensor

    meta = RemoteMetadata.single((2, 3), "float32", MemoryFormat.KV_2TD)
    blob = pa.py_buffer(meta.pack() + struct.pack("<6f", *range(6)))
    t = buffer_to_tensor(blob, "float32", meta.shapes[0], offset=meta.nbytes)
    assert t.data_ptr() == blob.address + 28
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).view(2, 3))


def test_buffer_helpers_reject_what_they_cannot_view() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.lmcache_format import buffer_to_tensor, tensor_to_buffer

    with pytest.raises(ValueError, match="contiguous"):
        tensor_to_buffer(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="needs 64 bytes"):
        buffer_to_tensor(bytes(60), "float32", (4, 4))
    assert buffer_to_tensor(b"", "bfloat16", (0, 8)).shape == (0, 8)
    assert tensor_to_buffer(torch.zeros(0, 8)).size == 0


def test_package_imports_and_works_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvstore.lmcache_format as f\n"
            "k = f.CacheEngineKey('m', 1, 0, f.chunk_hashes(list(range(300)))[1], 'bfloat16')\n"
            "assert f.parse_key(k.layer(2).to_string()).layer_id == 2\n"
            "m = f.RemoteMetadata.single(f.kv_t2d_shape(4, 8), 'bfloat16', f.MemoryFormat.KV_T2D)\n"
            "assert f.RemoteMetadata.unpack(m.pack()) == m\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout == "ok\n", out.stderr
