"""The split serves every architecture as colocated does: for a dense (Qwen3), a windowed
(Mistral with a 24-key window, prompts far past it) and a mixture-of-experts (Qwen3-MoE) tiny
model, the same requests through the real router on a prefill + decode pair (real gRPC, real KV
store) and on a colocated worker give the same tokens and logprobs, greedy (equal to
transformers too) and seeded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPTS = [[100 + (7 * i + 3 * j) % 900 for j in range(n)] for i, n in enumerate((60, 33, 90))]
NEW = 24


@pytest.fixture(scope="module", params=["qwen3", "mistral_window", "qwen3_moe"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir(request.param)


async def _complete(router: ServedRouter, prompt: list[int], **kw: Any) -> tuple[str, list[float]]:
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                  timeout=120) as client:
        out = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=NEW, logprobs=1,
            extra_body={"ignore_eos": True}, **kw)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert out.usage is not None and out.usage.completion_tokens == NEW
    return choice.text, list(choice.logprobs.token_logprobs)


@in_module_loop
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 0.8, "seed": 9, "top_p": 0.9,
                                       "presence_penalty": 0.5}], ids=["greedy", "seeded", "mixed"])
async def test_split_equals_colocated(routers: tuple[ServedRouter, ServedRouter], model_dir: Path,
                                      sampling: dict[str, Any],
                                      hf_greedy: Callable[..., list[list[int]]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    split, colocated = routers
    for prompt in PROMPTS:
        a = await _complete(split, prompt, **sampling)
        b = await _complete(colocated, prompt, **sampling)
        assert a[0] == b[0]
        assert a[1] == pytest.approx(b[1], abs=1e-5)
        if sampling["temperature"] == 0.0:
            want = hf_greedy(model_dir, [prompt], NEW)[0]
            assert a[0] == tokenizer.decode(want, skip_special_tokens=True)
