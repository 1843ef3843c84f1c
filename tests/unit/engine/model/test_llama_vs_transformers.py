"""Our paged Llama-family model against transformers on tiny random models.

Every test compares with the transformers model holding the same weights: full-prompt logits,
chunked prefill through the paged cache, token-by-token decode, mixed batches with shuffled
block ids, and greedy generation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.testing import assert_close

ATOL = 1e-4


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [n, vocab]


def test_full_prompt_logits_match_transformers(model_pair, paged_driver) -> None:
    hf_model, ours = model_pair
    tokens = _prompt(ours.vocab_size, 23, seed=1)
    logits = paged_driver(ours).step([("a", tokens)])["a"]
    assert_close(logits, _hf_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


def test_chunked_prefill_through_paged_cache_matches_transformers(model_pair, paged_driver) -> None:
    hf_model, ours = model_pair
    tokens = _prompt(ours.vocab_size, 30, seed=2)
    driver = paged_driver(ours, block_size=4)
    chunks = [tokens[:5], tokens[5:12], tokens[12:]]
    logits = torch.cat([driver.step([("a", chunk)])["a"] for chunk in chunks])
    assert_close(logits, _hf_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


def test_token_by_token_decode_matches_transformers(model_pair, paged_driver) -> None:
    hf_model, ours = model_pair
    tokens = _prompt(ours.vocab_size, 18, seed=3)
    driver = paged_driver(ours, block_size=1)
    logits = torch.cat([driver.step([("a", [tok])])["a"] for tok in tokens])
    assert_close(logits, _hf_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


def test_mixed_batch_equals_each_request_alone(model_pair, paged_driver) -> None:
    hf_model, ours = model_pair
    prompts = {rid: _prompt(ours.vocab_size, n, seed=10 + i)
               for i, (rid, n) in enumerate([("a", 9), ("b", 21), ("c", 2), ("d", 14)])}
    driver = paged_driver(ours, block_size=4, seed=7)
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    # step 1: a whole, b chunk, d chunk; step 2: a decodes nothing more, b rest, c whole, d 1 token
    plan = [
        [("a", prompts["a"]), ("b", prompts["b"][:6]), ("d", prompts["d"][:13])],
        [("b", prompts["b"][6:]), ("c", prompts["c"]), ("d", prompts["d"][13:])],
    ]
    for batch in plan:
        for rid, logits in driver.step(batch).items():
            got[rid].append(logits)
    for rid, tokens in prompts.items():
        assert_close(torch.cat(got[rid]), _hf_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


def test_greedy_generation_matches_transformers_generate(model_pair, paged_driver) -> None:
    hf_model, ours = model_pair
    prompts = [_prompt(ours.vocab_size, n, seed=20 + n) for n in (7, 12)]
    driver = paged_driver(ours, block_size=4, num_blocks=64)
    outputs: list[list[int]] = [[] for _ in prompts]
    batch = [(str(i), p) for i, p in enumerate(prompts)]
    for _ in range(20):
        logits = driver.step(batch)
        batch = []
        for i in range(len(prompts)):
            token = int(logits[str(i)][-1].argmax())
            outputs[i].append(token)
            batch.append((str(i), [token]))
    for prompt, ours_out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hf_out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert ours_out[: len(hf_out)] == hf_out
        assert len(hf_out) == 20
