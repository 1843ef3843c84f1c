"""The worker gRPC services end to end: a prefill worker and a decode worker over a real KV store
give the offline `LLM`'s greedy tokens, so does a colocated worker; streams concatenate to the
whole output; a cancelled or aborted stream frees its blocks; bad input is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.sampling_params import SamplingParams
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService
from protos import worker_pb2 as pb
from services.procs import free_port
from services.worker.client import DecodeChunk, WorkerClient, WorkerError
from services.worker.server import WorkerServer

in_module_loop = pytest.mark.asyncio(loop_scope="module")

NEW_TOKENS = 6
LENGTHS = [1, 17, 40, 300]


def prompt_of(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(100, 49000) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> dict[int, list[int]]:
    """The reference: the offline engine's greedy tokens of each prompt."""
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96)
    outs = llm.generate([prompt_of(n) for n in LENGTHS], greedy(NEW_TOKENS), use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(LENGTHS, outs, strict=True)}


async def stream(client: WorkerClient, request_id: str, ids: list[int], params: SamplingParams,
                 kv: dict[str, object] | None = None) -> list[DecodeChunk]:
    return [chunk async for chunk in client.decode(request_id, ids, params, kv)]


async def wait_idle(client: WorkerClient, timeout_s: float = 10.0) -> pb.LoadReport:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        load = await client.load()
        if load.num_free_blocks == load.num_total_blocks and load.num_running == 0:
            return load
        assert asyncio.get_running_loop().time() < deadline, f"blocks still held: {load}"
        await asyncio.sleep(0.05)


@in_module_loop
async def test_workers_report_serving_and_their_role(workers: dict[str, WorkerServer]) -> None:
    roles = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "colocated": pb.ROLE_COLOCATED}
    for name, server in workers.items():
        async with WorkerClient(server.target) as client:
            assert await client.health()
            assert await client.health("pdserve.worker.v1.Worker")
            load = await client.load()
            assert load.role == roles[name]
            assert load.num_total_blocks > 0 and load.kv_usage == 0.0


@in_module_loop
async def test_prefill_then_decode_over_the_kv_store_equals_offline_llm(
        workers: dict[str, WorkerServer], offline: dict[int, list[int]], store: KVStoreService) -> None:
    async with WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["decode"].target) as decode:

        async def one(n: int) -> tuple[list[int], DecodeChunk]:
            prompt = prompt_of(n)
            first = await prefill.prefill(f"pd-{n}", prompt, greedy(NEW_TOKENS), transfer_id=f"t-{n}")
            assert first.finish_reason == "length"
            assert first.kv_transfer_params is not None and first.kv_transfer_params["do_remote_prefill"]
            chunks = await stream(decode, f"pd-{n}", [*prompt, first.first_token_id],
                                  greedy(NEW_TOKENS - 1), first.kv_transfer_params)
            return [first.first_token_id, *(t for c in chunks for t in c.token_ids)], chunks[-1]

        results = await asyncio.gather(*(one(n) for n in LENGTHS))
        for n, (tokens, last) in zip(LENGTHS, results, strict=True):
            assert tokens == offline[n], f"prompt of {n} tokens differs"
            assert last.finish_reason == "length"
            assert last.usage.prompt_tokens == n + 1 and last.usage.completion_tokens == NEW_TOKENS - 1
            assert last.usage.cached_tokens == n  # the decode worker loaded the whole prompt
        await wait_idle(decode)
        await wait_idle(prefill)
    with KVStoreClient(store.location) as c:
        assert c.stats().leased == 0  # the decode worker acknowledged every transfer


@pytest.mark.parametrize("role", ["colocated", "decode"], ids=["colocated", "decode-without-remote-kv"])
@in_module_loop
async def test_stream_computing_the_prompt_concatenates_to_offline_output(
        workers: dict[str, WorkerServer], offline: dict[int, list[int]], role: str) -> None:
    async with WorkerClient(workers[role].target) as client:
        for n in LENGTHS:
            chunks = await stream(client, f"{role}-{n}", prompt_of(n), greedy(NEW_TOKENS))
            assert [t for c in chunks for t in c.token_ids] == offline[n]
            assert all(c.finish_reason == "" for c in chunks[:-1])
            assert chunks[-1].finish_reason == "length"
            assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
            assert chunks[-1].usage.prompt_tokens == n
            assert chunks[-1].usage.completion_tokens == NEW_TOKENS


@in_module_loop
async def test_logprobs_come_one_position_per_token(workers: dict[str, WorkerServer]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    async with WorkerClient(workers["colocated"].target) as client:
        chunks = await stream(client, "lp", prompt_of(17), params)
    for chunk in chunks:
        assert len(chunk.logprobs) == len(chunk.token_ids)
        for token, position in zip(chunk.token_ids, chunk.logprobs, strict=True):
            assert token in [c.token_id for c in position]
            assert len(position) >= 2


@pytest.mark.parametrize("role", ["decode", "colocated"])
@in_module_loop
async def test_cancelled_stream_aborts_and_frees_its_blocks(
        workers: dict[str, WorkerServer], role: str) -> None:
    async with WorkerClient(workers[role].target) as client:
        before = await wait_idle(client)
        received = 0
        async for chunk in client.decode(f"cancel-{role}", prompt_of(40), greedy(400)):
            received += len(chunk.token_ids)
            if received >= 2:
                break  # leaving the stream cancels the call
        after = await wait_idle(client)  # prefix-cache counters only grow: compare the rest
        assert (after.num_free_blocks, after.num_running, after.num_waiting) == \
            (before.num_free_blocks, before.num_running, before.num_waiting)


@in_module_loop
async def test_abort_rpc_ends_the_stream_with_abort(workers: dict[str, WorkerServer]) -> None:
    async with WorkerClient(workers["colocated"].target) as client:
        chunks: list[DecodeChunk] = []
        async for chunk in client.decode("to-abort", prompt_of(40), greedy(400)):
            chunks.append(chunk)
            if len(chunks) == 2:
                assert await client.abort("to-abort")
        assert chunks[-1].finish_reason == "abort"
        assert not await client.abort("to-abort")
        await wait_idle(client)


def raw_decode(request_id: str, token_ids: list[int], kv: pb.KVTransferParams | None = None,
               **params: object) -> pb.DecodeRequest:
    """A DecodeRequest built on the wire, past the client's own SamplingParams validation."""
    fields: dict[str, object] = {"top_p": 1.0, "top_k": -1, "max_tokens": 2, "repetition_penalty": 1.0}
    return pb.DecodeRequest(request_id=request_id, token_ids=token_ids, kv_transfer=kv,
                            params=pb.SamplingParams(**{**fields, **params}))  # type: ignore[arg-type]


def status(error: BaseException) -> tuple[str, str]:
    """(status code name, details) of a failed call, raw (AioRpcError) or through the client."""
    if isinstance(error, WorkerError):
        code, _, details = error.message.partition(": ")
        return code, details
    assert isinstance(error, grpc.aio.AioRpcError)
    return error.code().name, error.details() or ""


def hostile(**fields: object) -> pb.KVTransferParams:
    return pb.KVTransferParams(do_remote_prefill=True, **fields)  # type: ignore[arg-type]


KEY = "m@1@0@7b@float"  # a well-formed CacheEngineKey string


@in_module_loop
async def test_invalid_arguments_are_rejected_with_the_reason(workers: dict[str, WorkerServer]) -> None:
    async with WorkerClient(workers["decode"].target) as decode, \
            WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["colocated"].target) as colocated:
        cases = [
            (decode.stub.Decode(raw_decode("bad-1", [])).read(), "token_ids"),
            (decode.stub.Decode(raw_decode("bad-2", [5, 6], top_k=0)).read(), "top_k"),
            (decode.stub.Decode(raw_decode("bad-3", [5], temperature=-1.0)).read(), "temperature"),
            (decode.stub.Decode(raw_decode("bad-4", [5], max_tokens=0)).read(), "max_tokens"),
            # The hostile shape (more tokens than the prompt), too many keys, bad keys.
            (decode.stub.Decode(raw_decode("bad-5", [5] * 20, hostile(keys=[KEY], num_tokens=30))).read(),
             "kv_transfer_params.num_tokens"),
            (decode.stub.Decode(raw_decode("bad-6", [5] * 20, hostile(keys=[KEY] * 5, num_tokens=10))).read(),
             "kv_transfer_params.keys"),
            (decode.stub.Decode(raw_decode("bad-6b", [5] * 20, hostile(keys=["x"], num_tokens=10))).read(),
             "kv_transfer_params.keys[0]"),
            (decode.stub.Decode(raw_decode("bad-6c", [5] * 20, hostile(keys=[KEY * 40], num_tokens=9)))
             .read(), "kv_transfer_params.keys[0]"),
            (stream(decode, "bad-7", [10**6], greedy(2)), "out of range"),
            (stream(decode, "", [5], greedy(2)), "request_id"),
            (prefill.prefill("bad-8", [], greedy(2)), "token_ids"),
            # What the router refuses, the worker's edge refuses too (services/limits.py)
            (decode.stub.Decode(raw_decode("lim-1", [5], max_tokens=2**31 - 1)).read(), "max_tokens"),
            (decode.stub.Decode(raw_decode("lim-2", [5], temperature=float("inf"))).read(), "temperature"),
            (decode.stub.Decode(raw_decode("lim-2b", [5], temperature=2.5)).read(), "temperature"),
            (decode.stub.Decode(pb.DecodeRequest(request_id="lim-3", token_ids=[5], cache_salt="s" * 2**20,
                                                 params=raw_decode("x", [5]).params)).read(), "cache_salt"),
            (decode.stub.Decode(raw_decode("lim-4", [5], stop_token_ids=[2**31 - 1])).read(),
             "stop_token_ids"),
            (decode.stub.Decode(raw_decode("lim-5", [5], bad_words=[pb.TokenIds(token_ids=[7])] * 10_000))
             .read(), "bad_words"),
            (decode.stub.Decode(raw_decode("lim-6", [5], logit_bias={i: 1.0 for i in range(2000)})).read(),
             "logit_bias"),
        ]
        for call, field in cases:
            with pytest.raises((grpc.aio.AioRpcError, WorkerError)) as err:
                await call
            code, details = status(err.value)
            assert code == "INVALID_ARGUMENT" and field in details, (code, details)
        # A message that does not parse: INVALID_ARGUMENT (gRPC's own answer was UNKNOWN)
        garbage = decode.channel.unary_stream("/pdserve.worker.v1.Worker/Decode",
                                              request_serializer=lambda b: b,
                                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await garbage(b"\xff\xff\xff\xff", metadata=decode._metadata).read()
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw.value
        assert "does not parse" in (raw.value.details() or "")
        watch = decode.health_stub.Watch(health_pb2.HealthCheckRequest(service=""))  # streams, as it did
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert (await stream(decode, "good", [5, 6], greedy(2)))[-1].finish_reason == "length"
        assert (await decode.load()).serving  # the hostile calls left it serving
        with pytest.raises(WorkerError) as werr:
            await colocated.prefill("bad-9", [5, 6], greedy(2))
        assert status(werr.value)[0] == "UNIMPLEMENTED" and werr.value.kind == "failed"
        with pytest.raises(WorkerError) as werr:
            await stream(prefill, "bad-10", [5, 6], greedy(2))
        assert status(werr.value)[0] == "UNIMPLEMENTED"


@in_module_loop
async def test_workers_announce_an_accepted_request_before_its_first_token(
        workers: dict[str, WorkerServer], offline: dict[int, list[int]]) -> None:
    """`announce=True` / `accepted()`: the worker's initial metadata (sent once its engine has the
    request) comes first; the tokens after it are unchanged. A rejected call announces nothing."""
    n = 300
    async with WorkerClient(workers["colocated"].target) as colocated, \
            WorkerClient(workers["prefill"].target) as prefill:
        chunks = [c async for c in colocated.decode("acc-1", prompt_of(n), greedy(NEW_TOKENS), announce=True)]
        assert not chunks[0].token_ids and not chunks[0].finish_reason
        assert [t for c in chunks[1:] for t in c.token_ids] == offline[n]
        call = prefill.start_prefill("acc-2", prompt_of(n), greedy(NEW_TOKENS), transfer_id="acc-2")
        assert await call.accepted()
        assert (await call.result()).first_token_id == offline[n][0]

        bad = prefill.start_prefill("acc-3", [10**6], greedy(2))
        assert not await bad.accepted()
        with pytest.raises(WorkerError) as err:
            await bad.result()
        assert err.value.kind == "invalid"
        got: list[DecodeChunk] = []
        with pytest.raises(WorkerError) as err:
            async for chunk in colocated.decode("acc-4", [10**6], greedy(2), announce=True):
                got.append(chunk)
        assert err.value.kind == "invalid" and got == []
        await wait_idle(colocated)
        await wait_idle(prefill)


@in_module_loop
async def test_stop_waits_for_in_flight_calls(start_worker: Callable[[str], Awaitable[WorkerServer]]
                                              ) -> None:
    server = await start_worker("colocated")
    async with WorkerClient(server.target) as client:
        call = asyncio.ensure_future(stream(client, "in-flight", prompt_of(17), greedy(30)))
        while (await client.load()).num_running == 0:
            await asyncio.sleep(0.01)
        await server.stop(grace_s=20.0)
        chunks = await call
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 30
        with pytest.raises(WorkerError):
            await client.health()


@in_module_loop
async def test_cli_worker_serves_and_exits_cleanly_on_sigterm(
        model_dir: Path, offline: dict[int, list[int]]) -> None:
    import signal
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "worker", "--role", "colocated", "--port", str(free_port()),
        "--model", str(model_dir), "--num-threads", "1", "--max-model-len", "512",
        "--num-kv-blocks", "96", "--grace-s", "2",
        cwd=str(Path(__file__).resolve().parents[4]), stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        assert "listening on" in line, line
        async with WorkerClient(line.split()[-1]) as client:
            assert await client.health()
            chunks = await stream(client, "cli", prompt_of(17), greedy(NEW_TOKENS))
            assert [t for c in chunks for t in c.token_ids] == offline[17]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
