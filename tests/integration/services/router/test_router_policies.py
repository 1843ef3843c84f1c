"""The router's policies over real workers (tiny model, real KV store, real HTTP): API key,
admission control (429 + Retry-After), /metrics with vLLM's names, /health without a decode
worker, prefix-aware placement, and conditional disaggregation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter, free_port

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
# 70 tokens or so on the tiny model's tokenizer: several 16-token blocks to match.
LONG = "The history of the city goes back many centuries, " * 6


def config(model_dir: Path, dispatch: DispatchOptions, **kw: object) -> RouterConfig:
    kw.setdefault("worker_networks", ("127.0.0.0/8",))  # workers added through the admin API here
    return RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch,
                        **kw)  # type: ignore[arg-type]


@in_module_loop
async def test_api_key_guards_v1_but_not_health_or_metrics(workers: dict[str, WorkerServer],
                                                           model_dir: Path) -> None:
    dispatch = DispatchOptions(decode=(workers["colocated"].target,))
    with ServedRouter(config(model_dir, dispatch, api_keys=("s3cret",))) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as err:
                await bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert err.value.status_code == 401
            body = err.value.body
            assert isinstance(body, dict) and body["code"] == "invalid_api_key"
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{served.base_url}/models")).status_code == 401
            assert (await http.get(f"{served.base_url}/models/{MODEL}")).status_code == 401
            for path in ("/tokenize", "/detokenize"):
                assert (await http.post(f"{served.url}{path}", json={"prompt": "hi"})).status_code == 401
            for path in ("/health", "/metrics", "/ping", "/version", "/livez"):
                assert (await http.get(f"{served.url}{path}")).status_code == 200, path
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="s3cret", max_retries=0) as good:
            out = await good.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
            assert out.usage is not None and out.usage.completion_tokens == 2


TENANT_PROMPT = "A private contract between the two parties states that " * 8  # several blocks


async def _cached(c: openai.AsyncOpenAI, salt: str | None = None) -> tuple[str, int]:
    """(text, cached prompt tokens) of TENANT_PROMPT, greedy, with `salt` as its cache_salt."""
    out = await c.completions.create(model=MODEL, prompt=TENANT_PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"cache_salt": salt} if salt is not None else None)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens or 0


@in_module_loop
async def test_with_tenant_cache_salt_a_tenant_cannot_probe_another_tenant_s_cache(
        workers: dict[str, WorkerServer], model_dir: Path, tmp_path: Path) -> None:
    from services.router.http.api_keys import load_api_keys
    from services.router.http.tenants import tenant_salt

    key_file = tmp_path / "keys"
    key_file.write_text("# one key per tenant\nkey-alice\nkey-bob  # second tenant\n")
    keys = load_api_keys(None, str(key_file), {})
    dispatch = DispatchOptions(decode=(workers["colocated"].target,))
    with ServedRouter(config(model_dir, dispatch, api_keys=keys, tenant_cache_salt=True)) as served:
        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=served.base_url, api_key=key, max_retries=0, timeout=60)

        async with client("key-alice") as alice, client("key-bob") as bob, client("key-eve") as eve:
            first = await _cached(alice)
            assert first[1] == 0
            assert await _cached(bob) == (first[0], 0)  # same tokens, nothing of alice's KV
            # naming alice's tenant salt as a cache_salt still lands in bob's own space
            assert await _cached(bob, tenant_salt("key-alice")) == (first[0], 0)
            text, hit = await _cached(alice)
            assert text == first[0] and hit >= 48
            with pytest.raises(openai.AuthenticationError):
                await _cached(eve)


@in_module_loop
@pytest.mark.parametrize("split", [False, True], ids=["colocated", "split"])
async def test_cache_salt_separates_cached_prefixes_and_never_changes_tokens(
        workers: dict[str, WorkerServer], model_dir: Path, split: bool) -> None:
    dispatch = (DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,))
                if split else DispatchOptions(decode=(workers["colocated"].target,)))
    with ServedRouter(config(model_dir, dispatch)) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            tag = f"salt-{split}"
            first = await _cached(c, f"{tag}-1")
            assert first[1] == 0
            assert await _cached(c, f"{tag}-2") == (first[0], 0)
            text, hit = await _cached(c, f"{tag}-1")
            assert text == first[0] and hit >= 48
            assert (await _cached(c))[0] == first[0]  # unsalted: the same tokens
            with pytest.raises(openai.BadRequestError) as e:
                await _cached(c, "")
            assert e.value.param == "cache_salt"


@in_module_loop
async def test_admission_control_answers_429_with_retry_after_and_never_5xx(
        workers: dict[str, WorkerServer], model_dir: Path) -> None:
    """max_waiting=1 and a slow load refresh: of a burst, the first request is admitted and the
    rest are refused until the next load report; none fails otherwise."""
    dispatch = DispatchOptions(decode=(workers["colocated"].target,), refresh_s=1.0)
    with ServedRouter(config(model_dir, dispatch, max_waiting=1)) as served:
        await asyncio.sleep(0.3)  # the first load report is in
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as http:
            replies = await asyncio.gather(*(http.post(f"{served.base_url}/completions", json=body)
                                             for _ in range(6)))
            codes = sorted(r.status_code for r in replies)
            assert codes[0] == 200 and 429 in codes and set(codes) <= {200, 429}, codes
            refused = next(r for r in replies if r.status_code == 429)
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert "queued" in refused.json()["error"]["message"]
            await asyncio.sleep(1.5)  # a fresh load report: the worker is idle again
            assert (await http.post(f"{served.base_url}/completions", json=body)).status_code == 200
        assert served.metric("pdserve:router_rejected_total") == codes.count(429)


@in_module_loop
async def test_metrics_follow_vllm_names_and_count_what_was_served(workers: dict[str, WorkerServer],
                                                                   model_dir: Path) -> None:
    dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,))
    with ServedRouter(config(model_dir, dispatch)) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            outs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=f"Story {i}:",
                                                               max_tokens=5, temperature=0)
                                          for i in range(4)))
            stream = await c.completions.create(model=MODEL, prompt="Count:", max_tokens=6,
                                                temperature=0, stream=True)
            async for _ in stream:
                pass
        generated = sum(o.usage.completion_tokens for o in outs if o.usage) + 6
        prompts = sum(o.usage.prompt_tokens for o in outs if o.usage)
        assert served.metric("vllm:generation_tokens_total") == generated
        assert served.metric("vllm:prompt_tokens_total") > prompts  # plus the streamed prompt
        assert served.metric("vllm:time_to_first_token_seconds_count") == 5
        assert served.metric("vllm:e2e_request_latency_seconds_count") == 5
        assert served.metric("vllm:inter_token_latency_seconds_count") >= 4  # tokens after the first
        assert served.metric("vllm:request_success_total", finished_reason="length") == 5
        assert served.metric("vllm:num_requests_running") == 0
        assert served.metric("pdserve:router_decisions_total", decision="disaggregated") == 5
        for role, w in (("prefill", workers["prefill"]), ("decode", workers["decode"])):
            assert served.metric("pdserve:worker_healthy", worker=w.target, role=role) == 1
            assert served.metric("pdserve:worker_requests_dispatched", worker=w.target, role=role) == 5


@in_module_loop
async def test_without_a_healthy_decode_worker_health_and_requests_answer_503(model_dir: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    dispatch = DispatchOptions(decode=(dead,), refresh_s=0.1)
    with ServedRouter(config(model_dir, dispatch)) as served:
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(100):  # the first failed load report marks it unhealthy
                health = await http.get(f"{served.url}/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert health.status_code == 503 and health.json()["pools"]["colocated"]["healthy"] == 0
            r = await http.post(f"{served.base_url}/completions",
                                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "worker_unavailable"


@in_module_loop
async def test_prefix_aware_sends_a_repeated_prompt_where_it_is_cached(
        workers: dict[str, WorkerServer], colocated_worker: WorkerServer, model_dir: Path) -> None:
    targets = (workers["colocated"].target, colocated_worker.target)
    dispatch = DispatchOptions(decode=targets, decode_policy="prefix_aware")
    with ServedRouter(config(model_dir, dispatch)) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            cached = []
            for i in range(4):
                out = await c.completions.create(model=MODEL, prompt=LONG + f" Part {i}.",
                                                 max_tokens=2, temperature=0)
                assert out.usage is not None and out.usage.prompt_tokens_details is not None
                cached.append(out.usage.prompt_tokens_details.cached_tokens)
        counts = [served.metric("pdserve:worker_requests_dispatched", worker=t) for t in targets]
        assert sorted(counts) == [0, 4], counts  # one worker got every request sharing the prefix
        assert cached[0] == 0 and all(c and c >= 48 for c in cached[1:]), cached


@in_module_loop
async def test_conditional_disaggregation_computes_short_uncached_parts_on_decode(
        workers: dict[str, WorkerServer], model_dir: Path) -> None:
    """local_prefill_tokens=16: a new long prompt goes through the prefill worker; the same prompt
    again has at most 16 uncached tokens on the decode worker, which then computes it itself."""
    dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,),
                               local_prefill_tokens=16)
    with ServedRouter(config(model_dir, dispatch)) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            texts = [(await c.completions.create(model=MODEL, prompt=LONG + " Again.", max_tokens=6,
                                                 temperature=0)).choices[0].text for _ in range(2)]
        assert texts[0] == texts[1]
        assert served.metric("pdserve:router_decisions_total", decision="disaggregated") == 1
        assert served.metric("pdserve:router_decisions_total", decision="local_prefill") == 1
        assert served.metric("pdserve:worker_requests_dispatched", role="prefill") == 1


@in_module_loop
async def test_disaggregated_logprobs_equal_colocated_ones(workers: dict[str, WorkerServer],
                                                           model_dir: Path) -> None:
    """The first token's logprobs come from the prefill worker, the rest from decode; together
    they equal what one colocated worker computes."""
    split = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,))
    alone = DispatchOptions(decode=(workers["colocated"].target,))
    got = []
    for dispatch in (split, alone):
        with ServedRouter(config(model_dir, dispatch)) as served:
            async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
                out = await c.completions.create(model=MODEL, prompt="Logprobs of this prompt",
                                                 max_tokens=5, temperature=0, logprobs=3)
                got.append(out.choices[0].logprobs)
            if dispatch is split:
                assert served.metric("pdserve:router_decisions_total", decision="disaggregated") == 1
    (a, b) = got
    assert a is not None and b is not None and a.tokens == b.tokens and len(a.tokens or []) == 5
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    for pa, pb_ in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
        assert pa.keys() == pb_.keys() and list(pa.values()) == pytest.approx(list(pb_.values()), abs=1e-4)


@in_module_loop
async def test_workers_join_and_leave_by_draining_without_failing_a_request(
        workers: dict[str, WorkerServer], colocated_worker: WorkerServer, model_dir: Path) -> None:
    a, b = workers["colocated"].target, colocated_worker.target
    dispatch = DispatchOptions(decode=(a,), decode_policy="least_loaded")
    with ServedRouter(config(model_dir, dispatch)) as served:
        admin = f"{served.url}/admin/workers"
        async with httpx.AsyncClient(timeout=30) as http, \
                openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            assert (await http.post(admin, json={"role": "colocated", "target": b})).status_code == 200
            for _ in range(50):  # b takes requests after its first load report
                listed = {w["target"]: w for w in (await http.get(admin)).json()["workers"]}
                if listed[b]["healthy"]:
                    break
                await asyncio.sleep(0.05)
            assert listed[b]["healthy"] and not listed[b]["draining"]
            long = await c.completions.create(model=MODEL, prompt="A long story:", max_tokens=300,
                                              temperature=0, stream=True)
            first = await anext(aiter(long))  # running on one of the two
            on = next(w for w in (await http.get(admin)).json()["workers"] if w["inflight"])["target"]
            r = await http.post(f"{admin}/drain", json={"role": "colocated", "target": on})
            assert r.status_code == 200 and r.json()["inflight"] == 1
            busy = await http.post(f"{admin}/remove", json={"role": "colocated", "target": on})
            assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
            others = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=f"Q{i}", max_tokens=3,
                                                                 temperature=0) for i in range(4)))
            assert all(o.choices[0].finish_reason == "length" for o in others)
            rest = [chunk async for chunk in long]  # the drained worker finishes what it had
            assert first.choices and rest[-1].choices[0].finish_reason == "length"
            other = b if on == a else a
            listed = {w["target"]: w for w in (await http.get(admin)).json()["workers"]}
            assert listed[on]["dispatched"] == 1 and listed[other]["dispatched"] == 4
            gone = await http.post(f"{admin}/remove", json={"role": "colocated", "target": on})
            assert gone.status_code == 200
            assert [w["target"] for w in (await http.get(admin)).json()["workers"]] == [other]
            bad = await http.post(admin, json={"role": "prefill", "target": b})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
            bad = await http.post(admin, json={"role": "colocated", "target": "no port"})
            assert bad.status_code == 400


@in_module_loop
async def test_a_new_worker_takes_its_share_of_a_shared_system_prompt_chat_load_within_seconds(
        workers: dict[str, WorkerServer], colocated_worker: WorkerServer, model_dir: Path) -> None:
    """Every chat request starts with the same system prompt (and the template's tokens): cached
    on the worker that served them. A worker registered under that load (prefix_aware, the
    default) still gets a fair share of the next requests, from its first load report on."""
    a, b = workers["colocated"].target, colocated_worker.target
    system = {"role": "system", "content": "You are a helpful assistant. " + LONG}
    with ServedRouter(config(model_dir, DispatchOptions(decode=(a,)))) as served:
        admin = f"{served.url}/admin/workers"
        served_by: list[str] = []
        async with httpx.AsyncClient(timeout=30) as http, \
                openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=60) as c:

            async def user(u: int, n: int) -> None:
                for i in range(n):
                    out = await c.chat.completions.create(
                        model=MODEL, messages=[system, {"role": "user", "content": f"User {u} asks {i}"}],
                        max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
                    assert out.choices[0].finish_reason == "length"

            await asyncio.gather(*(user(u, 2) for u in range(4)))  # a's cache holds the prefix
            registered = asyncio.get_running_loop().time()
            assert (await http.post(admin, json={"role": "colocated", "target": b})).status_code == 200
            before = {w["target"]: w["dispatched"] for w in (await http.get(admin)).json()["workers"]}
            await asyncio.gather(*(user(u, 4) for u in range(4)))  # 16 requests, 4 at a time
            took = asyncio.get_running_loop().time() - registered
            after = {w["target"]: w["dispatched"] for w in (await http.get(admin)).json()["workers"]}
            served_by = [f"{t}: {after[t] - before.get(t, 0)}" for t in (a, b)]
            assert after[b] - before.get(b, 0) >= 4, served_by  # a fair share is 8 of 16
            assert took < 60
