"""KV integrity through the split (kvstore/integrity.py): KV in the store that does not verify
is never used. A payload corrupted after an authorised producer checksummed it, an object with no
checksum while an integrity key is configured, and an attacker who can write to the store but
does not hold the integrity key (garbage KV with a well-formed unkeyed checksum, written while the
prompt is being served) all end the same way: the consumer recomputes those tokens, the output
equals the colocated engine's token for token (greedy, float32), the failures are counted, and
the bad KV never enters the consumer's prefix cache (the same prompt again hits only good KV
and gives the same tokens)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import integrity
from kvstore.client import KVStoreAuthError, KVStoreClient
from kvstore.service import KVStoreService, StoreOptions
from tests.integration.connector.test_disaggregated import (
    NEW_TOKENS,
    decode,
    free_blocks,
    greedy,
    llm,
    prefill,
    prompt_of,
)

LENGTHS = [17, 300]  # one partial chunk; a full 256-token chunk and a partial one
SECRET = "integrity test secret"


@pytest.fixture(scope="module")
def expected(long_model_dir: Path) -> dict[int, list[int]]:
    outs = llm(long_model_dir).generate([prompt_of(n, seed=5) for n in LENGTHS], greedy(NEW_TOKENS),
                                        use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(LENGTHS, outs, strict=True)}


def integrity_failures(engine: Any) -> int:
    return int(engine.engine_core.get_stats().kv_transfer.integrity_failures)


def garbage_like(obj: Any) -> torch.Tensor:
    """KV of the object's size far from any real KV (it would change every token it touched)."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(len(obj.data) // 4, generator=gen) * 1e3


def poison(store: KVStoreService, key: str, how: str) -> None:
    with KVStoreClient(store.location) as c:
        obj = c.get([key])[0]
        assert obj is not None and len(obj.checksum) == integrity.CHECKSUM_BYTES
        if how == "flipped":  # one payload bit, the producer's original checksum
            data = bytearray(obj.data.to_pybytes())
            data[len(data) // 2] ^= 0x40
            c.put([(key, obj.metadata, bytes(data), obj.checksum)])
        elif how == "no-checksum":
            c.put([(key, obj.metadata, garbage_like(obj).numpy())])
        else:  # "unkeyed": garbage with a checksum anyone can compute
            data = garbage_like(obj).numpy()
            c.put([(key, obj.metadata, data, integrity.checksum(key, obj.metadata, data, None))])


@pytest.mark.parametrize("how", ["flipped", "no-checksum", "unkeyed"])
@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_bad_kv_is_recomputed_and_never_cached(store: KVStoreService, long_model_dir: Path,
                                              expected: dict[int, list[int]], how: str,
                                              load_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(integrity.KEY_ENV, SECRET)
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_load_mode=load_mode)
    prompts = [prompt_of(n, seed=5) for n in LENGTHS]
    firsts = prefill(producer, prompts)
    poisoned = [f"{p['keys'][-1]}@1" for _, p in firsts]  # each prompt's last chunk, layer 1
    for key in poisoned:
        poison(store, key, how)
    outs = decode(consumer, prompts, firsts)
    for n, (tok, _), o in zip(LENGTHS, firsts, outs, strict=True):
        assert [tok, *o.outputs[0].token_ids] == expected[n], f"prompt of {n} tokens differs"
        if load_mode == "async":  # the good chunk before the bad one loaded, the rest computed
            assert o.num_cached_tokens == (256 if n == 300 else 0)
        # (layer-wise: the step that ran over the bad layer is rolled back, all recomputed)
    assert integrity_failures(consumer) == len(poisoned)
    # The same prompts again, from the consumer's own prefix cache only: same tokens.
    again = consumer.generate([[*p, tok] for p, (tok, _) in zip(prompts, firsts, strict=True)],
                              greedy(NEW_TOKENS - 1), use_tqdm=False)
    for n, (tok, _), o in zip(LENGTHS, firsts, again, strict=True):
        assert [tok, *o.outputs[0].token_ids] == expected[n]
        assert o.num_cached_tokens >= n // 16 * 16 - 16  # recomputed blocks cached, good ones too
    for engine in (producer, consumer):
        free, total = free_blocks(engine)
        assert free == total
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


WORKER, ATTACKER, OPERATOR = "worker-token-0123456789", "attacker-token-0123456789", "admin-token-0123456789"


@pytest.fixture(scope="module")
def auth_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStoreService]:
    """A store with credentials (as `pdserve up` runs it): the workers' token may produce and
    consume, the attacker's only produce (a stolen or misused producer credential)."""
    path = tmp_path_factory.mktemp("auth") / "kv-auth"
    path.write_text(f"{WORKER} producer,consumer\n{ATTACKER} producer\n{OPERATOR} admin,consumer\n")
    path.chmod(0o600)
    with KVStoreService(StoreOptions(capacity="512MiB", port=0, auth_file=str(path))) as service:
        yield service


@pytest.mark.parametrize("credential", ["none", "producer"])
def test_writer_without_the_integrity_key_cannot_poison_a_prompt_being_served(
        auth_store: KVStoreService, long_model_dir: Path, expected: dict[int, list[int]],
        monkeypatch: pytest.MonkeyPatch, credential: str) -> None:
    """The attack of issue 19: while the prefill worker saves and the decode worker loads, an
    attacker overwrites the prompt's chunks with garbage (and a well-formed unkeyed checksum),
    over and over. Without a credential every write is refused; with a producer's credential but
    not the integrity key, every write lands and is detected. Not one output token changes."""
    store = auth_store
    monkeypatch.setenv(integrity.KEY_ENV, SECRET)
    monkeypatch.setenv("PDSERVE_KV_TOKEN", WORKER)  # the engines' connectors
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    prompts = [prompt_of(n, seed=5) for n in LENGTHS]
    # The keys are content hashes: the attacker, who knows the prompt, knows them in advance.
    first_keys = prefill(llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                             kv_store_url=store.location), prompts)
    targets = [f"{k}@{layer}" for _, p in first_keys for k in p["keys"] for layer in range(3)]
    with KVStoreClient(store.location, token=OPERATOR) as c:
        templates = {key: c.get([key])[0] for key in targets}
        c.delete(targets)
    stop = threading.Event()
    writes, refused = [0], [0]

    def attack() -> None:
        with KVStoreClient(store.location, token=ATTACKER if credential == "producer" else "") as c:
            while not stop.is_set():
                for key, obj in templates.items():
                    data = garbage_like(obj).numpy()
                    try:
                        c.put([(key, obj.metadata, data, integrity.checksum(key, obj.metadata, data, None))])
                        writes[0] += 1
                    except KVStoreAuthError:
                        refused[0] += 1

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        firsts = prefill(producer, prompts)
        outs = decode(consumer, prompts, firsts)
    finally:
        stop.set()
        attacker.join(timeout=30)
    if credential == "producer":  # the writes landed; the consumer caught what it loaded of them
        assert writes[0] > 0 and refused[0] == 0
        assert integrity_failures(consumer) > 0
    else:
        assert refused[0] > 0 and writes[0] == 0
        assert integrity_failures(consumer) == 0
    for n, (tok, _), o in zip(LENGTHS, firsts, outs, strict=True):
        assert [tok, *o.outputs[0].token_ids] == expected[n], f"prompt of {n} tokens differs"
    for engine in (producer, consumer):
        free, total = free_blocks(engine)
        assert free == total
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_kv_of_other_tokens_under_the_prompts_own_keys_never_verifies(
        store: KVStoreService, long_model_dir: Path, expected: dict[int, list[int]],
        monkeypatch: pytest.MonkeyPatch, load_mode: str) -> None:
    """What a collision of LMCache's chunk hash (Python's builtin hash) would do: prompt X's
    genuine KV, with the checksums its producer made, found under prompt Y's keys. The checksums
    bind the tokens the KV was computed for, so Y's consumer refuses every such object, computes
    Y itself (its greedy tokens exactly), and caches only that."""
    monkeypatch.setenv(integrity.KEY_ENV, SECRET)
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_load_mode=load_mode)
    y = prompt_of(LENGTHS[1], seed=5)
    x = prompt_of(LENGTHS[1], seed=9)
    (tok_y, params_y), (_, params_x) = prefill(producer, [y, x])
    with KVStoreClient(store.location) as c:
        for key_x, key_y in zip(params_x["keys"], params_y["keys"], strict=True):
            for layer in range(3):
                obj = c.get([f"{key_x}@{layer}"])[0]
                assert obj is not None and obj.checksum
                c.put([(f"{key_y}@{layer}", obj.metadata, obj.data.to_pybytes(), obj.checksum)])
    out = decode(consumer, [y], [(tok_y, params_y)])[0]
    assert [tok_y, *out.outputs[0].token_ids] == expected[LENGTHS[1]]
    assert integrity_failures(consumer) >= 1
    assert out.num_cached_tokens == 0
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()
