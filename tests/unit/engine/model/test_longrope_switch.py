"""LongRoPE (Phi-3/4) switches to its long frequencies once a request's context passes
`original_max_position_embeddings`, as transformers does: a whole prompt longer than that is
rotated with the long set, and decoding switches at that position."""

from __future__ import annotations

from typing import Any

import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM


def _phi3_switching_at_16(tiny_config: Any) -> Any:
    config = tiny_config("phi3_partial_longrope")
    # Phi3Config keeps the switch in two places; transformers reads the attribute
    config.original_max_position_embeddings = 16
    config.rope_parameters["original_max_position_embeddings"] = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper attention, so that the rotation shows in the logits
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8.0)
    return model


def test_prompt_past_the_switch_uses_the_long_set(paged_driver, tiny_config, our_model_of) -> None:
    hf = _phi3_switching_at_16(tiny_config)
    ours = our_model_of(hf)
    tokens = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert_close(paged_driver(ours).step([("a", tokens)])["a"], want, atol=1e-4, rtol=1e-4)
    short = our_model_of(hf)  # the short set alone gives other logits: the switch matters
    for rope in short.ropes:
        rope.long_after = None
    assert not torch.allclose(paged_driver(short).step([("a", tokens)])["a"], want, atol=1e-3)


def test_decoding_across_the_switch_matches_an_incremental_forward(
        paged_driver, tiny_config, our_model_of) -> None:
    """Token by token through the switch, against transformers' forward with its KV cache.
    (transformers' `generate` for Phi-3 instead drops the cache at the switch and recomputes
    the whole sequence with the long set, `Phi3ForCausalLM.prepare_inputs_for_generation`;
    vLLM does not, nor does this engine: tokens cached before the switch keep their rotation.)"""
    hf = _phi3_switching_at_16(tiny_config)
    ours = our_model_of(hf)
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    driver = paged_driver(ours, block_size=4, num_blocks=32)
    logits = driver.step([("a", prompt)])["a"]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for step in range(16):  # positions 9..24: the switch at 16 falls inside
            assert_close(logits[-1], out.logits[0, -1], atol=1e-4, rtol=1e-4)
            token = int(out.logits[0, -1].argmax())
            out = hf(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[len(prompt) + step]]))
            logits = driver.step([("a", [token])])["a"]
