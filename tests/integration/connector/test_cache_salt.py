"""Tenant isolation in the KV store: a salted prompt's chunk keys start from its salt, so another
tenant (another salt, or none) finds nothing of it in the store, while the same tenant on any
engine loads it. Salts change what is cached, never the tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.lmcache_format import NONE_HASH, chunk_hashes, hash_chunk, salt_prefix_hash
from kvstore.service import KVStoreService
from tests.integration.connector.test_disaggregated import NEW_TOKENS, greedy, llm, prompt_of


def salted(prompt: list[int], salt: str | None) -> dict[str, Any]:
    return {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})


def test_salted_chunk_chain_starts_from_the_salt_and_unsalted_keys_are_lmcache_s() -> None:
    tokens = list(range(600))
    h0 = int.from_bytes(hashlib.sha256(b"pdserve.cache_salt.v1\0tenant").digest()[:8], "big", signed=True)
    assert salt_prefix_hash("tenant") == h0
    salted_chain = chunk_hashes(tokens, 256, prefix_hash=h0)
    assert salted_chain[0] == hash_chunk(tokens[:256], h0)
    plain = chunk_hashes(tokens, 256)
    assert plain[0] == hash((NONE_HASH, tuple(tokens[:256]), ()))  # LMCache's builtin chain
    other = chunk_hashes(tokens, 256, prefix_hash=salt_prefix_hash("other"))
    assert len({*plain, *salted_chain, *other}) == 9


def test_another_tenant_finds_nothing_in_the_store_the_same_tenant_loads(
        store: KVStoreService, long_model_dir: Path) -> None:
    first = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_both", kv_store_url=store.location)
    prompt = prompt_of(300, seed=5)
    want = llm(long_model_dir).generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0]
    saved = first.generate(salted(prompt, "tenant-a"), greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert saved.num_cached_tokens == 0
    with KVStoreClient(store.location) as c:
        stored = c.stats().objects
    assert stored > 0
    for salt in ("tenant-b", None):  # fresh engines: only the store could give them KV
        probe = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_both",
                    kv_store_url=store.location)
        out = probe.generate(salted(prompt, salt), greedy(NEW_TOKENS), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, f"salt {salt!r} found tenant-a's KV"
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        probe.engine_core.shutdown()
    again = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_both", kv_store_url=store.location)
    out = again.generate(salted(prompt, "tenant-a"), greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert out.num_cached_tokens == 299  # every chunk from the store, as unsalted prompts do
    assert out.outputs[0].token_ids == saved.outputs[0].token_ids == want.outputs[0].token_ids
    first.engine_core.shutdown()
    again.engine_core.shutdown()


def test_a_salted_transfer_carries_salted_keys_to_the_consumer(store: KVStoreService,
                                                               long_model_dir: Path) -> None:
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    prompt = prompt_of(257, seed=6)
    want = llm(long_model_dir).generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0]
    keys = {}
    for salt in (None, "tenant-a"):
        (pre,) = producer.generate(salted(prompt, salt), greedy(1, {"do_remote_decode": True}),
                                   use_tqdm=False)
        params = pre.kv_transfer_params
        assert params is not None
        keys[salt] = params["keys"]
        first = pre.outputs[0].token_ids[0]
        (out,) = consumer.generate(salted([*prompt, first], salt), greedy(NEW_TOKENS - 1, params),
                                   use_tqdm=False)
        assert [first, *out.outputs[0].token_ids] == list(want.outputs[0].token_ids)
        assert out.num_cached_tokens == 257
    assert not set(keys[None]) & set(keys["tenant-a"])
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()
