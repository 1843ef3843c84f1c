"""logit_bias, allowed_token_ids, bad_words and priority through the router (the official openai
client, a real colocated worker): each changes the output as vLLM's does, and bad values are
400s naming the field (issue 18)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPT = "The capital of France is"


def _ids(router: ServedRouter, text: str) -> list[int]:
    r = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": text,
                                                   "add_special_tokens": False}, timeout=10)
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
    assert e.value.param is not None and e.value.param.split(".")[0] == field, e.value.message


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
