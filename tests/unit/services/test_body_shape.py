"""A large body's shape, checked before it is parsed (services/router/api/body_shape.py), and what
the lenient JSON path of prepare.parse refuses: every way around the count is a 400 naming what
is wrong, never a 500 and never an unbounded parse."""

from __future__ import annotations

import json

import pytest

from services.router.api.body_shape import MAX_ITEMS, MAX_MESSAGES, ShapeLimits, check_shape
from services.router.api.openai_models import ChatCompletionRequest
from services.router.errors import OpenAIError
from services.router.prepare import parse

LIMITS = ShapeLimits.for_model(4096)


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def refused(raw: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        check_shape(raw, LIMITS)
    assert err.value.status == 400
    return err.value


def test_too_many_messages_are_refused_naming_them_and_long_texts_are_not() -> None:
    many = body(messages=[{"role": "user", "content": ""}] * 250_000)
    assert refused(many).param == "messages"
    commas = "a, b, [c], {d}, " * 20_000  # structure characters inside a string count for nothing
    check_shape(body(messages=[{"role": "user", "content": commas}]), LIMITS)
    check_shape(body(messages=[{"role": "user", "content": commas}],
                     tools=[{"type": "function", "function": {"name": "f", "description": commas}}]), LIMITS)


def test_the_limits_do_not_grow_past_fixed_caps_with_max_model_len() -> None:
    huge = ShapeLimits.for_model(131_072)
    assert huge.items == MAX_ITEMS and huge.messages == MAX_MESSAGES


def test_fields_together_and_unknown_fields_count() -> None:
    extras = {f"x{i}": [[0]] * 2_000 for i in range(40)}  # 40 unknown fields of 2,000 items each
    error = refused(body(messages=[{"role": "user", "content": "hi"}], **extras))
    assert "more than the" in error.message and error.param is None


def test_token_id_lists_are_refused_past_their_limit() -> None:
    assert refused(body(prompt="x", logit_bias={str(i): 1 for i in range(5000)})).param == "logit_bias"
    check_shape(body(prompt=[[100] * 4000] * 64), LIMITS)  # 256k token ids: a legal batch


def test_strictly_unparsable_large_bodies_are_400s() -> None:
    surrogate = body(messages=[{"role": "user", "content": ""}] * 20_000)[:-1] + b', "user": "\\ud800"}'
    assert "lone surrogate" in refused(surrogate).message  # json.loads would take it unbounded
    deep = b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b', "y": [' + b"0," * 5000 + b"0]}"
    assert refused(deep).status == 400  # msgspec's depth limit: never a RecursionError's 500
    assert refused(b"[" + b"1," * 10_000 + b"1]").message == "the request body must be a JSON object"


def test_the_lenient_path_refuses_lone_surrogates_in_any_field() -> None:
    small = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "a\\ud800"}'
    with pytest.raises(OpenAIError) as err:
        parse(ChatCompletionRequest, small, None)
    assert err.value.status == 400 and err.value.param == "cache_salt"
