"""`pdserve up` on the default model (1 prefill + 1 decode worker, real KV store), driven by the
official `openai` client, sync and async: greedy completions and chats, streamed or not, equal the
offline `LLM`'s output token for token; stop strings, max_tokens, n, logprobs, usage and
stream_options behave as OpenAI documents; 32 concurrent streams all finish with the text each
request gets alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from engine.config import DEFAULT_MODEL
from engine.sampling_params import SamplingParams
from tests.integration.services.e2e_util import PdserveUp

MODEL = DEFAULT_MODEL
PROMPT = "The capital of France is"
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours."}]
NEW_TOKENS = 20
CONCURRENT_PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn Python is",
                      "Water boils at", "My favourite food is", "The sun rises in the",
                      "In 1492, Columbus", "A haiku about the sea:"]
CONCURRENT_TOKENS = 16
CONCURRENT_STREAMS = 32
ENGINE_ARGS = {"num_threads": 1, "kv_cache_gib": 0.5, "max_model_len": 2048}


@dataclass(frozen=True)
class Reference:
    """The offline engine's greedy output of one prompt: text, token ids, each token's text."""

    text: str
    token_ids: list[int]
    tokens: list[str]
    finish_reason: str
    prompt_tokens: int  # counted with the tokenizer directly (chat: template, no special tokens added)


@dataclass(frozen=True)
class Served:
    base_url: str
    completion: Reference
    chat: Reference


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """`pdserve up` on the default model; the offline references are computed while it starts."""
    from engine.detokenizer import decode_token
    from engine.llm import LLM
    from engine.model.loader import resolve_model_path

    try:
        resolve_model_path(MODEL)
    except Exception as e:  # any failure to find the weights means: cannot run here
        pytest.skip(f"the default model {MODEL!r} is not available here: {e}")
    up = PdserveUp(MODEL, "--num-threads", "1", "--kv-cache-gib", "0.5", "--max-model-len", "2048",
                   "--startup-timeout-s", "240")
    up.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        with LLM(model=MODEL, **ENGINE_ARGS) as llm:
            tok = llm.get_tokenizer()
            text_out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
            chat_out = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
        chat_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        refs = [Reference(o.text, list(o.token_ids), [decode_token(tok, t) for t in o.token_ids],
                          o.finish_reason or "", n)
                for o, n in ((text_out, len(tok(PROMPT).input_ids)),
                             (chat_out, len(tok(chat_text, add_special_tokens=False).input_ids)))]
        # Preconditions of the tests below: both run to max_tokens and have text to cut at a stop string.
        for ref in refs:
            assert (ref.finish_reason, len(ref.token_ids)) == ("length", NEW_TOKENS), ref
        up.wait_ready(timeout_s=240)
        yield Served(up.base_url, refs[0], refs[1])
    finally:
        assert up.stop() in (0, None), up.lines


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def async_client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=120)


def stop_within(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text` (not at its start) and the text cut before it."""
    for start in range(len(text) // 2, len(text) - 2):
        stop = text[start:start + 3]
        cut = text[:text.find(stop)]
        if stop.strip() and cut:
            return stop, cut
    raise AssertionError(f"no stop string in {text!r}")


# -- completions ---------------------------------------------------------------------------------


def test_completion_equals_offline_greedy_with_usage(client: openai.OpenAI, served: Served) -> None:
    ref = served.completion
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (ref.text, "length", 0)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        ref.prompt_tokens, NEW_TOKENS, ref.prompt_tokens + NEW_TOKENS)
    assert out.model == MODEL and out.object == "text_completion"


def test_streamed_completion_equals_offline_greedy_and_reports_usage_last(client: openai.OpenAI,
                                                                         served: Served) -> None:
    ref = served.completion
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) > 1, "the stream came in one piece"
    assert "".join(c.choices[0].text for c in with_choices) == ref.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert all(c.usage is None for c in with_choices)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        ref.prompt_tokens, NEW_TOKENS, ref.prompt_tokens + NEW_TOKENS)


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI, served: Served) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                            stream=True))
    assert all(c.choices and c.usage is None for c in chunks)
    assert served.completion.text.startswith("".join(c.choices[0].text for c in chunks))


def test_completion_logprobs_give_the_offline_tokens(client: openai.OpenAI, served: Served) -> None:
    ref = served.completion
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == ref.text
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert lp.tokens == ref.tokens  # token for token
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == NEW_TOKENS
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled <= 0 and top, (sampled, top)
        assert all(sampled >= alt - 1e-5 for alt in top.values()), (sampled, top)  # greedy: the best


def test_top_logprobs_hold_the_requested_number_of_tokens(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.top_logprobs is not None
    assert [len(top) for top in out.choices[0].logprobs.top_logprobs] == [2] * 4
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert [len(p.top_logprobs) for p in chat.choices[0].logprobs.content] == [2] * 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_stop_string_cuts_before_it(client: openai.OpenAI, served: Served, stream: bool) -> None:
    stop, cut = stop_within(served.completion.text)
    if stream:
        chunks = [c for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=[stop, "never seen"],
            stream=True, stream_options={"include_usage": True})]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                        stop=stop)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert (text, finish) == (cut, "stop")
    assert usage is not None and usage.completion_tokens < NEW_TOKENS  # the decode ended early


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_ends_with_length(client: openai.OpenAI, served: Served, stream: bool) -> None:
    limit = 5
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit, temperature=0)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == limit
    assert served.completion.text.startswith(text) and text


def test_n_2_greedy_gives_two_equal_choices(client: openai.OpenAI, served: Served) -> None:
    ref = served.completion
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert [c.text for c in out.choices] == [ref.text, ref.text]
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.prompt_tokens, 2 * NEW_TOKENS)


def test_streamed_n_2_interleaves_two_complete_choices(client: openai.OpenAI, served: Served) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                            n=2, stream=True, stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {0: served.completion.text, 1: served.completion.text}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * NEW_TOKENS


# -- chat ----------------------------------------------------------------------------------------


async def test_chat_equals_offline_greedy_with_usage(served: Served) -> None:
    ref = served.chat
    async with async_client(served) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES,
                                              max_completion_tokens=NEW_TOKENS, temperature=0)
    choice = out.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ref.text,
                                                                                   "length")
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        ref.prompt_tokens, NEW_TOKENS, ref.prompt_tokens + NEW_TOKENS)
    assert out.object == "chat.completion"


async def test_streamed_chat_equals_offline_greedy_and_reports_usage_last(served: Served) -> None:
    ref = served.chat
    async with async_client(served) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in with_choices) == ref.text
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        ref.prompt_tokens, NEW_TOKENS, ref.prompt_tokens + NEW_TOKENS)


async def test_chat_logprobs_give_the_offline_tokens(served: Served) -> None:
    ref = served.chat
    async with async_client(served) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                              temperature=0, logprobs=True, top_logprobs=2)
    assert out.choices[0].message.content == ref.text
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content is not None
    assert [p.token for p in content] == ref.tokens  # token for token
    for p in content:
        assert p.logprob <= 0 and p.top_logprobs, p
        assert all(p.logprob >= alt.logprob - 1e-5 for alt in p.top_logprobs), p
        assert p.bytes == list(p.token.encode())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_stop_string_cuts_before_it(served: Served, stream: bool) -> None:
    stop, cut = stop_within(served.chat.text)
    async with async_client(served) as c:
        if stream:
            chunks = [ch async for ch in await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stop=stop, stream=True)]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            out = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                  temperature=0, stop=[stop])
            text, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
    assert (text, finish) == (cut, "stop")


async def test_chat_n_2_and_max_tokens(served: Served) -> None:
    async with async_client(served) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                              n=2)
    assert sorted(ch.index for ch in out.choices) == [0, 1]
    texts = [ch.message.content for ch in out.choices]
    assert texts[0] == texts[1] and texts[0] and served.chat.text.startswith(texts[0])
    assert [ch.finish_reason for ch in out.choices] == ["length", "length"]
    assert out.usage is not None and out.usage.completion_tokens == 12


# -- concurrency ---------------------------------------------------------------------------------


async def test_32_concurrent_streams_all_finish_with_their_text_alone(served: Served) -> None:
    async with async_client(served) as c:

        async def one(prompt: str) -> tuple[str, str | None, int]:
            stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=CONCURRENT_TOKENS,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            usage = chunks[-1].usage
            assert usage is not None
            return "".join(ch.choices[0].text for ch in chunks if ch.choices), finish, usage.completion_tokens

        alone = {p: await asyncio.wait_for(one(p), 60) for p in CONCURRENT_PROMPTS}
        prompts = [CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)] for i in range(CONCURRENT_STREAMS)]
        start = time.monotonic()
        together = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 150)
        elapsed = time.monotonic() - start
    assert len(together) == CONCURRENT_STREAMS
    mismatched = [(p, got, alone[p]) for p, got in zip(prompts, together, strict=True) if got != alone[p]]
    assert not mismatched, f"{len(mismatched)} of {CONCURRENT_STREAMS} differ from alone ({elapsed:.1f} s)"
