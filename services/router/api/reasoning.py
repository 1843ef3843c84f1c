"""Reasoning in a chat sample's text, split from its content as the text streams in (vLLM's
`--reasoning-parser qwen3` / `deepseek_r1`):

    plan = reasoning_plan("qwen3", tokenizer, prompt_ids, include=True, constrained=False)
    splitter = plan.splitter()                       # one per choice
    pieces = splitter.feed("<think>\\nhm")          # [Reasoning("\\nhm")]
    pieces += splitter.feed("</thi")                 # []: the rest may be the end tag
    pieces += splitter.feed("nk>\\n\\nHi") + splitter.finish()   # [Content("\\n\\nHi")]

Reasoning is the text between `<think>` and `</think>`; the tags themselves go nowhere, and no
whitespace is trimmed (as vLLM's). Where the sample's reasoning starts:

- the prompt ends inside a think block (its last think tag is `<think>`: Qwen3-Thinking-2507,
  DeepSeek-R1 and Qwen3.5 templates put it after the generation prompt): the sample starts in its
  reasoning, which runs to `</think>` (a `<think>` the model writes before that is dropped);
- else with `qwen3`: the sample is content until a `<think>` (Qwen3 writes it itself; with
  `enable_thinking: false` its template closes an empty think block in the prompt and the sample
  has no tags: all content);
- else with `deepseek_r1`: a prompt with no think tag starts the sample in its reasoning too (the
  start tag may be absent, everything up to `</think>` is reasoning); a prompt whose last tag
  is `</think>` (thinking switched off by the template) starts it in content, as with `qwen3`.

A sample that ends inside its reasoning (cut by max_tokens) is all reasoning so far. After
`</think>` everything is content (later tags included). Every splitter gives the same pieces
whatever the chunking of its text (as the tool parsers, tool_parser.py): a tag split across
chunks is held back until the next chunk says whether it is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.router.api.tool_parser import Content

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
_TAIL_TOKENS = 64  # a prompt's last tokens searched for a think tag that is not one token


@dataclass(frozen=True)
class Reasoning:
    text: str


Piece = Reasoning | Content


class ThinkSplitter:
    """Splits one sample's text into Reasoning and Content pieces (feed-based, chunking-invariant)."""

    def __init__(self, reasoning_first: bool) -> None:
        self._text = ""  # not yet turned into pieces
        self._state: Literal["before", "reasoning", "content"] = "reasoning" if reasoning_first else "before"
        self._started = not reasoning_first  # a <think> inside the reasoning is no longer dropped
        self.reasoned = reasoning_first  # the sample had a reasoning part (possibly empty)

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning part."""
        return self._state == "reasoning"

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._text:
            if self._state == "content":
                out.append(Content(self._text))
                self._text = ""
            elif self._state == "before":
                if not self._cut(out, START, Content, final):
                    break
                self._state, self._started, self.reasoned = "reasoning", True, True
            else:
                start = -1 if self._started else self._text.find(START)
                end = self._text.find(END)
                if start >= 0 and (end < 0 or start < end):  # a <think> inside the reasoning
                    self._cut(out, START, Reasoning, final)
                    self._started = True
                elif self._cut(out, END, Reasoning, final, also=() if self._started else (START,)):
                    self._state = "content"
                else:
                    break
        return out

    def _cut(self, out: list[Piece], tag: str, kind: type[Reasoning] | type[Content], final: bool,
             also: tuple[str, ...] = ()) -> bool:
        """The text before `tag` goes out as `kind` and the tag is consumed (True); without the
        tag, the text goes out but for an end that may begin `tag` (or one of `also`) (False)."""
        at = self._text.find(tag)
        if at < 0:
            keep = 0 if final else _held(self._text, (tag, *also))
            at = len(self._text) - keep
        if at:
            out.append(kind(self._text[:at]))
        found = self._text.startswith(tag, at)
        self._text = self._text[at + len(tag):] if found else self._text[at:]
        return found


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are a proper prefix of one of `tags`."""
    return max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1)
                if text.endswith(tag[:k])), default=0)


@dataclass(frozen=True)
class ReasoningPlan:
    """What one chat request's samples do with their reasoning."""

    parser: str  # one of REASONING_PARSERS
    reasoning_first: bool = False  # samples start inside their reasoning
    include: bool = True  # the request's include_reasoning: False drops the reasoning part
    split: bool = True  # False: a grammar constrains the output (no reasoning): all content

    def splitter(self) -> ThinkSplitter | None:
        return ThinkSplitter(self.reasoning_first) if self.split else None


def reasoning_plan(parser: str | None, tokenizer: Any, prompt_ids: Sequence[int], include: bool,
                   constrained: bool) -> ReasoningPlan | None:
    """The plan of a chat request under the router's --reasoning-parser (None without one).
    `constrained`: a grammar (response_format, structured outputs, tool_choice "required" or
    named) shapes the output from its first token, which then has no reasoning."""
    if parser is None:
        return None
    state = prompt_think_state(tokenizer, prompt_ids)
    first = state == "open" or (state is None and parser == "deepseek_r1")
    return ReasoningPlan(parser, first, include, not constrained)


def prompt_think_state(tokenizer: Any, ids: Sequence[int]) -> Literal["open", "closed"] | None:
    """Whether the prompt's last think tag opens ("open") or closes ("closed") a think block; None
    when it has none. Tags that are one token each (Qwen3's, DeepSeek-R1's) are found in all of
    the prompt's ids, others in the text of its last tokens."""
    start, end = _tag_id(tokenizer, START), _tag_id(tokenizer, END)
    if start is not None and end is not None:
        backwards = list(ids)[::-1]
        at = {tag: (len(backwards) - backwards.index(i) if i in backwards else -1)
              for tag, i in ((START, start), (END, end))}
    else:
        tail = tokenizer.decode(list(ids[-_TAIL_TOKENS:]), skip_special_tokens=False)
        at = {tag: tail.rfind(tag) for tag in (START, END)}
    if at[START] < 0 and at[END] < 0:
        return None
    return "open" if at[START] > at[END] else "closed"


def _tag_id(tokenizer: Any, tag: str) -> int | None:
    """The tag's token id when the tokenizer writes it as one token, else None."""
    ids = tokenizer(tag, add_special_tokens=False).input_ids
    return int(ids[0]) if len(ids) == 1 else None
