"""The OpenAI router end to end, driven by the official `openai` client: over a prefill worker and
a decode worker (real KV store) and over a colocated worker, greedy completions and chats equal the
offline `LLM`'s; usage counts the tokens; stop strings cut the text; n fans out; concurrent
streams all finish; bad input is a 4xx OpenAI error naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter, free_port

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> dict[str, str]:
    """The reference: the offline engine's greedy text for the prompt and the chat."""
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        text = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
        return {"text": text.text, "chat": chat.text, "text_tokens": str(len(text.token_ids)),
                "first_id": str(text.token_ids[0]),
                "chat_tokens": str(len(chat.token_ids))}


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def router(request: pytest.FixtureRequest, workers: dict[str, WorkerServer], model_dir: Path
           ) -> Iterator[ServedRouter]:
    if request.param == "disaggregated":
        dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,),
                                   prefill_timeout_s=30, decode_timeout_s=60)
    else:
        dispatch = DispatchOptions(decode=(workers["colocated"].target,), decode_timeout_s=60)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


@in_module_loop
async def test_greedy_completion_equals_offline_llm(client: openai.AsyncOpenAI, offline: dict[str, str],
                                                    model_dir: Path) -> None:
    from engine.model.loader import load_tokenizer

    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].text == offline["text"]
    prompt_tokens = len(load_tokenizer(model_dir)(PROMPT).input_ids)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens,
                                                                      int(offline["text_tokens"]))
    assert out.usage.total_tokens == prompt_tokens + int(offline["text_tokens"])


@in_module_loop
async def test_streamed_completion_concatenates_to_the_same_text(client: openai.AsyncOpenAI,
                                                                  offline: dict[str, str]) -> None:
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == int(offline["text_tokens"])


@in_module_loop
async def test_chat_stream_and_non_stream_equal_offline_chat(client: openai.AsyncOpenAI,
                                                             offline: dict[str, str]) -> None:
    out = await client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                               max_completion_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].message.content == offline["chat"]
    assert out.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                  max_tokens=NEW_TOKENS, temperature=0, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == offline["chat"]


@in_module_loop
async def test_stop_string_cuts_the_text_before_it(client: openai.AsyncOpenAI, offline: dict[str, str]
                                                   ) -> None:
    reference = offline["text"]
    stop = reference[len(reference) // 2:len(reference) // 2 + 2]
    cut = reference[:reference.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                     temperature=0, stop=[stop], stream=True)
            parts = [c async for c in chunks]
            text = "".join(c.choices[0].text for c in parts)
            finish = parts[-1].choices[0].finish_reason
        else:
            out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                  temperature=0, stop=stop)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")


@in_module_loop
async def test_n_samples_each_get_a_choice(client: openai.AsyncOpenAI, offline: dict[str, str]) -> None:
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert [c.text for c in out.choices] == [offline["text"]] * 2
    assert out.usage is not None and out.usage.completion_tokens == 2 * int(offline["text_tokens"])


@in_module_loop
async def test_eight_concurrent_streams_all_finish(client: openai.AsyncOpenAI, offline: dict[str, str]
                                                   ) -> None:
    async def one() -> str:
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    assert await asyncio.gather(*(one() for _ in range(8))) == [offline["text"]] * 8


@in_module_loop
async def test_models_and_health(router: ServedRouter, client: openai.AsyncOpenAI) -> None:
    cards = [m async for m in client.models.list()]
    assert [m.id for m in cards] == [MODEL]
    # vLLM's card: when the router began serving it, who serves it, the context limit
    assert 0 < time.time() - cards[0].created < 3600 and cards[0].owned_by == "pdserve"
    assert (cards[0].model_extra or {}).get("max_model_len", 0) > 0
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"http://127.0.0.1:{router.port}/health")).status_code == 200


BAD = [
    ("/completions", b"{not json", 400, None),
    ("/completions", b'{"prompt": "hi"}', 400, "model"),
    ("/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/completions", b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "n": 0}', 400, "n"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "nobody", "content": "x"}]}', 400,
     "messages[0].role"),
    ("/completions", b'{"model": "other", "prompt": "hi"}', 404, "model"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "presence_penalty": 3}', 400, "presence_penalty"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "top_k": -5}', 400, "top_k"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "min_tokens": 9}', 400,
     "min_tokens"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "ignore_eos": "yes"}', 400, "ignore_eos"),
    ("/completions", b'{"model": "tiny", "prompt": [1, 99999999]}', 400, "prompt"),
]


@in_module_loop
async def test_vllm_sampling_extras_reach_the_engine(client: openai.AsyncOpenAI, offline: dict[str, str]
                                                     ) -> None:
    """ignore_eos and min_tokens fix the length, top_k=1 is greedy, a stop token id ends it."""
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=1.0,
                                          extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 2})
    assert out.choices[0].text == offline["text"] and out.usage is not None
    assert out.usage.completion_tokens == NEW_TOKENS
    stopped = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [int(offline["first_id"])]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    assert stopped.usage.completion_tokens == 1


@in_module_loop
@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
async def test_bad_input_is_an_openai_error_naming_the_field(router: ServedRouter, path: str, body: bytes,
                                                             status: int, param: str | None) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{router.base_url}{path}", content=body,
                                headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@in_module_loop
async def test_logprobs_come_one_per_token(client: openai.AsyncOpenAI, offline: dict[str, str]) -> None:
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          logprobs=2)
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == offline["text"]
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == int(offline["text_tokens"])
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    # text_offset: where each token's string starts, in the streamed case across chunks too
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                             temperature=0, logprobs=2, stream=True)
    offsets = [o for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset or []]
    assert offsets == logprobs.text_offset
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
                                                top_logprobs=2)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert len(chat.choices[0].logprobs.content) == int(offline["chat_tokens"])


@in_module_loop
async def test_a_dead_prefill_worker_falls_back_to_the_decode_worker(workers: dict[str, WorkerServer],
                                                                     model_dir: Path,
                                                                     offline: dict[str, str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    dispatch = DispatchOptions(prefill=(dead,), decode=(workers["decode"].target,), prefill_timeout_s=5,
                               decode_timeout_s=60)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0) as c:
            out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                             temperature=0)
    assert out.choices[0].text == offline["text"]


@in_module_loop
async def test_a_stop_string_ends_the_decode_request_early(client: openai.AsyncOpenAI,
                                                           workers: dict[str, WorkerServer],
                                                           offline: dict[str, str]) -> None:
    from services.worker.client import WorkerClient

    stop = offline["text"][2:4]
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0,
                                          stop=stop)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens <= int(offline["text_tokens"])
    for role in ("decode", "colocated"):
        async with WorkerClient(workers[role].target) as worker:
            deadline = time.monotonic() + 10
            while (await worker.load()).num_running:
                assert time.monotonic() < deadline, f"the {role} worker still runs the stopped request"
                await asyncio.sleep(0.05)
