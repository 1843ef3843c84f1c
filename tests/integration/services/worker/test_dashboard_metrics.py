"""What a vLLM Grafana dashboard reads, over a split setup: a prefill worker, a decode worker and
the router (real gRPC, real KV store, real HTTP), scraped after traffic. Every vLLM metric the
dashboard uses is on both workers; every sample of the three carries one `model_name` (the
served name, not the model's folder), and a `role` and an `instance`; and the sums README.md
documents count each prompt token once (per sample, as vLLM counts each of a request's `n`
samples), each generated token once, each sample once in the generation-length histogram, and
the router's per-request `n`."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.service import KVStoreService
from services.procs import free_port
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerOptions, WorkerServer
from tests.integration.services.conftest import engine_config
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-served"  # the served name: the workers' --served-model-name, the router's --model
WORKER_METRICS = (
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:time_per_output_token_seconds", "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_max_num_generation_tokens")
# (prompt, n, max_tokens): max_tokens 1 ends at the prefill worker (no decode call).
TRAFFIC = (("The history of the city goes back", 1, 5), ("Once upon a time there was", 1, 3),
           ("Count with me: one, two, three", 2, 4), ("Hello", 1, 1))


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scraped:
    """The three endpoints' samples after TRAFFIC, as Prometheus would hold them, and what the
    clients were told (usage)."""

    samples: list[Sample]
    # every family exposed (the store's too), with the labels its samples carry (None: no samples)
    families: dict[str, set[str] | None]
    prompt_tokens: list[int]  # per request, from usage
    completion_tokens: list[int]  # per request (all its samples), from usage
    samples_per_request: list[list[int]]  # each sample's completion tokens, per request

    def total(self, name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return sum(s.value for s in self.samples if s.name == name and where(s.labels))


def role_is(*roles: str) -> Callable[[dict[str, str]], bool]:
    return lambda labels: labels.get("role") in roles


WORKERS = role_is("prefill", "decode", "colocated")  # the README's {role!="router"}
ROUTER = role_is("router")


def scrape(url: str) -> list[Sample]:
    return parse(httpx.get(url, timeout=10).text)


def parse(text: str) -> list[Sample]:
    return [Sample(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def families(texts: list[str]) -> dict[str, set[str] | None]:
    """Family name -> the label names its samples carry; None for a family with no samples (a
    labelled counter that has counted nothing yet)."""
    out: dict[str, set[str] | None] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            labels = out.get(family.name)
            for s in family.samples:
                labels = (labels or set()) | set(s.labels)
            out[family.name] = labels
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(model_dir: Path, store: KVStoreService) -> AsyncIterator[Scraped]:
    config = engine_config(model_dir, kv_store_url=store.location)
    workers = {role: WorkerServer(WorkerOptions(role=role, engine=config, grace_s=5.0, port=free_port(),
                                                metrics_port=free_port(), served_model_name=MODEL))
               for role in ("prefill", "decode")}
    try:
        await asyncio.gather(*(w.start() for w in workers.values()))
        dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,))
        router = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch)
        with ServedRouter(router) as served:
            async with httpx.AsyncClient(timeout=60) as http:
                replies = await asyncio.gather(*(http.post(f"{served.base_url}/completions", json={
                    "model": MODEL, "prompt": prompt, "n": n, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}) for prompt, n, max_tokens in TRAFFIC))
            bodies = [r.raise_for_status().json() for r in replies]
            urls = [f"{served.url}/metrics",
                    *(f"http://127.0.0.1:{w.metrics_port}/metrics" for w in workers.values())]
            texts = [(await asyncio.to_thread(httpx.get, url, timeout=10)).text for url in urls]
            texts.append(generate_latest(store.server.metrics.registry).decode())
            samples = [s for text in texts[:3] for s in parse(text)]
        yield Scraped(samples, families(texts), [b["usage"]["prompt_tokens"] for b in bodies],
                      [b["usage"]["completion_tokens"] for b in bodies],
                      [[max_tokens] * n for _, n, max_tokens in TRAFFIC])
    finally:
        for w in workers.values():
            await w.stop(grace_s=1.0)


@in_module_loop
async def test_both_workers_serve_every_metric_the_dashboard_reads(split: Scraped) -> None:
    for role in ("prefill", "decode"):
        names = {s.name for s in split.samples if s.labels.get("role") == role}
        for name in WORKER_METRICS:
            assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= names, (role, name)
        info = [s for s in split.samples if s.name == "vllm:cache_config_info" and s.labels["role"] == role]
        assert len(info) == 1 and info[0].value == 1
        assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "96"
        assert info[0].labels["enable_prefix_caching"] == "True"
        assert info[0].labels["cache_dtype"] == "float32"


@in_module_loop
async def test_every_sample_has_one_model_name_a_role_and_an_instance(split: Scraped) -> None:
    labelled = [s for s in split.samples if not s.name.startswith(("python_", "process_"))]
    assert {s.labels.get("model_name") for s in labelled} == {MODEL}
    assert all(s.labels.get("instance") for s in labelled)
    roles = {s.labels.get("role") for s in labelled if not s.name.startswith("pdserve:worker_")}
    assert roles == {"router", "prefill", "decode"}
    # The router's view of its workers: `role` is the worker's pool.
    assert {s.labels["role"] for s in labelled if s.name == "pdserve:worker_healthy"} == {"prefill", "decode"}


@in_module_loop
async def test_dashboard_sums_count_each_prompt_token_once(split: Scraped) -> None:
    per_sample = sum(p * n for p, (_, n, _) in zip(split.prompt_tokens, TRAFFIC, strict=True))
    assert split.total("vllm:prompt_tokens_total", WORKERS) == per_sample
    assert split.total("vllm:request_prompt_tokens_sum", WORKERS) == per_sample
    assert split.total("vllm:request_prompt_tokens_count", WORKERS) == sum(n for _, n, _ in TRAFFIC)
    # The decode worker continues prompts the prefill worker computed: it counts none of them.
    assert split.total("vllm:prompt_tokens_total", role_is("decode")) == 0
    # The router counts a request's prompt once, whatever its n (what usage.prompt_tokens says).
    assert split.total("vllm:prompt_tokens_total", ROUTER) == sum(split.prompt_tokens)
    # The prefill worker looked each sample's prompt up in its prefix cache once (vLLM's queries).
    assert split.total("vllm:prefix_cache_queries_total", role_is("prefill")) == per_sample


@in_module_loop
async def test_dashboard_sums_count_each_generated_token_once(split: Scraped) -> None:
    generated = sum(split.completion_tokens)
    assert generated == sum(map(sum, split.samples_per_request))
    assert split.total("vllm:generation_tokens_total", WORKERS) == generated
    assert split.total("vllm:request_generation_tokens_sum", WORKERS) == generated
    # vLLM's "Request Generation Length" panel sums the histogram over every job: each sample
    # the clients received is one observation there, with its whole length (the prefill worker
    # counts only the sample its first token ended, max_tokens 1; the decode worker each sample
    # it continued, the prefill's first token included).
    assert split.total("vllm:request_generation_tokens_count", WORKERS) == sum(
        len(tokens) for tokens in split.samples_per_request)
    assert split.total("vllm:request_generation_tokens_count", role_is("prefill")) == sum(
        n for _, n, max_tokens in TRAFFIC if max_tokens == 1)
    assert split.total("vllm:generation_tokens_total", ROUTER) == generated
    # Each step counted what it computed: prompts where computed, every generated token.
    prompts = split.total("vllm:prompt_tokens_total", WORKERS)
    assert split.total("vllm:iteration_tokens_total_sum", WORKERS) == prompts + generated


@in_module_loop
async def test_request_histograms_observe_each_engine_request_and_the_router_each_client_request(
        split: Scraped) -> None:
    sampled = sum(n for _, n, _ in TRAFFIC)
    decoded = sum(n for _, n, max_tokens in TRAFFIC if max_tokens > 1)  # the rest ended at prefill
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert split.total(f"vllm:request_{name}_seconds_count", role_is("prefill")) == sampled
        assert split.total(f"vllm:request_{name}_seconds_count", role_is("decode")) == decoded
    # Between tokens: none on the prefill worker (one token each); on the decode worker all but
    # each request's first there (the sample's second token).
    assert split.total("vllm:time_per_output_token_seconds_count", role_is("prefill")) == 0
    assert split.total("vllm:time_per_output_token_seconds_count", role_is("decode")) == sum(
        n * (max_tokens - 2) for _, n, max_tokens in TRAFFIC if max_tokens > 1)
    assert split.total("vllm:request_params_n_sum", WORKERS) == sampled  # n = 1 each, once a sample
    assert split.total("vllm:request_params_n_count", ROUTER) == len(TRAFFIC)
    assert split.total("vllm:request_params_n_sum", ROUTER) == sampled
    assert split.total("vllm:request_max_num_generation_tokens_sum", ROUTER) == sum(
        max(tokens) for tokens in split.samples_per_request)


DASHBOARD = Path(__file__).resolve().parents[4] / "deploy" / "observe" / "grafana" / "pdserve-dashboard.json"
_METRIC = re.compile(r"\b((?:vllm|pdserve)[:_][A-Za-z0-9_:]*)(\{[^}]*\})?")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _family(name: str, known: dict[str, set[str] | None]) -> str | None:
    if name in known:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in known:
            return name.removesuffix(suffix)
    return None


@in_module_loop
async def test_the_shipped_dashboard_reads_only_metrics_and_labels_the_system_exposes(split: Scraped) -> None:
    """Every query of deploy/observe/grafana/pdserve-dashboard.json (and its variable) names a
    family the router, the workers or the store expose, and only labels those families carry
    (checked where the family has samples after this traffic: a migration counter that counted
    none yet has no labels to check)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    assert len(exprs) >= 25
    known = split.families
    used: set[str] = set()
    unchecked: list[str] = []
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names = _METRIC.findall(expr)
        assert names, expr
        for name, selector in names:
            family = _family(name, known)
            assert family is not None, f"{name} is exposed by no component ({expr})"
            used.add(family)
            labels = known[family]
            if labels is None:
                continue
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
                assert label in labels, f"{family} has no label {label} ({sorted(labels)}): {expr}"
        named = [f for n, _ in names if (f := _family(n, known)) is not None]
        if any(known[f] is None for f in named):
            unchecked.append(expr)  # (a family with no samples yet: its labels are unknown)
            continue
        for group in re.findall(r"by \(([^)]*)\)", expr):
            wanted = {g.strip() for g in group.split(",")} - {"le"}
            carried = set().union(*(known[f] or set() for f in named))
            assert wanted <= carried, f"by ({group}) names labels no family here carries: {expr}"
    # the P/D panels the dashboard promises
    for family in ("pdserve:handoff_seconds", "pdserve:kv_transfer_bytes", "pdserve:kv_transfer_seconds",
                   "pdserve_kvstore_hits", "pdserve_kvstore_evictions", "pdserve:router_migrations",
                   "pdserve:engine_restarts", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                   "vllm:request_queue_time_seconds", "pdserve:router_prefix_found_tokens"):
        assert family in used, family
    # only fault counters that counted nothing in this run go unchecked: migrations, failures,
    # rejections
    assert len(unchecked) <= 4, unchecked
