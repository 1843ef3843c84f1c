"""Schemathesis fuzz of the router's OpenAI API, over real prefill and decode workers on a tiny random
model: for every operation, valid (positive) and invalid (negative) requests, a fixed number of each,
derandomized. No reply is a 5xx; every 4xx is an OpenAI error body with a message; replies conform to
the schema (status code, content type, body). Hand-picked edge values (NaN, huge ints, giant strings,
deep nesting) that JSON schema generators do not produce are sent as well.

The positive schema is the app's own, narrowed where generation would be slow or pointless: `model`
is the served one (others are a 404 before any work), and `n` and the token limits are small."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import pytest_asyncio
import requests
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from services.router.api import unsupported
from services.router.api.structured_fields import StructuredFields
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.router.responses import request as responses_request
from services.worker.server import WorkerRole, WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")

StartWorker = Callable[[WorkerRole], Awaitable[WorkerServer]]  # the conftest's fixture
MODEL = "tiny"
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/models"), ("GET", "/health"), ("POST", "/tokenize"), ("POST", "/detokenize")]
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))  # per operation and mode
MAX_NEW_TOKENS, MAX_N = 4, 3
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def narrowed(spec: dict[str, Any]) -> dict[str, Any]:
    """The positive-mode schema: the served model, few samples, few new tokens, always a limit, token
    ids in the vocabulary."""
    spec = copy.deepcopy(spec)
    small = {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = spec["components"]["schemas"][name]["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        props["n"] = {**props["n"], "maximum": MAX_N}
        props["max_tokens"] = {"anyOf": [small, {"type": "null"}]}  # null: the completions default 16
        props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 1}  # <= any max_tokens
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    for member in prompt["anyOf"]:
        items = member.get("items", {})
        ids = items.get("items", items)  # a batch's token-id lists, or one prompt's ids
        if ids.get("type") == "integer":
            ids["maximum"] = 255  # in every vocabulary (the app rejects ids past the model's)
        if "maxItems" in member:
            member["maxItems"] = MAX_N  # a small batch
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    chat["properties"]["max_completion_tokens"] = small  # else a chat runs to max_model_len
    chat["required"] = [*chat["required"], "max_completion_tokens"]
    # Rules across fields the schema cannot say: best_of >= n (and no stream), a final message
    # continued only without a generation prompt, no template variable the request's fields set,
    # and a truncation that leaves room for the output. The edge cases below try them.
    spec["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"] = {"type": "null"}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        spec["components"]["schemas"][name]["properties"]["truncate_prompt_tokens"] = {"anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 64}, {"enum": [-1]}, {"type": "null"}]}
    chat["properties"]["continue_final_message"] = {"enum": [False]}
    # Tools: parameters must be a JSON schema, "auto" needs router flags this router lacks, a tool
    # message names the call it answers, a call's arguments are JSON text (tests: test_tool_calling.py).
    chat["properties"]["tools"] = {"type": "null"}
    chat["properties"]["tool_choice"] = {"anyOf": [{"enum": ["none"]}, {"type": "null"}]}
    message = spec["components"]["schemas"]["ChatMessage"]
    message["properties"]["tool_calls"] = {"type": "null"}
    message["properties"]["tool_call_id"] = {"type": "string"}
    message["required"] = [*message.get("required", []), "tool_call_id"]
    chat["properties"]["chat_template_kwargs"] = {"anyOf": [{"type": "null"}, {
        "type": "object", "properties": {"enable_thinking": {"type": "boolean"}, "x": {}},
        "additionalProperties": False}]}
    # Fields not implemented yet: valid requests leave them out (any value is a 400 naming them).
    # Structured outputs too: one form at a time, with a spec that compiles (the edge cases below).
    for name, table in (("CompletionRequest", unsupported.COMPLETION),
                        ("ChatCompletionRequest", unsupported.CHAT)):
        for field in [*table, *StructuredFields.model_fields]:
            spec["components"]["schemas"][name]["properties"][field] = {"type": "null"}
    # The Responses API: a text input (items: test_responses_api.py), few new tokens, no tools,
    # none of the refused fields.
    responses = spec["components"]["schemas"]["ResponsesRequest"]
    responses["properties"].update({
        "model": {"type": "string", "enum": [MODEL]}, "input": {"type": "string"},
        "max_output_tokens": small, "tools": {"type": "null"},
        "tool_choice": {"anyOf": [{"enum": ["none"]}, {"type": "null"}]},
        "previous_response_id": {"type": "null"},
        **{field: {"type": "null"} for field in responses_request.REFUSED}})
    responses["properties"]["temperature"] = {"type": "number", "minimum": 0, "maximum": 2}
    responses["properties"]["top_p"] = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    responses["required"] = [*responses["required"], "input", "max_output_tokens"]
    for path in ("/tokenize", "/detokenize"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for member in body.get("anyOf", [body]):
            member["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [MODEL]}, {"type": "null"}]}
    tokens = spec["paths"]["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    tokens["properties"]["tokens"]["items"]["maximum"] = 255
    return spec


def assert_openai_reply(status: int, content_type: str, text: str, where: str) -> None:
    assert status < 500, f"{where}: {status} {text[:500]}"
    if 400 <= status < 500:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], f"{where}: {text[:500]}"
        assert error["type"] == "invalid_request_error" and {"param", "code"} <= error.keys(), where
    elif content_type.startswith("text/event-stream") and "/v1/responses" in where:
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["type"] in ("response.completed", "response.incomplete"), where
        assert [e["sequence_number"] for e in events] == list(range(len(events))), where
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{where}: {text[-500:]}"
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{where}: an error mid-stream: {event}"


def fuzz(spec: dict[str, Any], mode: GenerationMode, base_url: str) -> dict[int, int]:
    """Runs `EXAMPLES` cases of each operation; returns how many replies had each status."""
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.max_stream_events = 1000  # read whole streams (it stops at 20 events by default)
    statuses: dict[int, int] = {}
    with requests.Session() as session:
        for method, path in OPERATIONS:
            if mode == GenerationMode.NEGATIVE and method == "GET":
                continue  # no parameters to make invalid
            fuzz_operation(schema[path][method], f"{mode.value} {method} {path}", mode, session, base_url,
                           statuses)
    return statuses


def fuzz_operation(operation: Any, label: str, mode: GenerationMode, session: requests.Session,
                   base_url: str, statuses: dict[int, int]) -> None:
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        where = f"{label} body={json.dumps(case.body, default=str)[:300]}"
        assert_openai_reply(response.status_code, response.headers.get("content-type", [""])[0],
                            response.text, where)
        case.validate_response(response, checks=CHECKS)

    one()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(start_worker: StartWorker, model_dir: Path) -> AsyncIterator[ServedRouter]:
    """The router over one prefill and one decode worker (the KV store between them)."""
    prefill, decode = await asyncio.gather(start_worker("prefill"), start_worker("decode"))
    try:
        dispatch = DispatchOptions(prefill=(prefill.target,), decode=(decode.target,), prefill_timeout_s=30,
                                   decode_timeout_s=60)
        served = ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                           dispatch=dispatch))
        with served:
            yield served
    finally:
        for worker in (prefill, decode):
            await worker.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def spec(router: ServedRouter) -> dict[str, Any]:
    reply = requests.get(f"{router.url}/openapi.json", timeout=10)
    assert reply.status_code == 200
    body: dict[str, Any] = reply.json()
    return body


def test_the_schema_documents_openai_errors_and_streams(spec: dict[str, Any]) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "429", "503"} <= responses.keys()
        assert {"application/json", "text/event-stream"} <= responses["200"]["content"].keys()


# The workers serve from this module's event loop, so the blocking fuzz runs in a thread beside it.
@in_module_loop
async def test_valid_requests_never_fail_on_the_server(router: ServedRouter, spec: dict[str, Any]) -> None:
    statuses = await asyncio.to_thread(fuzz, narrowed(spec), GenerationMode.POSITIVE, router.url)
    # Most generate; the rest are 400s the schema cannot express (a prompt past max_model_len).
    assert statuses.get(200, 0) >= 0.8 * sum(statuses.values()), statuses


@in_module_loop
async def test_invalid_requests_are_openai_4xx_errors(router: ServedRouter, spec: dict[str, Any]) -> None:
    statuses = await asyncio.to_thread(fuzz, spec, GenerationMode.NEGATIVE, router.url)
    assert set(statuses) == {400} and sum(statuses.values()) >= EXAMPLES, statuses


def _body(**fields: Any) -> str:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}, allow_nan=True)


EDGES = [
    ("/v1/completions", _body(temperature=math.nan), "temperature"),
    ("/v1/completions", _body(temperature=math.inf), "temperature"),
    ("/v1/completions", _body(top_p=math.nan), "top_p"),
    ("/v1/completions", _body(top_p=-math.inf), "top_p"),
    ("/v1/completions", _body(max_tokens=10**30), "max_tokens"),
    ("/v1/completions", _body(max_tokens=2**31), "max_tokens"),
    ("/v1/completions", _body(seed=2**64), "seed"),
    ("/v1/completions", _body(seed=-(2**63) - 1), "seed"),
    ("/v1/completions", _body(seed=2**63 - 1, n=2), "seed"),
    ("/v1/completions", _body(n=10**20), "n"),
    ("/v1/completions", _body(logprobs=10**20), "logprobs"),
    ("/v1/completions", _body(logprobs=-1), "logprobs"),
    ("/v1/completions", _body(prompt=[10**30]), "prompt"),
    ("/v1/completions", _body(prompt=[-1]), "prompt"),
    ("/v1/completions", _body(prompt=[]), "prompt"),
    ("/v1/completions", _body(prompt=[[1, 2], []]), "prompt"),
    ("/v1/completions", _body(prompt=["a", [1]]), "prompt"),
    ("/v1/completions", _body(prompt=["a", ""]), "prompt"),
    ("/v1/completions", _body(prompt=["a"] * 257), "prompt"),
    ("/v1/completions", _body(prompt=[[1, 10**30]]), "prompt"),
    ("/v1/completions", _body(n=2, best_of=1), "best_of"),
    ("/v1/completions", _body(best_of=2, stream=True), "best_of"),
    ("/v1/completions", _body(best_of=17), "best_of"),
    ("/v1/completions", _body(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("/v1/completions", _body(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ("/v1/completions", _body(truncate_prompt_tokens=10**6), "truncate_prompt_tokens"),
    ("/v1/completions", _body(skip_special_tokens="no"), "skip_special_tokens"),
    ("/v1/completions", _body(prompt="x " * 100_000), "prompt"),
    ("/v1/completions", _body(stop=["x"] * 10_000), "stop"),
    ("/v1/completions", _body(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                    "stop": [[[[[[[[["deep"]]]]]]]]]}), "stop"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user"}] * 20_000,
                                         "max_tokens": 2}), "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}], "max_tokens": 2}), "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "top_logprobs": 10**20}), "top_logprobs"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}), "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "max_completion_tokens": 0}), "max_completion_tokens"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "assistant", "content": "a"}],
                                         "continue_final_message": True}), "continue_final_message"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                         "continue_final_message": True, "add_generation_prompt": False}),
     "continue_final_message"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                         "chat_template_kwargs": {"tokenize": True}}),
     "chat_template_kwargs"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                         "chat_template_kwargs": "x"}), "chat_template_kwargs"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                         "best_of": 2}), "best_of"),
    ("/v1/completions", _body(guided_json='{"properties": {"a": ' * 5000 + "{}" + "}}" * 5000),
     "guided_json"),
    ("/v1/completions", _body(structured_outputs={"regex": "[" * 100_000}), "structured_outputs.regex"),
    ("/v1/completions", _body(guided_choice=["x" * 1000] * 1000), "guided_choice"),
    ("/v1/completions", _body(guided_regex="a", structured_outputs={"regex": "b"}), "guided_regex"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                         "response_format": {"type": "json_schema", "json_schema": {
                                             "name": "x", "schema": {"$ref": "#/$defs/none"}}}}),
     "response_format.json_schema.schema"),
    ("/v1/completions", json.dumps([1, 2, 3]), None),
    ("/v1/completions", "null", None),
]

# Extreme but valid: generated, not failed.
ACCEPTED = [
    _body(seed=-(2**63)),
    _body(seed=2**63 - 1),
    _body(seed=2**63 - 3, n=3),
    _body(stop="y" * 100_000, stream=True),
    _body(stop=["", "", ""]),
    _body(temperature=0, logprobs=20, n=3),
    _body(n=3, stream=True),
    _body(n=3, stream=True, stop=["a", "e"]),
    _body(n=16, max_tokens=4, stream=True, stream_options={"include_usage": True}),
    _body(n=3, seed=1, temperature=1.0, stream=True, guided_json={"type": "array", "items": {"$ref": "#"}}),
    _body(guided_regex="a{1,100000}", stop=["aaa"], logprobs=2, echo=True),
    _body(temperature=2.0, top_p=1e-300),
    _body(prompt="\x00\ud7ff\U0010ffff" * 50),
    _body(prompt=[[1, 2], [3]], n=2, stream=True,
          stream_options={"include_usage": True, "continuous_usage_stats": True}),
    _body(prompt=["a", "b"], n=2, best_of=3, logprobs=2),
    _body(prompt=[5] * 600, truncate_prompt_tokens=-1, skip_special_tokens=False,
          spaces_between_special_tokens=False),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "a"}],
                "add_generation_prompt": False, "continue_final_message": True, "echo": True, "stream": True,
                "truncate_prompt_tokens": 3, "chat_template_kwargs": {"x": [1, {"y": None}]},
                "max_completion_tokens": 2}),
    json.dumps({"model": MODEL, "messages": [{"role": r, "content": None, "tool_call_id": "c"} for r in (
                "system", "developer", "tool", "assistant")], "max_completion_tokens": 2, "logprobs": True,
                "top_logprobs": 0}),
]


@pytest.fixture(scope="module")
def http(router: ServedRouter) -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


@in_module_loop
@pytest.mark.parametrize(("path", "body", "param"), EDGES, ids=[f"{p}:{n}" for p, _, n in EDGES])
async def test_edge_values_are_400s_naming_the_field(router: ServedRouter, http: requests.Session, path: str,
                                                    body: str, param: str | None) -> None:
    reply = await asyncio.to_thread(http.post, f"{router.url}{path}", data=body,
                                    headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, f"{reply.status_code} {reply.text[:300]}"
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert error["param"] == param or (param is not None and str(error["param"]).startswith(param)), error


@in_module_loop
@pytest.mark.parametrize("body", ACCEPTED, ids=range(len(ACCEPTED)))
async def test_extreme_valid_values_generate(router: ServedRouter, http: requests.Session, body: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = await asyncio.to_thread(http.post, f"{router.url}{path}", data=body,
                                    headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 200, f"{reply.status_code} {reply.text[:300]}"
    assert_openai_reply(reply.status_code, reply.headers.get("content-type", ""), reply.text, body[:200])

