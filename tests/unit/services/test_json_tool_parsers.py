"""vLLM's llama3_json and mistral tool-call formats: calls and content found from the text alone,
the same events whatever the text's cutting (whole, a character at a time, random pieces)."""

from __future__ import annotations

import json
import random

import pytest

from services.router.api.json_tool_parsers import Llama3JsonParser, MistralParser
from services.router.api.tool_parser import CallArguments, CallStart, Content, Event

Parser = type[Llama3JsonParser] | type[MistralParser]


def _run(parser_type: Parser, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    parser = parser_type()
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            args[e.index] = args.get(e.index, "") + e.text
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)]


def _cuttings(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


CITY = {"city": "Paris", "unit": "c"}
CUT = '{"name": "a", "parameters": {"cut": "sho'
CASES: list[tuple[Parser, str, str, list[tuple[str, dict[str, object]]]]] = [
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
     [("get_weather", CITY)]),
    (Llama3JsonParser,
     '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, "}"]}}',
     "", [("a", {}), ("b", {"x": [1, "}"]})]),
    (Llama3JsonParser, "  The weather is sunny {really}.", "  The weather is sunny {really}.", []),
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    (Llama3JsonParser, '{"name": "a", "parameters": {}} and then', " and then", [("a", {})]),
    (Llama3JsonParser, CUT, CUT, []),  # cut short by max_tokens: content
    (Llama3JsonParser, "<|python", "<|python", []),
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', "",
     [("get_weather", CITY)]),
    (MistralParser,
     'Let me check.[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "[x]"}}]',
     "Let me check.", [("a", {}), ("b", {"q": "[x]"})]),
    (MistralParser, "No tools [TOOL here, just text.", "No tools [TOOL here, just text.", []),
    (MistralParser, '[TOOL_CALLS] not json', "[TOOL_CALLS] not json", []),
    (MistralParser, '[TOOL_CALLS][{"name": "a", "arguments": {}}] trailing', " trailing", [("a", {})]),
]


@pytest.mark.parametrize(("parser_type", "text", "content", "calls"), CASES)
def test_calls_and_content_whatever_the_cutting(parser_type: Parser, text: str, content: str,
                                                calls: list[tuple[str, dict[str, object]]]) -> None:
    for pieces in _cuttings(text):
        assert _run(parser_type, pieces) == (content, calls), pieces


def test_a_call_goes_out_as_soon_as_its_object_closes() -> None:
    parser = Llama3JsonParser()
    assert parser.feed('{"name": "a", "parameters": {"x": 1}') == []
    assert parser.feed("}; ") == [CallStart(0, "a"), CallArguments(0, '{"x": 1}')]
    parser = MistralParser()
    assert parser.feed("Sure.[TOOL_") == [Content("Sure.")]
    assert parser.feed('CALLS][{"name": "a", "arguments": {}}') == [CallStart(0, "a"), CallArguments(0, "{}")]


@pytest.mark.parametrize(("arch", "parser"), [("LlamaForCausalLM", "llama3_json"),
                                              ("MistralForCausalLM", "mistral"),
                                              ("MixtralForCausalLM", "mistral"),
                                              ("Qwen3ForCausalLM", "hermes"),
                                              ("Gemma3ForCausalLM", "hermes")])
def test_pdserve_up_picks_the_model_familys_parser(tmp_path, arch: str, parser: str) -> None:
    import argparse

    from services.up.specs import default_tool_parser, tool_args

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    assert default_tool_parser("my-model", str(tmp_path)) == parser
    assert default_tool_parser("smollm2-135m-instruct", str(tmp_path)) == "hermes"  # its template
    up = argparse.Namespace(model="my-model", chat_template=None, tool_call_parser="mistral")
    assert tool_args(up, str(tmp_path))[-3:] == ["--tool-call-parser", "mistral",
                                                  "--enable-auto-tool-choice"]
