"""Worker metrics end to end: a prefill and a decode worker with a `metrics_port` serve /metrics
over HTTP; after real requests the scraped counters equal what the requests did (tokens
generated, prompt tokens, KV saved by the prefill worker and loaded by the decode worker), the
queue gauges are back to 0, RPCs are counted by status code, and the Load RPC carries the prefix
cache summary. Stopping a worker closes its metrics endpoint. Samples are labelled with the served
model name, the role and the process's instance id."""

from __future__ import annotations

import asyncio
import random
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from kvstore.service import KVStoreService
from services.procs import free_port
from services.worker.client import WorkerClient, WorkerError
from services.worker.server import WorkerOptions, WorkerServer

in_module_loop = pytest.mark.asyncio(loop_scope="module")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd(model_dir: Path, store: KVStoreService) -> AsyncIterator[dict[str, WorkerServer]]:
    """A prefill and a decode worker, each serving metrics on a free port."""
    config = EngineConfig(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96,
                          kv_store_url=store.location)
    servers = {role: WorkerServer(WorkerOptions(role=role, engine=config, grace_s=5.0, port=free_port(),
                                                metrics_port=free_port()))
               for role in ("prefill", "decode")}
    try:
        await asyncio.gather(*(s.start() for s in servers.values()))
        yield servers
    finally:
        for server in servers.values():
            await server.stop(grace_s=1.0)


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


async def scrape(server: WorkerServer) -> Samples:
    assert server.metrics_port is not None
    text = await asyncio.to_thread(fetch, server.metrics_port)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, server: WorkerServer, name: str, **labels: str) -> float:
    """The sample's value (0 when absent, as for a counter never incremented)."""
    key = {"model_name": server.options.model_name, "role": server.options.role,
           "instance": server.servicer.instance_id, **labels}
    return samples.get((name, frozenset(key.items())), 0.0)


async def decode_tokens(client: WorkerClient, request_id: str, ids: list[int], n: int,
                        kv: dict[str, object] | None = None) -> int:
    """Streams a Decode call; returns the completion tokens its usage reports."""
    chunks = [c async for c in client.decode(request_id, ids, greedy(n), kv)]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == chunks[-1].usage.completion_tokens
    return chunks[-1].usage.completion_tokens


@in_module_loop
async def test_scrape_counts_generated_and_prompt_tokens_and_queues_return_to_zero(
        pd: dict[str, WorkerServer]) -> None:
    decode = pd["decode"]
    before = await scrape(decode)
    assert value(before, decode, "pdserve:engine_up") == 1.0
    prompts = [prompt_of(20, 1), prompt_of(45, 2), prompt_of(70, 3)]
    async with WorkerClient(decode.target) as client:
        generated = await asyncio.gather(*(decode_tokens(client, f"gen-{i}", p, 4 + i)
                                           for i, p in enumerate(prompts)))
    after = await scrape(decode)
    assert sum(generated) == 4 + 5 + 6

    def delta(name: str, **labels: str) -> float:
        return value(after, decode, name, **labels) - value(before, decode, name, **labels)

    assert delta("vllm:generation_tokens_total") == sum(generated)
    assert delta("vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("vllm:prefix_cache_queries_total") >= sum(len(p) for p in prompts)
    assert value(after, decode, "vllm:num_requests_running") == 0
    assert value(after, decode, "vllm:num_requests_waiting") == 0
    assert value(after, decode, "vllm:kv_cache_usage_perc") == 0.0
    assert value(after, decode, "pdserve:kv_cache_total_blocks") == 95
    # At least one prefill step and one decode step per token after the first.
    steps = delta("pdserve:engine_step_seconds_count")
    assert steps >= 6 - 1
    assert value(after, decode, "pdserve:engine_step_seconds_bucket", le="+Inf") == \
        value(after, decode, "pdserve:engine_step_seconds_count")
    assert delta("pdserve:engine_step_seconds_sum") > 0
    assert delta("pdserve:worker_rpcs_total", method="Decode", code="OK") == 3


@in_module_loop
async def test_prefill_saves_and_decode_loads_kv_in_the_metrics(pd: dict[str, WorkerServer]) -> None:
    prefill, decode = pd["prefill"], pd["decode"]
    p_before, d_before = await scrape(prefill), await scrape(decode)
    prompt = prompt_of(40, 4)
    async with WorkerClient(prefill.target) as p, WorkerClient(decode.target) as d:
        first = await p.prefill("pd-1", prompt, greedy(5), transfer_id="metrics-t1")
        assert first.kv_transfer_params is not None
        n = await decode_tokens(d, "pd-1", [*prompt, first.first_token_id], 4, first.kv_transfer_params)
    p_after, d_after = await scrape(prefill), await scrape(decode)

    def delta(server: WorkerServer, after: Samples, before: Samples, name: str, **labels: str) -> float:
        return value(after, server, name, **labels) - value(before, server, name, **labels)

    assert delta(prefill, p_after, p_before, "pdserve:kv_transfer_seconds_count", direction="save") > 0
    assert delta(prefill, p_after, p_before, "pdserve:kv_transfer_seconds_sum", direction="save") > 0
    saved = delta(prefill, p_after, p_before, "pdserve:kv_transfer_bytes_total", direction="save")
    loaded = delta(decode, d_after, d_before, "pdserve:kv_transfer_bytes_total", direction="load")
    assert delta(decode, d_after, d_before, "pdserve:kv_transfer_seconds_count", direction="load") == 1
    # The decode worker loads every KV payload byte the prefill worker saved (saved bytes also
    # count the small per-object metadata headers).
    assert 0 < loaded <= saved
    assert value(d_after, decode, "pdserve:kv_transfer_failures_total", direction="load") == 0
    assert value(p_after, prefill, "pdserve:kv_transfer_failures_total", direction="save") == 0
    assert value(d_after, decode, "pdserve:kv_integrity_failures_total") == 0  # every checksum verified
    assert delta(prefill, p_after, p_before, "vllm:generation_tokens_total") == 1
    assert delta(decode, d_after, d_before, "vllm:generation_tokens_total") == n == 4
    # The prompt counts once, where it was computed: the decode half continues it.
    assert delta(prefill, p_after, p_before, "vllm:prompt_tokens_total") == len(prompt)
    assert delta(decode, d_after, d_before, "vllm:prompt_tokens_total") == 0
    assert delta(prefill, p_after, p_before, "pdserve:worker_rpcs_total", method="Prefill", code="OK") == 1


@in_module_loop
async def test_load_reports_the_prefix_cache_summary(pd: dict[str, WorkerServer]) -> None:
    decode = pd["decode"]
    prompt = prompt_of(48, 5)  # 3 blocks of 16; a repeat can hit the first 2 (one token is computed)
    async with WorkerClient(decode.target) as client:
        before = await client.load()
        await decode_tokens(client, "prefix-1", prompt, 2)
        middle = await client.load()
        await decode_tokens(client, "prefix-2", prompt, 2)
        after = await client.load()
    samples = await scrape(decode)
    assert middle.prefix_cache_queries - before.prefix_cache_queries == 48
    assert middle.prefix_cache_hits == before.prefix_cache_hits  # a new prompt: no hit
    assert after.prefix_cache_queries - middle.prefix_cache_queries == 48
    assert after.prefix_cache_hits - middle.prefix_cache_hits == 32
    assert after.num_cached_blocks >= 3 and after.num_cached_blocks == middle.num_cached_blocks
    assert value(samples, decode, "vllm:prefix_cache_hits_total") == after.prefix_cache_hits
    assert value(samples, decode, "pdserve:prefix_cache_blocks") == after.num_cached_blocks


@in_module_loop
async def test_failed_rpcs_are_counted_by_status_code(pd: dict[str, WorkerServer]) -> None:
    decode = pd["decode"]
    before = await scrape(decode)
    async with WorkerClient(decode.target) as client:
        with pytest.raises(WorkerError) as err:
            await client.prefill("wrong-role", [5, 6], greedy(2))
        assert err.value.message.startswith("UNIMPLEMENTED")
        with pytest.raises(WorkerError) as err:
            await decode_tokens(client, "out-of-range", [10**6], 2)
        assert err.value.kind == "invalid"
        await client.load()
    after = await scrape(decode)

    def delta(method: str, code: str) -> float:
        return (value(after, decode, "pdserve:worker_rpcs_total", method=method, code=code)
                - value(before, decode, "pdserve:worker_rpcs_total", method=method, code=code))

    assert delta("Prefill", "UNIMPLEMENTED") == 1
    assert delta("Decode", "INVALID_ARGUMENT") == 1
    assert delta("Load", "OK") == 1


@in_module_loop
async def test_stopping_the_worker_closes_its_metrics_endpoint(pd: dict[str, WorkerServer]) -> None:
    prefill = pd["prefill"]  # the last test: the fixture's second stop is a no-op
    port = prefill.metrics_port
    assert port is not None
    await prefill.stop(grace_s=1.0)
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(fetch, port)


def test_metrics_port_is_off_unless_given() -> None:
    from services.cli import build_parser

    assert build_parser().parse_args(["worker", "--role", "decode"]).metrics_port is None
    assert build_parser().parse_args(["worker", "--role", "decode", "--metrics-port", "9100"]
                                     ).metrics_port == 9100
    assert WorkerOptions(role="decode").metrics_port is None
    with pytest.raises(ValueError, match="metrics_port"):
        WorkerOptions(role="decode", metrics_port=70000)


def test_the_model_name_label_is_the_served_name_pdserve_up_gives_every_worker() -> None:
    from services.cli import build_parser
    from services.up.specs import worker_args

    args = build_parser().parse_args(["worker", "--role", "decode", "--model", "/models/m",
                                      "--served-model-name", "m"])
    assert args.served_model_name == "m"
    config = EngineConfig(model="/models/m")
    assert WorkerOptions(role="decode", engine=config, served_model_name="m").model_name == "m"
    assert WorkerOptions(role="decode", engine=config).model_name == "/models/m"
    up = build_parser().parse_args(["up", "--model", "smollm2-135m-instruct"])
    argv = worker_args(up, "/cache/models/smollm2", "grpc://127.0.0.1:50071")
    assert argv[argv.index("--served-model-name") + 1] == "smollm2-135m-instruct"  # the router's --model
