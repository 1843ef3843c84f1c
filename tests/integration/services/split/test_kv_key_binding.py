"""A decode worker takes KV only for the tokens of the call it serves (real processes: a store, a
prefill and a decode `pdserve worker`): a Decode for prompt Y that carries prompt X's genuine
`kv_transfer.keys` is refused (INVALID_ARGUMENT naming the field) before the engine sees it, the
worker's prefix cache is unchanged, and later requests for Y, split or not, give Y's greedy text.
Salted transfers are bound to their salt the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from services.worker.client import WorkerClient, WorkerError
from tests.integration.services.procs_util import Proc, store_proc, worker_proc

in_module_loop = pytest.mark.asyncio(loop_scope="module")
X = [100 + (7 * i) % 3000 for i in range(300)]
Y = [200 + (11 * i) % 3000 for i in range(300)]
NEW = 12


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    from engine.llm import LLM

    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        return list(llm.generate([Y], greedy(NEW), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def workers(model_dir: Path) -> Iterator[dict[str, Proc]]:
    procs = {"store": store_proc().wait_ready()}
    url = f"grpc://{procs['store'].target}"
    try:
        for role in ("prefill", "decode"):
            procs[role] = worker_proc(role, model_dir, url)
        for role in ("prefill", "decode"):
            procs[role].wait_ready()
        yield procs
    finally:
        for proc in reversed(procs.values()):
            proc.stop()


async def decode_ids(client: WorkerClient, rid: str, ids: list[int], kv: dict[str, object] | None
                     ) -> list[int]:
    return [t async for c in client.decode(rid, ids, greedy(NEW - 1), kv) for t in c.token_ids]


@in_module_loop
async def test_a_decode_carrying_another_prompts_keys_is_refused(workers: dict[str, Proc],
                                                                 expected: list[int]) -> None:
    async with WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["decode"].target) as decode:
        x = await prefill.prefill("x", X, greedy(1), transfer_id="tx")
        y = await prefill.prefill("y", Y, greedy(1), transfer_id="ty")
        assert x.kv_transfer_params and y.kv_transfer_params
        before = await decode.load()
        with pytest.raises(WorkerError) as err:
            await decode_ids(decode, "attack", [*Y, y.first_token_id], x.kv_transfer_params)
        assert err.value.kind == "invalid" and "kv_transfer_params.keys[0]" in err.value.message
        after = await decode.load()
        assert (after.num_cached_blocks, after.prefix_cache_queries) == \
            (before.num_cached_blocks, before.prefix_cache_queries)
        # Y split with its own keys, then Y again on the decode worker alone (its prefix cache)
        got = await decode_ids(decode, "y", [*Y, y.first_token_id], y.kv_transfer_params)
        assert [y.first_token_id, *got] == expected
        alone = [t async for c in decode.decode("y2", Y, greedy(NEW)) for t in c.token_ids]
        assert alone == expected


@in_module_loop
async def test_a_transfer_is_bound_to_its_salt(workers: dict[str, Proc]) -> None:
    async with WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["decode"].target) as decode:
        call = prefill.start_prefill("s", Y, greedy(1), transfer_id="ts", cache_salt="tenant-a")
        y = await call.result()
        with pytest.raises(WorkerError) as err:  # the same tokens under another tenant's salt
            bad = decode.start_decode("s2", [*Y, y.first_token_id], greedy(4), y.kv_transfer_params,
                                      cache_salt="tenant-b")
            [c async for c in bad.chunks()]
        assert err.value.kind == "invalid" and "kv_transfer_params.keys" in err.value.message
