"""Generation fields of vLLM's API the router implements, through the official `openai` client
against the router over a colocated worker, each checked against an independent reference:

- a batch of prompts (texts or token-id lists): choice k * n + i is sample i of prompt k, the
  same text as prompt k sent alone with the same seed, streamed or not; usage sums the prompts;
- best_of: the n of best_of samples with the highest cumulative logprob, as the same seeded
  samples fetched one by one with their logprobs rank them;
- chat's add_generation_prompt, continue_final_message and chat_template_kwargs: the prompt is
  transformers' apply_chat_template of the messages with the same arguments; echo and the reply's
  role as vLLM's;
- skip_special_tokens: the text is the tokenizer's decode of transformers' greedy tokens;
- truncate_prompt_tokens: the same output and usage as the prompt's last k tokens sent as they are.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
TEXTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
IDS = [[28, 5, 900], [1, 2, 3, 4, 5], [7000, 12]]
CHAT: list[Any] = [{"role": "user", "content": "Name a colour."}]
PREFILLED: list[Any] = [*CHAT, {"role": "assistant", "content": "The colour is"}]
# A template variable the default template lacks (Qwen3's, for one): the router's tokenizer has it.
THINKING = "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}" \
           "{{ '<think>\n\n</think>\n\n' }}{% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer, its chat template taking `enable_thinking` (the worker never reads it)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def router(colocated_worker: WorkerServer, tokenizer_dir: Path) -> Iterator[ServedRouter]:
    dispatch = DispatchOptions(decode=(colocated_worker.target,), decode_timeout_s=60)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(tokenizer_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


async def _complete(client: openai.AsyncOpenAI, prompt: Any, stream: bool = False, **kw: Any
                    ) -> tuple[dict[int, str], Any]:
    """(text by choice index, usage) of a completion, streamed or not."""
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "extra_body": extra, **kw}
    if not stream:
        out = await client.completions.create(**args)
        return {c.index: c.text for c in out.choices}, out.usage
    texts: dict[int, str] = {}
    usage = None
    async for chunk in await client.completions.create(**args, stream=True,
                                                       stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts, usage


@in_module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["texts", "token-ids"])
async def test_a_batch_numbers_choices_by_prompt_and_sample_as_the_prompts_sent_alone(
        client: openai.AsyncOpenAI, prompts: list[Any], stream: bool) -> None:
    seeded = {"n": 2, "seed": 11, "temperature": 1.0}
    batch, usage = await _complete(client, prompts, stream, **seeded)
    assert sorted(batch) == list(range(2 * len(prompts)))
    prompt_tokens = completion_tokens = 0
    for k, prompt in enumerate(prompts):
        alone, alone_usage = await _complete(client, prompt, **seeded)
        assert [batch[2 * k], batch[2 * k + 1]] == [alone[0], alone[1]]
        prompt_tokens += alone_usage.prompt_tokens
        completion_tokens += alone_usage.completion_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert batch[0] != batch[1]  # seed and seed + 1


@in_module_loop
async def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(
        client: openai.AsyncOpenAI) -> None:
    seeded = {"seed": 5, "temperature": 1.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    every = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=4, logprobs=0, **seeded)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=2, best_of=4, **seeded)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage is not None and best.usage.completion_tokens == 2 * 6  # the choices', as vLLM
    with_logprobs = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=2, best_of=4,
                                                    logprobs=1, **seeded)
    assert [c.text for c in with_logprobs.choices] == [c.text for c in ranked[:2]]
    for got, want in zip(with_logprobs.choices, ranked[:2], strict=True):  # other batches: float noise
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    for kw in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=2, **kw)
        assert e.value.param == "best_of"


def _template_ids(tokenizer: Any, messages: list[Any], **kw: Any) -> list[int]:
    """transformers' prompt: the template's text, tokenized as a chat request's."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


CHAT_CASES = [
    (CHAT, {"add_generation_prompt": False}),
    (PREFILLED, {"add_generation_prompt": False, "continue_final_message": True}),
    (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}),
]


@in_module_loop
@pytest.mark.parametrize(("messages", "fields"), CHAT_CASES, ids=["no-generation-prompt", "continue",
                                                                  "template-kwargs"])
async def test_chat_template_fields_give_transformers_prompt(
        client: openai.AsyncOpenAI, router: ServedRouter, tokenizer: Any, messages: list[Any],
        fields: dict[str, Any]) -> None:
    kwargs = {"add_generation_prompt": True, **fields, **fields.get("chat_template_kwargs", {})}
    kwargs.pop("chat_template_kwargs", None)
    want = _template_ids(tokenizer, messages, **kwargs)
    assert want != _template_ids(tokenizer, messages, add_generation_prompt=True)
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        got = (await http.post("/tokenize", json={"messages": messages, **fields})).json()
    assert got["tokens"] == want
    out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               extra_body=fields)
    assert out.usage is not None and out.usage.prompt_tokens == len(want)
    # vLLM's reply role: the assistant's after a generation prompt, else the last message's.
    generation_prompt = fields.get("add_generation_prompt", True)
    assert out.choices[0].message.role == ("assistant" if generation_prompt else messages[-1]["role"])


@in_module_loop
@pytest.mark.parametrize(("messages", "fields", "param"), [
    (PREFILLED, {"continue_final_message": True}, "continue_final_message"),  # a generation prompt too
    (CHAT, {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
async def test_chat_template_fields_that_cannot_be_honoured_are_400s(
        client: openai.AsyncOpenAI, messages: list[Any], fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=fields)
    assert e.value.param == param


@in_module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_echo_starts_the_reply_with_the_message_it_continues(client: openai.AsyncOpenAI,
                                                                         stream: bool) -> None:
    async def content(messages: list[Any], **fields: Any) -> tuple[str, str]:
        args: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
                                "extra_body": {"ignore_eos": True, **fields}}
        if not stream:
            message = (await client.chat.completions.create(**args)).choices[0].message
            return message.role, message.content or ""
        chunks = [c.choices[0].delta async for c in await client.chat.completions.create(**args, stream=True)]
        return chunks[0].role or "", "".join(d.content or "" for d in chunks)

    cont = {"add_generation_prompt": False, "continue_final_message": True}
    role, plain = await content(PREFILLED, **cont)
    assert await content(PREFILLED, echo=True, **cont) == (role, "The colour is" + plain)
    assert role == "assistant"
    # After a generation prompt the reply is the assistant's: a user message is not echoed.
    assert await content(CHAT, echo=True) == await content(CHAT)


@in_module_loop
async def test_skip_special_tokens_both_ways_give_the_tokenizers_decode(
        client: openai.AsyncOpenAI, model_dir: Path, tokenizer: Any,
        hf_greedy: Callable[[Path, list[list[int]], int], list[list[int]]]) -> None:
    # Tied embeddings make the tiny model repeat tokens: some of these continue with special ones.
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    candidates = [[28, s] for s in range(3, 17)]
    continuations = hf_greedy(model_dir, candidates, 5)
    found = [(p, ids) for p, ids in zip(candidates, continuations, strict=True) if special & set(ids)]
    assert found, f"no greedy continuation holds a special token: {continuations}"
    prompt, ids = found[0]
    for skip in (True, False):
        for stream in (False, True):
            texts, _ = await _complete(client, prompt, stream, temperature=0,
                                       extra_body={"skip_special_tokens": skip,
                                                   "spaces_between_special_tokens": skip})
            assert texts[0] == tokenizer.decode(ids, skip_special_tokens=skip), (skip, stream)


@in_module_loop
async def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.AsyncOpenAI,
                                                            router: ServedRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        text_ids = (await http.post("/tokenize", json={"prompt": TEXTS[0]})).json()["tokens"]
        chat_ids = (await http.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
    greedy = {"temperature": 0}
    for prompt, ids in ((TEXTS[0], text_ids), (IDS[1], IDS[1]), ([9] * 600, [9] * 3)):  # 600 > 512
        texts, usage = await _complete(client, prompt, extra_body={"truncate_prompt_tokens": 3}, **greedy)
        assert (texts, usage.prompt_tokens) == ((await _complete(client, ids[-3:], **greedy))[0], 3)
    whole, usage = await _complete(client, TEXTS[0], extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert usage.prompt_tokens == len(text_ids) and whole == (await _complete(client, TEXTS[0], **greedy))[0]

    chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                                extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4})
    assert chat.usage is not None and chat.usage.prompt_tokens == 4
    assert chat.choices[0].message.content == (await _complete(client, chat_ids[-4:], **greedy))[0][0]
    for keep in (0, 512 - 16 + 1):  # max_tokens is 16 by default: at most 496 prompt tokens fit
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=TEXTS[0],
                                            extra_body={"truncate_prompt_tokens": keep})
        assert e.value.param == "truncate_prompt_tokens"
