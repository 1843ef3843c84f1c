"""Early hand-off through a real KV store: the consumer gets the request before its producer has
run (EngineCoreRequest.await_first_token), allocates its blocks and loads the prompt's KV as the
producer saves it, computes nothing until the prefill's first token comes (add_first_token),
then decodes from it: greedy float32 tokens equal one colocated engine, the whole prompt loaded.
The token may come before or after the KV; an abort stops a load that waits; a producer that
never saves leaves the consumer to recompute kv_await_s after the token (or to fail, by
policy). No block or lease is left."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.core.outputs import FirstToken
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService
from tests.integration.connector.test_disaggregated import (
    NEW_TOKENS,
    free_blocks,
    greedy,
    llm,
    prefill,
    prompt_of,
)

LENGTHS = [17, 257, 1000]


@pytest.fixture(scope="module")
def colocated(long_model_dir: Path) -> dict[int, list[int]]:
    engine = llm(long_model_dir)
    outs = engine.generate([prompt_of(n) for n in LENGTHS], greedy(NEW_TOKENS), use_tqdm=False)
    result = {n: list(o.outputs[0].token_ids) for n, o in zip(LENGTHS, outs, strict=True)}
    engine.engine_core.shutdown()
    return result


def add_early(consumer: Any, rid: str, prompt: list[int]) -> None:
    params = greedy(NEW_TOKENS, {"do_remote_prefill": True, "num_tokens": len(prompt), "keys": [],
                                 "transfer_id": rid})
    [request] = consumer.processor.make_requests(rid, prompt, params, await_first_token=True)
    consumer.engine_core.add_request(request)


def step_until(engine: Any, done: Any, timeout_s: float = 30.0) -> list[Any]:
    """Steps the core until `done(outputs so far)`; returns every output it gave meanwhile."""
    outputs: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        assert time.monotonic() < deadline, "the engine did not get there in time"
        outputs.extend(engine.engine_core.step().outputs)
    return outputs


def tokens_of(outputs: list[Any], rid: str) -> list[int]:
    return [t for o in outputs if o.request_id == rid for t in o.new_token_ids]


def finished(outputs: list[Any], rid: str) -> Any:
    ends = [o for o in outputs if o.request_id == rid and o.finish_reason is not None]
    return ends[0] if ends else None


def parked(engine: Any, rid: str) -> bool:
    return rid in engine.engine_core.scheduler._awaiting_token


@pytest.mark.parametrize("token_first", [False, True], ids=["kv-first", "token-first"])
def test_early_decode_equals_colocated(store: KVStoreService, long_model_dir: Path,
                                       colocated: dict[int, list[int]], token_first: bool) -> None:
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location, max_num_batched_tokens=256)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    free0, total = free_blocks(consumer)
    prompts = {n: prompt_of(n) for n in LENGTHS}
    for n, prompt in prompts.items():
        add_early(consumer, f"r{n}", prompt)
    # blocks allocated at once, loads waiting for objects not saved yet, nothing computed
    outputs = step_until(consumer, lambda outs: len(consumer.engine_core.scheduler.waiting_for_kv) == 3)
    assert outputs == [] and free_blocks(consumer)[0] < free0
    firsts = dict(zip(LENGTHS, prefill(producer, list(prompts.values())), strict=True))
    if token_first:
        for n, (tok, params) in firsts.items():
            consumer.engine_core.add_first_token(FirstToken(f"r{n}", tok, params))
    else:  # the KV is in and the requests parked, still computing nothing
        outputs = step_until(consumer, lambda outs: all(parked(consumer, f"r{n}") for n in LENGTHS))
        assert outputs == []
        for n, (tok, params) in firsts.items():
            consumer.engine_core.add_first_token(FirstToken(f"r{n}", tok, params))
    outputs = step_until(consumer, lambda outs: all(finished(outs, f"r{n}") for n in LENGTHS))
    for n, (tok, _) in firsts.items():
        assert [tok, *tokens_of(outputs, f"r{n}")] == colocated[n], f"prompt of {n} tokens differs"
        end = finished(outputs, f"r{n}")
        assert end.times.num_cached_tokens == n, "the consumer should have loaded the whole prompt"
    assert free_blocks(consumer) == (total, total)
    with KVStoreClient(store.location) as c:
        assert c.stats().leased == 0  # the consumer released every transfer
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


def test_abort_stops_a_load_that_waits(store: KVStoreService, long_model_dir: Path) -> None:
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    total = free_blocks(consumer)[1]
    add_early(consumer, "a", prompt_of(1000, seed=5))
    step_until(consumer, lambda outs: "a" in consumer.engine_core.scheduler.waiting_for_kv)
    consumer.engine_core.abort_requests(["a"])
    start = time.monotonic()
    step_until(consumer, lambda outs: not consumer.engine_core.has_unfinished_requests(), timeout_s=5)
    assert time.monotonic() - start < 2, "the abort should stop the load at its next round"
    assert free_blocks(consumer) == (total, total)
    # a token for it now is ignored; a parked request is freed by an abort too
    consumer.engine_core.add_first_token(FirstToken("a", 5))
    assert not consumer.engine_core.has_unfinished_requests()
    consumer.engine_core.shutdown()


def test_a_producer_that_never_saves_leaves_the_consumer_to_recompute(
        store: KVStoreService, long_model_dir: Path, colocated: dict[int, list[int]]) -> None:
    """The prefill ran elsewhere (its KV never reached this store): the load waits as long as
    the request does, and kv_await_s after the first token what is missing counts as missing:
    the consumer computes the prompt itself."""
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_await_s=0.3)
    plain = llm(long_model_dir)
    prompt = prompt_of(257)
    first = plain.generate([prompt], greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
    add_early(consumer, "x", prompt)
    start = time.monotonic()
    step_until(consumer, lambda outs: time.monotonic() - start > 1.0)  # well past kv_await_s
    assert "x" in consumer.engine_core.scheduler.waiting_for_kv  # no deadline before the token
    consumer.engine_core.add_first_token(FirstToken("x", first, None))
    outputs = step_until(consumer, lambda outs: finished(outs, "x") is not None)
    assert [first, *tokens_of(outputs, "x")] == colocated[257]
    assert finished(outputs, "x").times.num_cached_tokens == 0
    total = free_blocks(consumer)[1]
    assert free_blocks(consumer) == (total, total)
    consumer.engine_core.shutdown()
    plain.engine_core.shutdown()


def test_a_failed_load_under_the_fail_policy_ends_the_request_when_its_token_comes(
        store: KVStoreService, long_model_dir: Path) -> None:
    """The load ended (nothing saved, kv_await_s passed) while the request was parked: the
    token makes it fail, and the core gives its final output without another request to step."""
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_await_s=0.2, kv_load_failure_policy="fail")
    add_early(consumer, "f", prompt_of(300, seed=7))
    step_until(consumer, lambda outs: "f" in consumer.engine_core.scheduler.waiting_for_kv)
    consumer.engine_core.add_first_token(FirstToken("f", 5, None))  # hurries: 0.2 s, then missing
    outputs = step_until(consumer, lambda outs: finished(outs, "f") is not None, timeout_s=10)
    end = finished(outputs, "f")
    assert str(end.finish_reason) == "abort" and "kv_load_failed" in str(end.stop_reason)
    assert not consumer.engine_core.has_unfinished_requests()
    total = free_blocks(consumer)[1]
    assert free_blocks(consumer) == (total, total)
    consumer.engine_core.shutdown()


def test_bad_early_requests_fail_clearly(store: KVStoreService, long_model_dir: Path) -> None:
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    [request] = consumer.processor.make_requests("b", prompt_of(20), greedy(4), await_first_token=True)
    with pytest.raises(ValueError, match="do_remote_prefill"):
        consumer.engine_core.add_request(request)
    consumer.engine_core.shutdown()


def test_a_dead_store_is_not_waited_for_once_the_token_comes(
        long_model_dir: Path, colocated: dict[int, list[int]]) -> None:
    """Nothing answers at the store's address: the waiting load keeps asking (no deadline before
    the token), and once the token comes the request computes its prompt at once, without
    waiting out kv_await_s."""
    from services.procs import free_port

    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=f"grpc://127.0.0.1:{free_port()}", kv_await_s=30.0)
    plain = llm(long_model_dir)
    prompt = prompt_of(257)
    first = plain.generate([prompt], greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
    add_early(consumer, "d", prompt)
    start = time.monotonic()
    step_until(consumer, lambda outs: time.monotonic() - start > 0.5)
    consumer.engine_core.add_first_token(FirstToken("d", first, None))
    start = time.monotonic()
    outputs = step_until(consumer, lambda outs: finished(outs, "d") is not None, timeout_s=10)
    assert time.monotonic() - start < 5, "the dead store was waited for"
    assert [first, *tokens_of(outputs, "d")] == colocated[257]
    consumer.engine_core.shutdown()
    plain.engine_core.shutdown()
