"""The connector's key scheme (engine/connector/keys.py): keys are LMCache's chunk keys of the
tokens (salted chains apart), token digests change with any token of the prefix or the salt, a
remote prefill's keys must be those of the call's own tokens, and a checksum bound to one
prompt's digest does not verify for another's."""

from __future__ import annotations

import pytest

from engine.connector.keys import KeyScheme
from kvstore import integrity
from kvstore.lmcache_format import chunk_keys

SCHEME = KeyScheme("m", "float32", 4)
TOKENS = list(range(10, 21))  # 11 tokens: chunks of 4, 4, 3


def test_keys_are_lmcaches_chunk_keys_and_a_salt_starts_another_chain() -> None:
    lmcache = [k.to_string() for k in chunk_keys(TOKENS, "m", 1, 0, "float32", 4)]
    assert SCHEME.chunk_keys(TOKENS, None) == lmcache
    salted = SCHEME.chunk_keys(TOKENS, "tenant")
    assert len(salted) == 3 and not set(salted) & set(SCHEME.chunk_keys(TOKENS, None))


def test_a_tokens_digest_depends_on_its_whole_prefix_and_the_salt() -> None:
    base = SCHEME.token_digests(TOKENS, None)
    assert len(base) == 3 and all(len(d) == 32 for d in base)
    changed = SCHEME.token_digests([99, *TOKENS[1:]], None)  # the first token only
    assert all(a != b for a, b in zip(base, changed, strict=True))
    later = SCHEME.token_digests([*TOKENS[:8], 99, *TOKENS[9:]], None)
    assert later[:2] == base[:2] and later[2] != base[2]
    assert SCHEME.token_digests(TOKENS, "s") != base


def test_check_keys_takes_the_prompts_own_keys_and_refuses_others() -> None:
    own = SCHEME.chunk_keys(TOKENS, "s")
    SCHEME.check_keys(own, TOKENS, "s")
    SCHEME.check_keys(own[:2], TOKENS, "s")  # a prefix
    other = SCHEME.chunk_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], "s")
    with pytest.raises(ValueError, match=r"kv_transfer_params.keys\[0\]"):
        SCHEME.check_keys(other, TOKENS, "s")
    with pytest.raises(ValueError, match=r"keys\[2\]"):
        SCHEME.check_keys([*own[:2], other[2]], TOKENS, "s")
    with pytest.raises(ValueError, match="keys"):
        SCHEME.check_keys(own, TOKENS, None)  # another salt
    with pytest.raises(ValueError, match=r"keys\[3\]"):
        SCHEME.check_keys([*own, own[0]], TOKENS, "s")  # more keys than chunks


def test_a_checksum_bound_to_one_prompts_tokens_fails_for_another() -> None:
    key, meta, payload, ikey = "m@1@0@7b@float32", b"meta", b"payload" * 10, integrity.derive_key("k")
    mine, theirs = SCHEME.token_digests(TOKENS, None)[0], SCHEME.token_digests([5, *TOKENS[1:]], None)[0]
    digest = integrity.checksum(key, meta, payload, ikey, mine)
    assert integrity.verify(key, meta, payload, digest, ikey, mine)
    assert not integrity.verify(key, meta, payload, digest, ikey, theirs)
    assert not integrity.verify(key, meta, payload, digest, ikey)  # bound to nothing
