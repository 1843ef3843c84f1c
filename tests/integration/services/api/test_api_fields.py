"""Request fields through the official `openai` client against the router over a colocated worker:
every OpenAI / vLLM field the server does not implement yet is refused with a 400 whose `param`
names it (never a silent 200); the same fields with their no-op values, `user` and unknown fields
are accepted and change nothing; vLLM's
`stream_options.continuous_usage_stats` puts the usage so far in every chunk; /tokenize gives the
tokens generation prefills and /detokenize inverts it; /ping, /version, /v1/models/{id}."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.router.api import unsupported
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPT = "The capital of France is"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]

# A value of each refused field that asks for something (its no-op value is accepted, below).
USED: dict[str, Any] = {
    "use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["my.module:proc"],
    "return_tokens_as_token_ids": True, "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"k": 1},
    "suffix": " and that is all.", "best_of": 3,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": {"name": "f"},
    "chat_template": "{{ messages }}",
    "documents": [{"title": "t", "text": "x"}], "mm_processor_kwargs": {"k": 1},
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
}
NO_OP: dict[str, Any] = {
    "logit_bias": {}, "echo": False, "priority": 0, "response_format": {"type": "text"},
    "skip_special_tokens": True, "include_stop_str_in_output": False, "best_of": 1, "bad_words": [],
    "user": "user-1234", "some_unknown_field": {"x": 1},
}
CHAT_NO_OP = {"tool_choice": "none", "tools": [], "add_generation_prompt": True,
              "chat_template_kwargs": {}, "modalities": ["text"], "parallel_tool_calls": True}


def test_every_refused_field_is_tried() -> None:
    assert set(USED) == set(unsupported.COMPLETION) | set(unsupported.CHAT)


async def _create(client: openai.AsyncOpenAI, chat: bool, extra: dict[str, Any], **kw: Any) -> Any:
    if chat:
        return await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                    temperature=0, extra_body=extra, **kw)
    return await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body=extra, **kw)


CASES = [(endpoint, field) for endpoint, table in (("completions", unsupported.COMPLETION),
                                                   ("chat", unsupported.CHAT)) for field in table]


@in_module_loop
@pytest.mark.parametrize(("endpoint", "field"), CASES)
async def test_an_unsupported_field_is_a_400_naming_it(client: openai.AsyncOpenAI, endpoint: str,
                                                        field: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            await _create(client, endpoint == "chat", {field: USED[field]}, stream=stream)
        assert e.value.status_code == 400 and e.value.param == field
        assert "not supported by this server yet" in e.value.message and field in e.value.message


@in_module_loop
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_no_op_values_user_and_unknown_fields_are_accepted_and_change_nothing(
        client: openai.AsyncOpenAI, chat: bool, caplog: pytest.LogCaptureFixture) -> None:
    plain = await _create(client, chat, {})
    extra = {**NO_OP, **(CHAT_NO_OP if chat else {})}
    with caplog.at_level(logging.DEBUG, logger="services.router.api.unsupported"):
        out = await _create(client, chat, extra)
    text = (lambda r: r.choices[0].message.content) if chat else (lambda r: r.choices[0].text)
    assert text(out) == text(plain) and text(out)
    assert any("ignored unknown fields ['some_unknown_field']" in r.getMessage() for r in caplog.records)


@in_module_loop
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client: openai.AsyncOpenAI,
                                                                          chat: bool) -> None:
    stream = await _create(client, chat, {"ignore_eos": True}, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c async for c in stream]
    final = chunks[-1]
    assert not final.choices and final.usage is not None and final.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6
    if chat:
        assert counts[0] == 0  # the role chunk: nothing generated yet
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)

    plain = await _create(client, chat, {"ignore_eos": True}, stream=True,
                          stream_options={"include_usage": True})  # usage in the last chunk only
    plain_chunks = [c async for c in plain]
    assert all(c.usage is None for c in plain_chunks[:-1]) and plain_chunks[-1].usage is not None


@in_module_loop
async def test_tokenize_gives_the_tokens_generation_prefills_and_detokenize_inverts_it(
        client: openai.AsyncOpenAI, router: ServedRouter) -> None:
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert completion.usage is not None and chat.usage is not None
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        text = (await http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})).json()
        assert text["count"] == len(text["tokens"]) == completion.usage.prompt_tokens
        assert text["max_model_len"] == 512 and text["token_strs"] is None
        msgs = (await http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True})).json()
        assert msgs["count"] == chat.usage.prompt_tokens and len(msgs["token_strs"]) == msgs["count"]
        bare = (await http.post("/tokenize", json={"messages": MESSAGES,
                                                    "add_generation_prompt": False})).json()
        assert bare["count"] < msgs["count"] and msgs["tokens"][:bare["count"]] == bare["tokens"]

        for sample in (PROMPT, "Ünïcödé, emoji 🙂 and\ttabs\nnew lines"):
            ids = (await http.post("/tokenize", json={"prompt": sample, "add_special_tokens": False})).json()
            back = (await http.post("/detokenize", json={"model": MODEL, "tokens": ids["tokens"]})).json()
            assert back == {"prompt": sample}

        for path, body, status, param in [
                ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
                ("/tokenize", {"prompt": ""}, 400, "prompt"),
                ("/tokenize", {"messages": []}, 400, "messages"),
                ("/tokenize", ["not", "an", "object"], 400, None),
                ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
                ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
                ("/detokenize", {"tokens": "12"}, 400, "tokens")]:
            reply = await http.post(path, json=body)
            assert reply.status_code == status, (path, body, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text


@in_module_loop
async def test_ping_version_and_one_model(client: openai.AsyncOpenAI, router: ServedRouter) -> None:
    from importlib.metadata import version

    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("gpt-4")
    assert e.value.param == "model"
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        assert (await http.get("/version")).json() == {"version": version("pdserve")}
        for method in ("GET", "POST"):
            ping = await http.request(method, "/ping")
            assert ping.status_code == 200 and ping.json()["status"] == "ok"


@pytest.fixture(scope="module")
def greedy_texts(model_dir: Path) -> dict[str, str]:
    """The offline engine's greedy text of the prompt, whole and cut at a stop string (kept or
    not): the reference for include_stop_str_in_output."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    def params(**kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)

    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 4,", "A list of fruits:", "def main():"]
    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        for k, got in enumerate(llm.generate(prompts, params(), use_tqdm=False)):
            whole = got.outputs[0].text
            # A stop string the greedy text reaches mid-way: 3 characters seen first at >= 4.
            firsts = [i for i in range(4, len(whole) - 3) if whole.find(whole[i:i + 3]) == i]
            if firsts:
                prompt, stop = prompts[k], whole[firsts[0]:firsts[0] + 3]
                break
        else:
            pytest.fail(f"no prompt's greedy text has a stop string mid-way: {whole!r}")
        out = {"prompt": prompt, "whole": whole, "stop": stop}
        for keep in (False, True):
            cut = llm.generate([prompt], params(stop=[stop], include_stop_str_in_output=keep), use_tqdm=False)
            out[str(keep)] = cut[0].outputs[0].text
    return out


@in_module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("keep", [False, True], ids=["cut", "kept"])
async def test_include_stop_str_in_output_keeps_the_stop_string_as_the_engine_does(
        client: openai.AsyncOpenAI, greedy_texts: dict[str, str], keep: bool, stream: bool) -> None:
    stop = greedy_texts["stop"]
    want = greedy_texts[str(keep)]
    cut_at = greedy_texts["whole"].find(stop)
    assert want == greedy_texts["whole"][:cut_at + len(stop) * keep]  # the reference agrees with itself
    out = await client.completions.create(model=MODEL, prompt=greedy_texts["prompt"], max_tokens=24,
                                          temperature=0, stop=[stop], stream=stream,
                                          extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
    if stream:
        chunks = [c async for c in out]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == want and finish == "stop"
