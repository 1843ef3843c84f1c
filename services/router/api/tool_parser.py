"""Tool calls in a sample's text, found as the text streams in (vLLM's tool parsers):

    parser = HermesParser()                  # tool_choice "auto", --tool-call-parser hermes
    events = parser.feed("Let me check.\\n<tool_")   # [Content("Let me check.")]: the rest may be a tag
    events += parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    events += parser.finish()                # the sample ended: nothing is held back any more

Every parser gives the same events whatever the chunking of its text (as text and arguments
concatenate): a non-streamed reply feeds the whole text at once, a stream each delta as it comes,
so streamed and non-streamed replies agree by construction. Events:

- `Content(text)`: text of the reply's message;
- `CallStart(index, name)`: a call begins (its id and header chunk go out);
- `CallArguments(index, text)`: the next piece of that call's arguments (JSON text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """The events `text` (the next piece of the sample) completes."""
        ...

    def finish(self) -> list[Event]:
        """The events of what was held back, once the sample has ended."""
        ...


START, END = "<tool_call>", "</tool_call>"


class HermesParser:
    """Hermes / Qwen2.5 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    anywhere in the text (an unclosed one at the end counts too, as vLLM's hermes parser). A
    block whose JSON is not an object with a string `name` stays content, as written. The
    whitespace around a call's block goes with it; content on both sides of calls is joined by
    the whitespace that came before them. Text that may begin a block (a tag's first characters,
    trailing whitespace) waits for the next piece, and a block for its end: a call goes out
    whole, its arguments as `json.dumps` writes them (as vLLM's non-streamed)."""

    def __init__(self) -> None:
        self._text = ""  # not yet turned into events
        self._inside = False  # _text is the inside of an open block
        self._space = ""  # whitespace before the open block
        self._after_call = False  # whitespace after a call's block is dropped
        self._said = False  # some content went out
        self._separator = ""  # whitespace before the last calls: goes out before more content
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._text.find(END)
                if end < 0 and not final:
                    return events
                closed = end >= 0
                block = self._text[:end] if closed else self._text
                self._text = self._text[end + len(END):] if closed else ""
                self._inside = False
                events += self._block(block, closed)
                continue
            if self._after_call:
                self._text = self._text.lstrip()
                self._after_call = not self._text and not final
            start = self._text.find(START)
            if start < 0:
                keep = 0 if final else _held(self._text)
                events += self._content(self._text[:len(self._text) - keep])
                self._text = self._text[len(self._text) - keep:]
                return events
            before = self._text[:start]
            events += self._content(before.rstrip())
            self._space = before[len(before.rstrip()):]
            self._text = self._text[start + len(START):]
            self._inside = True

    def _block(self, block: str, closed: bool) -> list[Event]:
        call = _hermes_call(block)
        if call is None:
            return self._content(self._space + START + block + (END if closed else ""))
        self._separator = self._separator or self._space
        self._after_call = True
        self._calls += 1
        return [CallStart(self._calls - 1, call[0]), CallArguments(self._calls - 1, call[1])]

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._said:
            text = self._separator + text
        self._said, self._separator = True, ""
        return [Content(text)]


def _hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's `{"name": ..., "arguments": ...}`, else None."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)


def _held(text: str) -> int:
    """How many characters at the end of `text` may begin a block: a proper prefix of the start
    tag, and the whitespace before it."""
    tag = next(k for k in range(min(len(START) - 1, len(text)), -1, -1) if text.endswith(START[:k]))
    rest = len(text) - tag
    while rest and text[rest - 1].isspace():
        rest -= 1
    return len(text) - rest


class NamedParser:
    """tool_choice naming a function: the whole text is that call's arguments (the grammar made
    it the function's parameters object), streamed as it comes, as vLLM's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        return [*self._start(), CallArguments(0, text)]

    def finish(self) -> list[Event]:
        return self._start()  # a call even with no text (it then has no arguments)

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [CallStart(0, self.name)]


class RequiredParser:
    """tool_choice "required": the text is a JSON array of `{"name": ..., "parameters": {...}}`
    (the grammar's); each element is a call once its closing brace arrives, its arguments the
    parameters as `json.dumps` writes them (as vLLM's). What never formed a call (a sample cut
    short by max_tokens) is content at the end."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # scanned up to here
        self._done = 0  # turned into events (or skipped) up to here
        self._state = "before"  # before -> array <-> element -> after; broken: not the grammar's form
        self._depth = 0  # brackets open inside the current element
        self._in_string = False
        self._escaped = False
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        while self._pos < len(self._text) and self._state != "broken":
            ch = self._text[self._pos]
            events += self._in_element(ch) if self._state == "element" else self._between(ch)
            self._pos += 1
        return events

    def finish(self) -> list[Event]:
        rest, self._done = self._text[self._done:], len(self._text)
        return [Content(rest)] if rest.strip() else []

    def _between(self, ch: str) -> list[Event]:
        """Outside the elements: the array's brackets, its commas and whitespace are skipped."""
        state = self._state
        if state == "array" and ch == "{":
            self._state, self._depth = "element", 1
            return []  # the element starts here (_done stays at its brace)
        if ch.isspace() or (state == "array" and ch == ","):
            pass
        elif (state, ch) in (("before", "["), ("array", "]")):
            self._state = "array" if ch == "[" else "after"
        else:
            self._state = "broken"  # the rest is content at the end
            return []
        self._done = self._pos + 1
        return []

    def _in_element(self, ch: str) -> list[Event]:
        if self._in_string:
            self._escaped, self._in_string = (False, True) if self._escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            if self._depth == 0:
                self._state = "array"
                return self._element(self._text[self._done:self._pos + 1])
        return []

    def _element(self, text: str) -> list[Event]:
        self._done = self._pos + 1
        call = _required_call(text)
        if call is None:
            return [Content(text)]
        self._calls += 1
        return [CallStart(self._calls - 1, call[0]), CallArguments(self._calls - 1, call[1])]


def _required_call(text: str) -> tuple[str, str] | None:
    try:
        element: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(element, dict) or not isinstance(element.get("name"), str):
        return None
    return element["name"], json.dumps(element.get("parameters", {}), ensure_ascii=False)
