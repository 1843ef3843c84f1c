"""Processor: prompts become validated EngineCoreRequests (tokenization checked against HF)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.processor import Processor
from engine.sampling_params import SamplingParams


@pytest.fixture
def processor(tokenizer) -> Processor:
    return Processor(EngineConfig(max_model_len=32), tokenizer)


def test_text_prompt_is_tokenized_like_the_tokenizer(processor, tokenizer):
    (req,) = processor.process("r1", "Hello there, world", SamplingParams(), arrival_time=5.0)
    assert req.request_id == "r1"
    assert req.prompt_token_ids == tokenizer("Hello there, world").input_ids
    assert req.eos_token_id == tokenizer.eos_token_id
    assert req.arrival_time == 5.0


def test_chat_prompt_uses_the_template_with_generation_prompt(processor, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text, ids = processor.preprocess(messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == expected and text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer(expected, add_special_tokens=False).input_ids


def test_token_prompt_is_kept_and_has_no_text(processor):
    text, ids = processor.preprocess([5, 6, 7])
    assert (text, ids) == (None, [5, 6, 7])


def test_n_fans_out_into_children_with_shifted_seeds(processor):
    reqs = processor.process("abc", [1, 2, 3], SamplingParams(n=3, seed=10))
    assert [r.request_id for r in reqs] == ["0_abc", "1_abc", "2_abc"]
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r in reqs)


def test_max_tokens_none_becomes_the_room_left(processor):
    (req,) = processor.process("r", [1] * 10, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 32 - 10


def test_max_tokens_beyond_the_model_length_is_left_to_the_core(processor):
    (req,) = processor.process("r", [1] * 10, SamplingParams(max_tokens=1000))
    assert req.sampling_params.max_tokens == 1000


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "prompt must not be empty"),
    ([], "prompt must not be empty"),
    ([1] * 32, "longer than max_model_len=32"),
    ([1, 49152], "prompt token id 49152 out of range"),
    ([-1], "prompt token id -1 out of range"),
    ([{"content": "no role"}], "'role'"),
    ([1, "a"], "prompt must be"),
])
def test_invalid_prompts_raise_value_error_naming_the_problem(processor, prompt, message):
    with pytest.raises(ValueError, match=message):
        processor.process("r", prompt, SamplingParams())


def test_longest_prompt_leaves_room_for_one_token(processor):
    (req,) = processor.process("r", [1] * 31, SamplingParams())
    assert len(req.prompt_token_ids) == 31


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "prompt must not be empty"),
    ([1] * 32, "longer than max_model_len=32"),
    ([1, 49152], "prompt token id 49152 out of range"),
    ([3, -1], "prompt token id -1 out of range"),
])
def test_check_token_ids_keeps_the_length_and_range_checks(processor, prompt, message):
    with pytest.raises(ValueError, match=message):
        processor.check_token_ids(prompt)


def test_check_token_ids_gives_back_the_prompt_as_preprocess_does(processor):
    assert processor.check_token_ids([5, 6, 7]) == processor.preprocess([5, 6, 7])[1] == [5, 6, 7]
