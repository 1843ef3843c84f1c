"""AsyncLLM with the core in-process and in its own process: continuous batching, streaming,
aborts, stop strings, bad input and a dead core. References: transformers greedy generation
(conftest `hf_greedy`) and the offline `LLM` on the same model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import pytest_asyncio

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[300 + 13 * i + j for j in range(6 + 5 * i)] for i in range(4)]


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
           **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=kind, **kw)  # type: ignore[arg-type]


def config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_threads=1, max_model_len=160, num_kv_blocks=96)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True],
                        ids=["inproc", "multiprocess"])
async def engine(request, tiny_model_dir: Callable[[str], Path]):
    from engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_config(config(tiny_model_dir("llama")), multiprocess=request.param)
    yield llm
    llm.shutdown()


async def collect(engine, prompt, params, request_id) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def assert_blocks_freed(engine, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await engine.get_stats()
        if stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"blocks still held: {stats}"
        await asyncio.sleep(0.05)


@in_module_loop
async def test_requests_join_while_others_decode_and_match_transformers(
        engine, tiny_model_dir, hf_greedy) -> None:
    long_outputs: list[RequestOutput] = []
    joined = asyncio.Event()
    first_seen_while_long_running: list[bool] = []

    async def long_request() -> None:
        async for out in engine.generate(PROMPTS[0], greedy(40), "long"):
            long_outputs.append(out)
            if len(long_outputs) == 3:
                joined.set()

    async def late_request(i: int) -> list[RequestOutput]:
        await joined.wait()
        outs: list[RequestOutput] = []
        async for out in engine.generate(PROMPTS[i], greedy(10), f"late-{i}"):
            if not outs:
                first_seen_while_long_running.append(not long_outputs[-1].finished)
            outs.append(out)
        return outs

    _, *late = await asyncio.gather(long_request(), late_request(1), late_request(2))
    assert any(first_seen_while_long_running)  # continuous batching: no wait for "long"
    expected = hf_greedy(tiny_model_dir("llama"), [PROMPTS[0], PROMPTS[1], PROMPTS[2]], 40)
    assert long_outputs[-1].outputs[0].token_ids == expected[0]
    assert [outs[-1].outputs[0].token_ids for outs in late] == [e[:10] for e in expected[1:]]
    assert all(outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
               for outs in late)
    await assert_blocks_freed(engine)


@in_module_loop
async def test_stream_kinds_agree_with_the_offline_llm(engine, tiny_model_dir) -> None:
    from engine.llm import LLM

    offline = LLM(**vars(config(tiny_model_dir("llama"))))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    (ref,) = offline.generate([PROMPTS[3]], params, use_tqdm=False)
    cumulative, delta, final = await asyncio.gather(
        collect(engine, PROMPTS[3], params, "cum"),
        collect(engine, PROMPTS[3], SamplingParams(**{**vars(params), "output_kind":
                                                      RequestOutputKind.DELTA}), "delta"),
        collect(engine, PROMPTS[3], SamplingParams(**{**vars(params), "output_kind":
                                                      RequestOutputKind.FINAL_ONLY}), "final"))
    want = ref.outputs[0]
    assert cumulative[-1].outputs[0].token_ids == want.token_ids
    assert cumulative[-1].outputs[0].text == want.text
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == want.token_ids
    assert len(final) == 1 and final[0].outputs[0].token_ids == want.token_ids
    assert len(cumulative) > 1 and [o.finished for o in cumulative].count(True) == 1


@in_module_loop
async def test_abort_ends_the_stream_and_frees_blocks(engine) -> None:
    outs = []
    async for out in engine.generate(PROMPTS[2], greedy(120), "to-abort"):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("to-abort")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 120
    await assert_blocks_freed(engine)


@in_module_loop
async def test_on_added_runs_before_the_first_output_and_its_failure_aborts(engine) -> None:
    """`on_added` (a server telling its client "accepted") comes before any output; if it fails
    (the client is gone), the request does not stay behind in the core."""
    seen: list[str] = []

    async def added() -> None:
        seen.append("added")

    async for _ in engine.generate(PROMPTS[0], greedy(3), "announced", on_added=added):
        seen.append("output")
    assert seen[0] == "added" and seen.count("added") == 1 and len(seen) > 1

    async def fails() -> None:
        raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        await collect_with(engine, PROMPTS[1], greedy(140), "announce-fails", fails)
    assert not engine.output_processor.has_unfinished_requests()  # aborted at once, not left to run
    await assert_blocks_freed(engine)


async def collect_with(engine, prompt, params, request_id, on_added) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id, on_added=on_added)]


@in_module_loop
async def test_a_consumer_that_stops_aborts_its_request(engine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[1], greedy(140), "cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_blocks_freed(engine)
    stream = engine.generate(PROMPTS[1], greedy(140), "closed")
    await anext(stream)
    await stream.aclose()
    await assert_blocks_freed(engine)


@in_module_loop
async def test_stop_string_aborts_the_request_in_the_core(engine) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    full = (await collect(engine, PROMPTS[2], params, "full"))[-1].outputs[0]
    words = full.text.split()
    assert len(words) > 4, f"need visible words in {full.text!r}"
    stop = words[len(words) // 2]
    stopped = SamplingParams(**{**vars(params), "stop": [stop]})
    out = (await collect(engine, PROMPTS[2], stopped, "stopped"))[-1].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    await assert_blocks_freed(engine)


@in_module_loop
async def test_bad_input_raises_and_others_keep_running(engine) -> None:
    running = asyncio.create_task(collect(engine, PROMPTS[0], greedy(20), "good"))
    with pytest.raises(ValueError, match="longer than max_model_len=160"):
        await collect(engine, [1] * 400, greedy(5), "too-long")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        await collect(engine, "", greedy(5), "empty")
    outs = await running
    assert len(outs[-1].outputs[0].token_ids) == 20
    with pytest.raises(ValueError, match="already running"):
        await asyncio.gather(collect(engine, PROMPTS[0], greedy(5), "dup"),
                             collect(engine, PROMPTS[0], greedy(5), "dup"))
    await assert_blocks_freed(engine)


@in_module_loop
async def test_a_dead_core_process_raises_instead_of_hanging(tiny_model_dir) -> None:
    from engine.async_llm import AsyncLLM
    from engine.core_client import AsyncMPClient, EngineDeadError

    llm = AsyncLLM(config(tiny_model_dir("llama")), multiprocess=True)
    try:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate(PROMPTS[1], greedy(140), "doomed"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        assert isinstance(llm.engine_core, AsyncMPClient)
        llm.engine_core.proc.kill()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(llm, PROMPTS[0], greedy(5), "after"), 10)
    finally:
        llm.shutdown()


def test_sync_process_client_serves_requests_and_cleans_up(tiny_model_dir, hf_greedy) -> None:
    from engine.core.outputs import EngineCoreRequest
    from engine.core_client import SyncMPClient

    client = SyncMPClient(config(tiny_model_dir("llama")))
    tmpdir = Path(client._tmpdir)
    try:
        assert client.config.max_model_len == 160 and client.vocab_size == 49152
        client.add_request(EngineCoreRequest("a", PROMPTS[1], greedy(6)))
        tokens: list[int] = []
        while True:
            (out,) = client.get_output().outputs
            tokens += out.new_token_ids
            if out.finished:
                break
        assert tokens == hf_greedy(tiny_model_dir("llama"), [PROMPTS[1]], 6)[0]
        stats = client.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        client.shutdown()
    assert not client.proc.is_alive() and not tmpdir.exists()


def test_a_core_that_cannot_start_reports_why(tiny_model_dir) -> None:
    from engine.core_client import SyncMPClient

    bad = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=160, num_kv_blocks=3)
    with pytest.raises(ValueError, match="cannot hold one request"):
        SyncMPClient(bad)
