"""One chat choice's text through the router's parsers: its reasoning split off first (reasoning.py,
with --reasoning-parser), then tool calls parsed out of the content part only (tools.py):

    text = ChoiceText(tools_plan_or_None, reasoning_plan_or_None)   # one per choice
    bodies = text.deltas(delta.text, finished)     # streamed: OpenAI chat delta bodies
    message = text.message(whole_text)             # non-streamed: reasoning, content, calls

Reasoning goes out as vLLM's server sends it: `reasoning` (vLLM >= 0.11.1) and its older name
`reasoning_content` (what clients written for earlier vLLM read), both with the same text; a
non-streamed message under a reasoning parser always has both keys (null without reasoning), a
streamed delta only when it carries reasoning. `include_reasoning: false` drops them. Both
parsers are chunking-invariant, so streamed deltas join into the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.api.reasoning import Reasoning, ReasoningPlan, ThinkSplitter
from services.router.api.tool_parser import Content
from services.router.api.tools import ChoiceCalls, ToolPlan


@dataclass(frozen=True)
class Message:
    """A whole sample's parts: content None when it is only calls (or only reasoning)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    has_reasoning_keys: bool = False  # a reasoning parser is on: the message names both keys


@dataclass
class ChoiceText:
    tools: ToolPlan | None
    reasoning: ReasoningPlan | None
    calls: ChoiceCalls | None = field(init=False)
    splitter: ThinkSplitter | None = field(init=False)

    def __post_init__(self) -> None:
        self.calls = ChoiceCalls(self.tools) if self.tools is not None else None
        self.splitter = self.reasoning.splitter() if self.reasoning is not None else None

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.tools.finish_reason(engine_reason, self.called) if self.tools else engine_reason

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The chat delta bodies of the next piece of text (none while it is held back)."""
        if self.splitter is None:
            return self.calls.deltas(text, finished) if self.calls else _content_bodies(text)
        pieces = self.splitter.feed(text) + (self.splitter.finish() if finished else [])
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                if self._include:
                    out.append(_reasoning_body(piece.text))
            elif self.calls is not None:
                out += self.calls.deltas(piece.text, False)
            else:
                out += _content_bodies(piece.text)
        if finished and self.calls is not None:
            out += self.calls.deltas("", True)
        return _merged(out)

    def message(self, text: str) -> Message:
        """A whole sample's message parts."""
        reasoning, content = None, text
        if self.splitter is not None:
            pieces = self.splitter.feed(text) + self.splitter.finish()
            content = "".join(p.text for p in pieces if isinstance(p, Content))
            if self.splitter.reasoned:
                reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
        calls: list[dict[str, Any]] = []
        final: str | None = content
        if self.calls is not None:
            final, calls = self.calls.message(content)
        if reasoning is not None and not final:
            final = None  # vLLM's: only reasoning, no content
        return Message(final, reasoning if self._include else None, calls, self.reasoning is not None)

    @property
    def _include(self) -> bool:
        return self.reasoning is None or self.reasoning.include


def message_fields(message: Message, echo: str) -> dict[str, Any]:
    """A non-streamed chat message's fields after its role: content (the echo first), the
    reasoning keys under a reasoning parser, and the calls."""
    text = echo + (message.content or "")
    out: dict[str, Any] = {"content": text if text or message.content is not None else None}
    if message.has_reasoning_keys:
        out["reasoning"] = out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    return out


def _reasoning_body(text: str) -> dict[str, Any]:
    return {"reasoning": text, "reasoning_content": text}


def _content_bodies(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


def _merged(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive bodies of the same one kind (content, reasoning) as one."""
    out: list[dict[str, Any]] = []
    for body in bodies:
        last = out[-1] if out else None
        if last is not None and last.keys() == body.keys() and "tool_calls" not in body:
            out[-1] = {key: last[key] + body[key] for key in body}
        else:
            out.append(body)
    return out
