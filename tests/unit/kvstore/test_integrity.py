"""kvstore/integrity.py: what the checksum covers (key, metadata, payload), tampering of each
fails `verify`, the integrity key (derived from text, read from the environment or a file),
payload forms hashed alike without copies, and the store's memory backend / part assembler
keeping the checksum as given."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvstore import integrity
from kvstore.assembler import PartAssembler
from kvstore.backend import InvalidRequestError, KVObject
from kvstore.backends.memory import MemoryBackend
from kvstore.chunked import ChunkedPayload
from kvstore.validation import check_checksum

KEY = "m@1@0@abc@float32@0"
META = b"\x01\x02metadata"
PAYLOAD = np.arange(1000, dtype=np.float32)
SECRET = integrity.derive_key("correct horse battery staple")


def test_checksum_is_32_bytes_and_verifies() -> None:
    for ikey in (None, SECRET):
        digest = integrity.checksum(KEY, META, PAYLOAD, ikey)
        assert len(digest) == integrity.CHECKSUM_BYTES
        assert integrity.verify(KEY, META, PAYLOAD, digest, ikey)


@pytest.mark.parametrize("ikey", [None, SECRET], ids=["unkeyed", "keyed"])
def test_any_tampering_fails(ikey: bytes | None) -> None:
    digest = integrity.checksum(KEY, META, PAYLOAD, ikey)
    flipped = PAYLOAD.copy().view(np.uint8)
    flipped[1234] ^= 0x01
    assert not integrity.verify(KEY, META, flipped, digest, ikey)  # one payload bit
    assert not integrity.verify(KEY, META[:-1] + b"X", PAYLOAD, digest, ikey)  # metadata
    assert not integrity.verify("m@1@0@abd@float32@0", META, PAYLOAD, digest, ikey)  # copied elsewhere
    assert not integrity.verify(KEY, META, PAYLOAD[:-1], digest, ikey)  # truncated
    # the boundary between key, metadata and payload cannot be moved
    assert not integrity.verify(KEY + "\x01", META[1:], PAYLOAD, digest, ikey)
    assert not integrity.verify(KEY, META, PAYLOAD, digest[:-1] + bytes([digest[-1] ^ 1]), ikey)


def test_integrity_key_matters_and_unkeyed_checksums_are_refused_with_a_key() -> None:
    keyed = integrity.checksum(KEY, META, PAYLOAD, SECRET)
    other = integrity.derive_key("another secret")
    assert not integrity.verify(KEY, META, PAYLOAD, keyed, other)
    assert not integrity.verify(KEY, META, PAYLOAD, keyed, None)
    forged = integrity.checksum(KEY, META, PAYLOAD, None)  # what a writer without the key makes
    assert not integrity.verify(KEY, META, PAYLOAD, forged, SECRET)
    # no checksum: refused with a key (anyone may have written it), accepted without (LMCache)
    assert not integrity.verify(KEY, META, PAYLOAD, b"", SECRET)
    assert integrity.verify(KEY, META, PAYLOAD, b"", None)


def test_payload_forms_hash_alike() -> None:
    raw = PAYLOAD.tobytes()
    want = integrity.checksum(KEY, META, raw, SECRET)
    forms = [PAYLOAD, PAYLOAD.reshape(10, 100), memoryview(PAYLOAD), memoryview(raw),
             pa.py_buffer(raw), bytearray(raw), [raw[:7], raw[7:]],
             ChunkedPayload([pa.py_buffer(raw[:100]), pa.py_buffer(raw[100:])])]
    for form in forms:
        assert integrity.checksum(KEY, META, form, SECRET) == want, type(form)


def test_key_from_the_environment_or_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(integrity.KEY_ENV, raising=False)
    monkeypatch.delenv(f"{integrity.KEY_ENV}_FILE", raising=False)
    assert integrity.load_key() is None
    monkeypatch.setenv(integrity.KEY_ENV, "s3cret")
    assert integrity.load_key() == integrity.derive_key("s3cret")
    monkeypatch.delenv(integrity.KEY_ENV)
    path = tmp_path / "key"
    path.write_text("s3cret\n")
    monkeypatch.setenv(f"{integrity.KEY_ENV}_FILE", str(path))
    assert integrity.load_key() == integrity.derive_key("s3cret")
    assert len(integrity.derive_key("s3cret")) == 32


def test_memory_backend_and_assembler_keep_the_checksum() -> None:
    digest = integrity.checksum(KEY, META, PAYLOAD, SECRET)
    backend = MemoryBackend(1 << 20)
    backend.put(KEY, KVObject(META, pa.py_buffer(PAYLOAD.tobytes()), digest))
    got = backend.get(KEY)
    assert got is not None and got.checksum == digest
    assert integrity.verify(KEY, got.metadata, got.data, got.checksum, SECRET)
    backend.put("plain", KVObject(META, b"xy"))
    plain = backend.get("plain")
    assert plain is not None and plain.checksum == b""

    raw = PAYLOAD.tobytes()
    a = PartAssembler(max_pending_bytes=1 << 20)
    assert a.add(KEY, META, 2000, len(raw), pa.py_buffer(raw[2000:]), digest) is None
    done = a.add(KEY, META, 0, len(raw), pa.py_buffer(raw[:2000]), digest)
    assert done is not None and done[2] == digest
    assert integrity.verify(KEY, done[0], done[1], done[2], SECRET)


def test_store_bounds_checksum_length() -> None:
    check_checksum(KEY, b"x" * 64)
    with pytest.raises(InvalidRequestError, match="checksum of 65 bytes, at most 64"):
        check_checksum(KEY, b"x" * 65)
