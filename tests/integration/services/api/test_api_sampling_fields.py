"""Sampling and prompt fields through the router (the official openai client, a real colocated
worker), issue 18: logit_bias, allowed_token_ids, bad_words and priority change the output as
vLLM's do and bad values are 400s naming the field; completions `echo` (with and without
logprobs) and vLLM's `prompt_logprobs` equal transformers' log-softmax of the prompt positions;
other model kinds' endpoints are 400s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPT = "The capital of France is"
PROMPTS = [PROMPT, "Once upon a time there"]


def _ids(router: ServedRouter, text: str) -> list[int]:
    r = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": text,
                                                   "add_special_tokens": False}, timeout=10)
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def _prompt_ids(router: ServedRouter, text: str) -> list[int]:
    """The tokens generation prefills for `text` (special tokens added)."""
    r = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=10)
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def _text(router: ServedRouter, ids: list[int]) -> str:
    r = httpx.post(f"{router.url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=10)
    r.raise_for_status()
    text: str = r.json()["prompt"]
    return text


async def _complete(client: openai.AsyncOpenAI, chat: bool, extra: dict[str, Any], max_tokens: int = 8
                    ) -> str:
    body = {"ignore_eos": True, **extra}
    if chat:
        out = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
            temperature=0, extra_body=body)
        return out.choices[0].message.content or ""
    done = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                           temperature=0, extra_body=body)
    return done.choices[0].text


@in_module_loop
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_logit_bias_and_allowed_token_ids_pick_the_tokens(client: openai.AsyncOpenAI,
                                                                router: ServedRouter, chat: bool) -> None:
    word = _ids(router, " Paris")
    forced = await _complete(client, chat, {"logit_bias": {str(word[0]): 100}}, max_tokens=4)
    assert forced == _text(router, [word[0]] * 4)
    allowed = await _complete(client, chat, {"allowed_token_ids": [word[0]]}, max_tokens=3)
    assert allowed == _text(router, [word[0]] * 3)
    # seeded sampling among two allowed tokens: only they come out
    two = _ids(router, " red blue")
    mixed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=3,
                                            extra_body={"allowed_token_ids": two, "ignore_eos": True})
    assert set(_ids(router, mixed.choices[0].text)) <= set(two)


@in_module_loop
async def test_bad_words_are_never_generated_even_when_biased_towards(client: openai.AsyncOpenAI,
                                                                     router: ServedRouter) -> None:
    the, spaced = _ids(router, "the"), _ids(router, " the")
    assert len(the) == len(spaced) == 1
    bias = {str(the[0]): 100, str(spaced[0]): 100}
    plain = await _complete(client, False, {"logit_bias": bias}, max_tokens=4)
    assert "the" in plain
    banned = await _complete(client, False, {"logit_bias": bias, "bad_words": ["the"]}, max_tokens=4)
    assert "the" not in banned and banned


@in_module_loop
@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {"not-a-token": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"999999": 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [999999]), ("allowed_token_ids", [-1]),
    ("bad_words", [""]), ("bad_words", "the"), ("priority", 1.5),
])
async def test_bad_values_are_400s_naming_the_field(client: openai.AsyncOpenAI, field: str,
                                                    value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await _complete(client, False, {field: value})
    assert e.value.param is not None and re.split(r"[.\[]", e.value.param)[0] == field, e.value.message


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_priority_on_a_worker_that_ignores_it_is_a_400(client: openai.AsyncOpenAI,
                                                             stream: bool) -> None:
    """The worker runs the fcfs policy: a priority it would ignore is refused, as vLLM does."""
    with pytest.raises(openai.BadRequestError) as e:
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=stream,
                                              extra_body={"priority": 3})
        if stream:
            async for _ in out:  # type: ignore[union-attr]
                pass
    assert e.value.param == "priority" and "scheduling_policy" in e.value.message
    await _complete(client, False, {"priority": 0})  # priority 0 asks for nothing: accepted


@in_module_loop
async def test_endpoints_of_other_model_kinds_are_400s_that_say_so(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.embeddings.create(model=MODEL, input="hello")
    assert e.value.code == "unsupported_endpoint" and "/v1/embeddings" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.moderations.create(input="hello")
    assert e.value.code == "unsupported_endpoint"


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return log_softmax


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ids", [False, True], ids=["text", "token-ids"])
async def test_echo_starts_each_choice_with_its_prompt(client: openai.AsyncOpenAI, router: ServedRouter,
                                                      stream: bool, ids: bool) -> None:
    prompts: Any = [_prompt_ids(router, p) for p in PROMPTS] if ids else PROMPTS
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "n": 2, "seed": 4,
                          "extra_body": {"ignore_eos": True}}
    plain = await client.completions.create(**kw)
    texts: dict[int, str] = {}
    if stream:
        async for chunk in await client.completions.create(echo=True, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    else:
        texts = {c.index: c.text for c in (await client.completions.create(echo=True, **kw)).choices}
    assert sorted(texts) == [0, 1, 2, 3]
    for c in plain.choices:
        k = c.index // 2
        prompt_text = PROMPTS[k]
        if ids:  # an id prompt echoes as its text (the tokenizer may add a BOS token's text)
            assert texts[c.index].endswith(prompt_text + c.text)
        else:
            assert texts[c.index] == prompt_text + c.text


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first_none(
        client: openai.AsyncOpenAI, router: ServedRouter, reference: Any, stream: bool) -> None:
    prompt = PROMPTS[0]
    ids = _prompt_ids(router, prompt)
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                          "logprobs": 2, "echo": True}
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[Any] = []
    offsets: list[int] = []
    text = ""
    if stream:
        async for chunk in await client.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                lps += c.logprobs.token_logprobs or []
                tops += c.logprobs.top_logprobs or []
                offsets += c.logprobs.text_offset or []
    else:
        c = (await client.completions.create(**kw)).choices[0]
        assert c.logprobs is not None
        text, tokens = c.text, c.logprobs.tokens or []
        lps, tops = c.logprobs.token_logprobs or [], c.logprobs.top_logprobs or []
        offsets = c.logprobs.text_offset or []
    assert len(tokens) == len(lps) == len(tops) == len(offsets) == len(ids) + 4
    assert lps[0] is None and tops[0] is None
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert "".join(tokens).endswith(text[len(prompt):]) and text.startswith(prompt)
    ref = reference(ids)
    for pos in range(1, len(ids)):
        assert lps[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        assert len(tops[pos]) in (2, 3)  # the top 2, and the prompt token when outside them


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(
        client: openai.AsyncOpenAI, router: ServedRouter, reference: Any, stream: bool) -> None:
    prompt = PROMPTS[0]
    ids = _prompt_ids(router, prompt)
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True}
    if stream:
        chunks = [c async for c in await client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw)]
        choices = [c.choices[0] for c in chunks if c.choices]
        text = "".join(c.text for c in choices)
        lps = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs or []]
        finish, usage = choices[-1].finish_reason, chunks[-1].usage
    else:
        out = await client.completions.create(**kw)
        c = out.choices[0]
        assert c.logprobs is not None
        text, lps, finish, usage = c.text, c.logprobs.token_logprobs or [], c.finish_reason, out.usage
    assert text == prompt and finish == "length"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 0)
    assert len(lps) == len(ids) and lps[0] is None
    ref = reference(ids)
    for pos in range(1, len(ids)):
        assert lps[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]


@in_module_loop
async def test_prompt_logprobs_equal_transformers_and_echo(client: openai.AsyncOpenAI, router: ServedRouter,
                                                          reference: Any) -> None:
    prompt = PROMPTS[1]
    ids = _prompt_ids(router, prompt)
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                          logprobs=1, echo=True, extra_body={"prompt_logprobs": 3})
    choice: Any = out.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = reference(ids)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        assert 3 <= len(entry) <= 4
        for tid, e in entry.items():
            assert e["logprob"] == pytest.approx(float(ref[pos - 1, int(tid)]), abs=1e-4)
        assert choice.logprobs.token_logprobs[pos] == pytest.approx(entry[str(ids[pos])]["logprob"])


@in_module_loop
async def test_chat_prompt_logprobs_cover_the_templated_prompt(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp = out.model_extra["prompt_logprobs"] if out.model_extra else None
    assert out.usage is not None and plp is not None
    assert len(plp) == out.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 for e in plp[1:])  # N = 0: the prompt token alone


@in_module_loop
async def test_prompt_logprobs_with_stream_is_a_400_unless_zero(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, stream=True,
                                        extra_body={"prompt_logprobs": 2})
    assert e.value.param == "prompt_logprobs"
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, stream=True, extra_body={"prompt_logprobs": 0})]
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert firsts[0] is not None and len(firsts[0]) > 1 and all(f is None for f in firsts[1:])
