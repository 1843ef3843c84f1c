"""The reasoning splitter (--reasoning-parser qwen3 / deepseek_r1) gives the same reasoning and
content whatever the chunking of the text (whole, character by character, random pieces), the
same as an independent reference written here from the rules over the whole text; a tag split
across chunks is held back, never leaked; where the reasoning starts follows the prompt's last
think tag and the parser; tool calls are parsed from the content part only, and streamed chat
deltas join into the non-streamed message."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from services.router.api.choice_text import ChoiceText, message_fields
from services.router.api.reasoning import (
    Piece,
    Reasoning,
    ReasoningPlan,
    ThinkSplitter,
    prompt_think_state,
    reasoning_plan,
)
from services.router.api.tool_parser import Content
from services.router.api.tools import ToolPlan

START, END = "<think>", "</think>"


def _call(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


TEXTS = {
    "qwen3 thinking": "<think>\nThe user greets me.\n</think>\n\nHello!",
    "empty think": "<think>\n\n</think>\n\nHello!",
    "no tags": "Hello, how can I help?",
    "only the end tag": "Okay, 9.8 is larger.\n</think>\n\n9.8 is greater than 9.11.",
    "cut short while thinking": "<think>\nLet me count: 1, 2, 3",
    "cut short, no start": "Let me count: 1, 2, </thi",
    "text before the start": "Sure. <think>hm</think> Done.",
    "two starts": "a<think>b<think>c</think>d<think>e</think>f",
    "tag-like text": "a < b, <thin k> and </ think> and <thinking> are no tags </think> x <",
    "end only at the end": "<think>abc</think>",
    "unicode": "<think>日本語 é \U0001f600</think>\n答え",
    "tool call after think": "<think>\nNeed the weather.\n</think>\n\n"
                             + _call("get_weather", {"city": "Paris"}),
    "tool call in reasoning": "<think>I could write " + _call("f", {}) + "</think>ok",
}


def _reference(text: str, reasoning_first: bool) -> tuple[str | None, str]:
    """The rules over the whole text: (reasoning, content); reasoning None when the sample had no
    reasoning part."""
    before = ""
    if reasoning_first:
        start, end = text.find(START), text.find(END)
        if start >= 0 and (end < 0 or start < end):  # the model wrote the start tag itself: dropped
            text = text[:start] + text[start + len(START):]
    else:
        start = text.find(START)
        if start < 0:
            return None, text
        before, text = text[:start], text[start + len(START):]
    reasoning, _, after = text.partition(END)
    return reasoning, before + after


def _run(splitter: ThinkSplitter, pieces: list[str]) -> list[Piece]:
    out: list[Piece] = []
    for piece in pieces:
        out += splitter.feed(piece)
    return out + splitter.finish()


def _joined(pieces: list[Piece], reasoned: bool) -> tuple[str | None, str]:
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    assert reasoned or not reasoning
    return (reasoning if reasoned else None), "".join(p.text for p in pieces if isinstance(p, Content))


def _chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize("first", [False, True], ids=["content-first", "reasoning-first"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_split_is_the_references_whatever_the_chunking(name: str, first: bool) -> None:
    text = TEXTS[name]
    expected = _reference(text, first)
    for pieces in _chunkings(text, seed=len(text)):
        splitter = ThinkSplitter(first)
        got = _run(splitter, pieces)
        assert _joined(got, splitter.reasoned) == expected, pieces
        assert all(p.text for p in got)  # no empty pieces


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("name", list(TEXTS))
def test_nothing_goes_out_that_a_later_chunk_turns_into_a_tag(name: str, first: bool) -> None:
    """Character by character, what went out so far of each part is a prefix of that part's
    final text: a tag's first characters are held back, not sent as text."""
    text = TEXTS[name]
    reasoning, content = _reference(text, first)
    splitter, sent = ThinkSplitter(first), {Reasoning: "", Content: ""}
    for ch in text:
        for piece in splitter.feed(ch):
            sent[type(piece)] += piece.text
        assert (reasoning or "").startswith(sent[Reasoning]) and content.startswith(sent[Content])


def test_a_tag_split_across_chunks_is_held_back() -> None:
    qwen3 = ThinkSplitter(reasoning_first=False)
    assert qwen3.feed("<thi") == []
    assert qwen3.feed("nk>\nLet me see") == [Reasoning("\nLet me see")]
    assert qwen3.feed(". </") == [Reasoning(". ")]
    assert qwen3.feed("think") == []
    assert qwen3.feed(">\n\nHi <") == [Content("\n\nHi <")]  # after </think>: nothing is held
    assert qwen3.finish() == []
    plain = ThinkSplitter(reasoning_first=False)
    assert plain.feed("a <t") == [Content("a ")]
    assert plain.feed("able>") == [Content("<table>")]
    assert plain.feed("x <th") == [Content("x ")]
    assert plain.finish() == [Content("<th")]  # the sample ended: what was held is text


def test_deepseek_r1_reasoning_needs_no_start_tag() -> None:
    """A prompt that opened the think block (or, for deepseek_r1, has no think tag): everything up
    to </think> is reasoning; a start tag the model writes anyway is dropped."""
    got = _run(ThinkSplitter(True), ["9.8 > 9.11", "</think>", "9.8"])
    assert _joined(got, True) == ("9.8 > 9.11", "9.8")
    assert _joined(_run(ThinkSplitter(True), ["<think>\nx</think>y"]), True) == ("\nx", "y")
    assert _joined(_run(ThinkSplitter(True), ["still thinking"]), True) == ("still thinking", "")


def test_qwen3_without_tags_is_all_content_and_cut_short_thinking_is_reasoning() -> None:
    """enable_thinking false: the template closed an empty think block in the prompt and the
    model writes no tags: all content. A sample cut inside <think> has only reasoning."""
    splitter = ThinkSplitter(False)
    assert _run(splitter, ["Hello", " there </think> x"]) == [Content("Hello"), Content(" there </think> x")]
    assert not splitter.reasoned
    assert _joined(_run(ThinkSplitter(False), ["<think>abc"]), True) == ("abc", "")


class SingleTagTokenizer:
    """A tokenizer writing each think tag as one token (as Qwen3's and DeepSeek-R1's): ids 1 and 2,
    other characters their code point + 10."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in (START, END) if text.startswith(t, i)), None)
            ids.append((1 if tag == START else 2) if tag else ord(text[i]) + 10)
            i += len(tag) if tag else 1
        return type("Encoding", (), {"input_ids": ids})()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(START if t == 1 else END if t == 2 else chr(t - 10) for t in ids)


@pytest.fixture(scope="module")
def smollm() -> Any:
    """The default model's tokenizer: its think tags are several tokens each."""
    from engine.config import DEFAULT_MODEL
    from engine.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


PROMPTS = {  # prompt text -> the state of its last think tag
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": None,
    "<|im_start|>assistant\n<think>\n": "open",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n": "closed",
    "<think>old</think>turn<|im_end|>\n<|im_start|>assistant\n<think>\n": "open",
    "<|im_start|>assistant\n<think>\nA long partial thought " + "x " * 100: "open",
}


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_the_prompts_last_think_tag_is_found_by_id_or_in_its_text(prompt: str, smollm: Any) -> None:
    single = SingleTagTokenizer()
    assert prompt_think_state(single, single(prompt).input_ids) == PROMPTS[prompt]
    if len(smollm(START, add_special_tokens=False).input_ids) > 1 and "x x" not in prompt:  # its text's tail
        assert prompt_think_state(smollm, smollm(prompt).input_ids) == PROMPTS[prompt]


@pytest.mark.parametrize(("parser", "prompt", "first"), [
    ("qwen3", "assistant\n", False), ("deepseek_r1", "assistant\n", True),
    ("qwen3", "assistant\n<think>\n", True), ("deepseek_r1", "assistant\n<think>\n", True),
    ("qwen3", "<think>\n\n</think>\n\n", False), ("deepseek_r1", "<think>\n\n</think>\n\n", False),
])
def test_where_the_reasoning_starts(parser: str, prompt: str, first: bool) -> None:
    tok = SingleTagTokenizer()
    plan = reasoning_plan(parser, tok, tok(prompt).input_ids, include=True, constrained=False)
    assert plan == ReasoningPlan(parser, first, True, True)
    assert reasoning_plan(None, tok, [], include=True, constrained=False) is None
    constrained = reasoning_plan(parser, tok, tok(prompt).input_ids, include=False, constrained=True)
    assert constrained is not None and constrained.splitter() is None and not constrained.include


def _stream(text: ChoiceText, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], set[str]]:
    """Streamed deltas joined as the openai client's users do: reasoning, content, calls, keys."""
    reasoning, content, calls, keys = "", "", dict[int, list[str]](), set()
    for k, piece in enumerate(pieces):
        for d in text.deltas(piece, k == len(pieces) - 1):
            keys |= set(d)
            assert d.get("reasoning") == d.get("reasoning_content")
            reasoning += d.get("reasoning") or ""
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = [c["function"]["name"], ""]
                else:
                    calls[c["index"]][1] += c["function"]["arguments"]
    return reasoning, content, [(n, a) for n, a in calls.values()], keys


AUTO = ToolPlan("auto")
QWEN3 = ReasoningPlan("qwen3")


@pytest.mark.parametrize(("name", "tools", "reasoning", "content", "calls"), [
    ("tool call after think", AUTO, "\nNeed the weather.\n", None, [("get_weather", '{"city": "Paris"}')]),
    ("tool call in reasoning", AUTO, "I could write " + _call("f", {}), "ok", []),
    ("qwen3 thinking", AUTO, "\nThe user greets me.\n", "\n\nHello!", []),
    ("qwen3 thinking", None, "\nThe user greets me.\n", "\n\nHello!", []),
    ("end only at the end", None, "abc", None, []),  # only reasoning: content null (vLLM's)
    ("no tags", AUTO, None, "Hello, how can I help?", []),
])
def test_tool_calls_come_from_the_content_part_streamed_or_not(
        name: str, tools: ToolPlan | None, reasoning: str | None, content: str | None,
        calls: list[tuple[str, str]]) -> None:
    text = TEXTS[name]
    message = ChoiceText(tools, QWEN3).message(text)
    assert (message.reasoning, message.content) == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls] == calls
    for pieces in _chunkings(text, seed=3):
        streamed = ChoiceText(tools, QWEN3)
        got = _stream(streamed, pieces)
        assert got[:3] == (reasoning or "", content or "", calls), pieces
        assert streamed.finish_reason("stop") == ("tool_calls" if calls else "stop")


def test_include_reasoning_false_drops_the_reasoning_part() -> None:
    text = TEXTS["tool call after think"]
    plan = ReasoningPlan("qwen3", include=False)
    message = ChoiceText(AUTO, plan).message(text)
    assert message.reasoning is None and len(message.tool_calls) == 1
    assert message_fields(message, "")["reasoning"] is None  # the keys stay, null (vLLM's)
    for pieces in _chunkings(text, seed=5):
        _, _, calls, keys = _stream(ChoiceText(AUTO, plan), pieces)
        assert not {"reasoning", "reasoning_content"} & keys and len(calls) == 1


def test_message_fields_name_both_reasoning_keys_under_a_parser_only() -> None:
    think = ChoiceText(None, QWEN3).message(TEXTS["qwen3 thinking"])
    assert message_fields(think, "") == {"content": "\n\nHello!", "reasoning": "\nThe user greets me.\n",
                                         "reasoning_content": "\nThe user greets me.\n"}
    plain = ChoiceText(None, QWEN3).message("Hi")
    assert message_fields(plain, "") == {"content": "Hi", "reasoning": None, "reasoning_content": None}
    off = ChoiceText(AUTO, None).message(TEXTS["qwen3 thinking"])  # no --reasoning-parser: unchanged
    assert message_fields(off, "") == {"content": TEXTS["qwen3 thinking"]}
    constrained = ChoiceText(None, ReasoningPlan("qwen3", split=False)).message("<think>x</think>{}")
    assert message_fields(constrained, "")["content"] == "<think>x</think>{}"


def test_the_router_flags() -> None:
    import argparse

    from services.cli import build_parser
    from services.router.api.reasoning import REASONING_PARSERS
    from services.router.config import RouterConfig
    from services.up.specs import tool_args

    base: dict[str, Any] = {"model": "m", "tokenizer": "m"}
    assert RouterConfig(**base, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser"):
        RouterConfig(**base, reasoning_parser="granite")
    parser, router = build_parser(), ["router", "--model", "m", "--decode", "d:1"]
    for name in REASONING_PARSERS:
        assert parser.parse_args([*router, "--reasoning-parser", name]).reasoning_parser == name
        up = parser.parse_args(["up", "--reasoning-parser", name])
        assert tool_args(up, "/nowhere")[-5:] == ["--reasoning-parser", name, "--tool-call-parser",
                                                   "hermes", "--enable-auto-tool-choice"]
    assert parser.parse_args(router).reasoning_parser is None
    assert "--reasoning-parser" not in tool_args(argparse.Namespace(model="x", chat_template=None),
                                                  "/nowhere")
    with pytest.raises(SystemExit):
        parser.parse_args([*router, "--reasoning-parser", "granite"])
