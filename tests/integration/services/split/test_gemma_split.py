"""Gemma 3 270M, the catalog's real GGUF model, served split (prefill + decode workers, real
gRPC and KV store) and colocated through the real router: ten chat prompts give transformers'
greedy tokens (transformers dequantizing the same GGUF file itself) both ways. Slow: the model
is fetched from PyPI and converted on first use (~100 s), then three workers load it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")
NEW = 24
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a KV cache is.", "List three prime numbers larger than 100.",
             "Translate 'good morning' into Spanish.", "Why is the sky blue?",
             "Give me a short recipe for pancakes.", "What does GPU stand for?",
             "Name a colour of the rainbow.", "Count from one to five in words."]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from engine.model.loader import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from engine.model.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=False) for q in QUESTIONS]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def expected(prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, the model loaded from the GGUF file itself."""
    from transformers import AutoModelForCausalLM

    from engine.model.sources.catalog import GEMMA3_270M
    from engine.model.sources.fetch import PackagedGguf, assembled, packages_dir

    source = GEMMA3_270M.source
    assert isinstance(source, PackagedGguf)
    with assembled(source, packages_dir(GEMMA3_270M.name)) as gguf:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def routers(expected: list[list[int]], workers: dict[str, WorkerServer], model_dir: Path
            ) -> Iterator[tuple[ServedRouter, ...]]:
    """Started after transformers' reference run: that holds this loop's thread for a minute,
    in which the workers (on the same loop) could not answer the router's load reports."""
    split = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,),
                            decode_timeout_s=120)
    colocated = DispatchOptions(decode=(workers["colocated"].target,), decode_timeout_s=120)
    configs = [RouterConfig(model="gemma", tokenizer=str(model_dir), max_model_len=512, dispatch=d)
               for d in (split, colocated)]
    with ServedRouter(configs[0]) as a, ServedRouter(configs[1]) as b:
        yield a, b


@in_module_loop
async def test_gemma_split_and_colocated_equal_transformers_on_the_gguf(
        routers: tuple[ServedRouter, ServedRouter], model_dir: Path, prompts: list[list[int]],
        expected: list[list[int]]) -> None:
    from engine.model.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    for router in routers:
        async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                      timeout=300) as client:
            for prompt, want in zip(prompts, expected, strict=True):
                out = await client.completions.create(
                    model="gemma", prompt=prompt, max_tokens=NEW, temperature=0.0,
                    extra_body={"ignore_eos": True, "skip_special_tokens": False})
                assert out.usage is not None and out.usage.completion_tokens == NEW
                assert out.choices[0].text == tok.decode(want, skip_special_tokens=False), router.url
