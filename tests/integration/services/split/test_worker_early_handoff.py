"""The early hand-off over gRPC: a Decode with await_first_token sent before its Prefill, then
FirstToken with the prefill's result, gives the offline engine's greedy tokens with the whole
prompt loaded from the store; a FirstToken that finds no request says so; bad early calls are
INVALID_ARGUMENT naming the field; a cancelled early call frees its blocks while it waits."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService
from services.worker.client import DecodeChunk, WorkerClient, WorkerError
from services.worker.server import WorkerServer
from tests.integration.services.worker.test_worker_services import (
    LENGTHS,
    NEW_TOKENS,
    greedy,
    offline,  # noqa: F401 (a fixture)
    prompt_of,
    wait_idle,
)

in_module_loop = pytest.mark.asyncio(loop_scope="module")


def early_kv(n: int, rid: str) -> dict[str, object]:
    return {"do_remote_prefill": True, "keys": [], "num_tokens": n, "transfer_id": rid}


@in_module_loop
async def test_early_decode_then_prefill_then_first_token_equals_offline_llm(
        workers: dict[str, WorkerServer], offline: dict[int, list[int]],  # noqa: F811
        store: KVStoreService) -> None:
    async with WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["decode"].target) as decode:

        async def one(n: int) -> tuple[list[int], DecodeChunk]:
            prompt, rid = prompt_of(n), f"early-{n}"
            call = decode.start_decode(rid, prompt, greedy(NEW_TOKENS), early_kv(n, rid),
                                       await_first_token=True)
            assert await call.accepted()
            first = await prefill.prefill(rid, prompt, greedy(NEW_TOKENS), transfer_id=rid)
            assert await decode.first_token(rid, first.first_token_id, first.kv_transfer_params)
            chunks = [c async for c in call.chunks() if c.token_ids or c.finish_reason]
            return [first.first_token_id, *(t for c in chunks for t in c.token_ids)], chunks[-1]

        results = await asyncio.gather(*(one(n) for n in LENGTHS))
        for n, (tokens, last) in zip(LENGTHS, results, strict=True):
            assert tokens == offline[n], f"prompt of {n} tokens differs"
            assert last.finish_reason == "length"
            assert last.usage.completion_tokens == NEW_TOKENS - 1
            assert last.usage.cached_tokens == n  # loaded while the prefill ran, none computed
        await wait_idle(decode)
    with KVStoreClient(store.location) as c:
        assert c.stats().leased == 0  # FirstToken named the producer's keys: released


@in_module_loop
async def test_first_token_for_no_request_says_so(workers: dict[str, WorkerServer]) -> None:
    async with WorkerClient(workers["decode"].target) as decode:
        assert not await decode.first_token("nobody", 5, None)


@in_module_loop
async def test_bad_early_calls_are_invalid_argument_naming_the_field(
        workers: dict[str, WorkerServer]) -> None:
    prompt = prompt_of(40)
    cases = [
        ("colocated", early_kv(40, "b1"), greedy(4), "await_first_token"),
        ("decode", None, greedy(4), "await_first_token"),
        ("decode", early_kv(39, "b3"), greedy(4), "kv_transfer.num_tokens"),
        ("decode", early_kv(40, "b4"), SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+")), "structured_outputs"),
    ]
    for role, kv, params, field in cases:
        async with WorkerClient(workers[role].target) as client:
            call = client.start_decode(f"bad-{field}", prompt, params, kv, await_first_token=True)
            with pytest.raises(WorkerError) as err:
                _ = [c async for c in call.chunks()]
            assert err.value.kind == "invalid" and field in err.value.message, (role, err.value)
    async with WorkerClient(workers["decode"].target) as decode:
        rid = "bad-token"
        call = decode.start_decode(rid, prompt, greedy(4), early_kv(40, rid), await_first_token=True)
        assert await call.accepted()
        with pytest.raises(WorkerError) as err:
            await decode.first_token(rid, 10**9, None)
        assert err.value.kind == "invalid" and "first_token_id" in err.value.message
        call.cancel()  # the request still awaited a good token; the cancel frees it
        await wait_idle(decode)
    async with WorkerClient(workers["prefill"].target) as prefill:
        with pytest.raises(WorkerError) as err:
            await prefill.first_token("x", 1, None)
        assert err.value.message.startswith("UNIMPLEMENTED")


@in_module_loop
async def test_a_cancelled_early_call_frees_its_blocks_while_it_waits(
        workers: dict[str, WorkerServer]) -> None:
    async with WorkerClient(workers["decode"].target) as decode:
        before = await wait_idle(decode)
        rid = "early-cancel"
        call = decode.start_decode(rid, prompt_of(300), greedy(8), early_kv(300, rid),
                                   await_first_token=True)
        assert await call.accepted()
        deadline = asyncio.get_running_loop().time() + 10
        while (await decode.load()).num_free_blocks == before.num_free_blocks:  # blocks taken
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        call.cancel()  # its load waits for a producer that never comes: the abort stops it
        after = await wait_idle(decode)
        assert after.num_free_blocks == before.num_free_blocks
        assert not await decode.first_token(rid, 5, None)  # gone

