"""OpenAI response bodies and SSE streams from a request's deltas (completions and chat).

    reply = Reply(gen, model, request_id, prompt_lens=(12,), n=2, chat=True, include_usage=False)
    return await respond(reply, deltas, stream=True, admission=admission)

Choice `k * n + i` is sample i of prompt k (vLLM's numbering); usage sums the prompts.

Errors before the first delta are HTTP statuses; errors after a streamed response started are an
error event followed by `[DONE]`, as vLLM's server does.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from engine.detokenizer import decode_token
from services.router.api.choice_text import ChoiceText, message_fields
from services.router.api.openai_models import completion_body, error_body, usage_body
from services.router.api.prompt_render import echo_logprobs, prompt_logprobs_body, top_candidates
from services.router.api.reasoning import ReasoningPlan
from services.router.api.tools import ToolPlan
from services.router.dispatch.dispatcher import NoWorkerError
from services.router.errors import from_dispatch
from services.router.fanout import Delta
from services.router.generation import Admission, Generator
from services.router.http.hot_path import SSEResponse
from services.worker.client import WorkerError


@dataclass(frozen=True)
class Reply:
    """What every chunk of one response shares."""

    gen: Generator
    model: str
    request_id: str
    prompt_lens: tuple[int, ...]  # of each prompt of the batch
    n: int  # choices per prompt
    chat: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk carries usage so far (vLLM's continuous_usage_stats)
    role: str = "assistant"  # of a chat reply's messages
    echo: str = ""  # what every chat choice's content starts with (vLLM's echo)
    # Completions echo: each prompt's text, and where its generated tokens' text_offset starts.
    echo_prompts: tuple[str, ...] = ()
    echo_offsets: tuple[int, ...] = ()
    prompts: tuple[list[int], ...] = ()  # each prompt's ids (for echo with logprobs)
    logprobs: int | None = None  # completions' logprobs (top-N), None when not asked
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top-N), None when not asked
    tools: ToolPlan | None = None  # a chat's tool calls are parsed out of its text (tools.py)
    reasoning: ReasoningPlan | None = None  # a chat's reasoning is split off its text (reasoning.py)

    @property
    def parsed(self) -> bool:
        """Whether a chat's text goes through parsers (choice_text.py) rather than out as content."""
        return self.tools is not None or self.reasoning is not None

    def choice_text(self) -> ChoiceText:
        return ChoiceText(self.tools, self.reasoning)

    @property
    def num_choices(self) -> int:
        return len(self.prompt_lens) * self.n

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, chunk: bool
             ) -> dict[str, Any]:
        return completion_body(self.request_id, self.model, choices, usage, chunk=chunk, chat=self.chat)


async def respond(reply: Reply, deltas: AsyncGenerator[Delta, None], stream: bool,
                  admission: Admission) -> JSONResponse | StreamingResponse:
    """The response: an SSE stream (which then owns the admission) or one JSON body."""
    streaming = False  # once the stream owns the admission, it releases it
    retry = reply.gen.config.retry_after_s
    try:
        first = await first_delta(deltas, retry)
        if stream:
            streaming = True
            return SSEResponse(_stream(reply, first, deltas, admission), media_type="text/event-stream",
                               background=BackgroundTask(admission.release_async))
        try:
            async with aclosing(deltas):
                collected = [d for d in [first] + [d async for d in deltas] if not d.accepted]
        except (WorkerError, NoWorkerError) as e:
            raise from_dispatch(e, retry) from e
        return JSONResponse(_full_body(reply, collected))
    finally:
        if not streaming:
            admission.release()


async def first_delta(deltas: AsyncGenerator[Delta, None], retry_after_s: int) -> Delta:
    """A request's first delta; a worker's failure before it is the client's HTTP error (the
    samples' calls cancelled)."""
    try:
        return await anext(deltas)
    except (WorkerError, NoWorkerError) as e:
        await deltas.aclose()
        raise from_dispatch(e, retry_after_s) from e


async def _stream(reply: Reply, first: Delta, deltas: AsyncGenerator[Delta, None],
                  admission: Admission) -> AsyncIterator[str]:
    try:
        async for chunk in _stream_chunks(reply, first, deltas):
            yield chunk
    finally:
        admission.release()


async def _stream_chunks(reply: Reply, first: Delta, deltas: AsyncGenerator[Delta, None]
                         ) -> AsyncIterator[str]:
    finals: dict[int, Delta] = {}
    started: set[int] = set()
    parsers: dict[int, ChoiceText] = {}  # each chat choice's reasoning and tool-call parsers
    try:
        async with aclosing(deltas):
            delta: Delta | None = first
            while delta is not None:
                if delta.accepted:
                    delta = await anext(deltas, None)
                    continue
                first_events = ""  # a sample's first chat events (role, echo) leave with its text
                opening = delta.index not in started
                started.add(delta.index)
                if reply.chat and opening:
                    first_events = _chat_start(reply, delta.index)
                if delta.finish_reason:
                    finals[delta.index] = delta
                if reply.parsed:
                    mine = parsers.setdefault(delta.index, reply.choice_text())
                    choices = _parsed_choices(reply, delta, mine, opening)
                else:
                    choices = [_choice(reply, delta, stream=True, first=opening)]
                usage = _so_far(reply, delta.index, delta.completion_tokens, delta.cached_tokens)
                bodies = [reply.body([choice], usage, chunk=True) for choice in choices]
                if bodies and reply.chat and opening and delta.index == 0:
                    _chat_prompt_logprobs(reply, bodies[0], delta)
                if first_events or bodies:
                    yield first_events + "".join(_sse(body) for body in bodies)
                delta = await anext(deltas, None)
    except (WorkerError, NoWorkerError) as e:
        error = from_dispatch(e, reply.gen.config.retry_after_s)
        yield _sse(error_body(error.message, "server_error", None, error.code))
    if reply.include_usage:
        yield _sse(reply.body([], _usage(reply, finals.values()), chunk=True))
    yield "data: [DONE]\n\n"


def _chat_start(reply: Reply, index: int) -> str:
    """A chat choice's first events: its role, then what it echoes (vLLM's order)."""
    usage = _so_far(reply, index, 0)
    events = [{"role": reply.role, "content": ""}] + ([{"content": reply.echo}] if reply.echo else [])
    return "".join(_sse(reply.body([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}],
                                   usage, chunk=True)) for d in events)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _full_body(reply: Reply, deltas: Sequence[Delta]) -> dict[str, Any]:
    by_choice: dict[int, list[Delta]] = {i: [] for i in range(reply.num_choices)}
    for d in deltas:
        by_choice[d.index].append(d)
    choices = []
    for i, mine in by_choice.items():
        merged = Delta(i, "".join(d.text for d in mine), [t for d in mine for t in d.token_ids],
                       [lp for d in mine for lp in d.logprobs], mine[-1].finish_reason,
                       mine[-1].completion_tokens, mine[0].cached_tokens, mine[0].text_offset,
                       mine[0].top_n, next((d.prompt_logprobs for d in mine if d.prompt_logprobs), []))
        choices.append(_choice(reply, merged, stream=False, first=True))
        if i == 0:
            first = merged
    finals = [d for d in deltas if d.finish_reason]
    body = reply.body(choices, _usage(reply, finals), chunk=False)
    if reply.chat:
        _chat_prompt_logprobs(reply, body, first)
    return body


def _chat_prompt_logprobs(reply: Reply, body: dict[str, Any], delta: Delta) -> None:
    """vLLM's chat responses carry prompt_logprobs at the top level (the one prompt's)."""
    if reply.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(reply.gen.tokenizer, delta.prompt_logprobs,
                                                       reply.prompt_logprobs)


def _so_far(reply: Reply, index: int, completion_tokens: int, cached_tokens: int = 0
            ) -> dict[str, Any] | None:
    """A chunk's usage: None, or with continuous usage the choice's prompt and its tokens so far
    (as vLLM counts them per choice)."""
    if not reply.continuous_usage:
        return None
    return usage_body(reply.prompt_lens[index // reply.n], completion_tokens, cached_tokens)


def _usage(reply: Reply, finals: Iterable[Delta]) -> dict[str, Any]:
    """Every prompt's tokens and every choice's; cached: each prompt's most cached, summed."""
    finals = list(finals)
    cached: dict[int, int] = {}
    for d in finals:
        cached[d.index // reply.n] = max(cached.get(d.index // reply.n, 0), d.cached_tokens)
    return usage_body(sum(reply.prompt_lens), sum(d.completion_tokens for d in finals),
                      sum(cached.values()))


def _choice(reply: Reply, delta: Delta, stream: bool, first: bool) -> dict[str, Any]:
    """One choice of a body or chunk; `first`: the choice's first (its echo and prompt logprobs)."""
    logprobs = _logprobs(reply, delta) if delta.logprobs else None
    if not reply.chat:
        k = delta.index // reply.n
        echo = first and bool(reply.echo_prompts)
        if echo and reply.logprobs is not None:
            logprobs = _joined(echo_logprobs(reply.gen.tokenizer, reply.prompts[k], delta.prompt_logprobs,
                                             reply.logprobs), logprobs)
        choice = {"index": delta.index, "text": (reply.echo_prompts[k] if echo else "") + delta.text,
                  "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if reply.prompt_logprobs is not None:
            choice["prompt_logprobs"] = (prompt_logprobs_body(reply.gen.tokenizer, delta.prompt_logprobs,
                                                              reply.prompt_logprobs) if first else None)
        return choice
    if stream:
        return {"index": delta.index, "delta": {"content": delta.text}, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}
    if not reply.parsed:
        return {"index": delta.index, "message": {"role": reply.role, "content": reply.echo + delta.text},
                "logprobs": logprobs, "finish_reason": delta.finish_reason}
    parsed = reply.choice_text()
    message = {"role": reply.role, **message_fields(parsed.message(delta.text), reply.echo)}
    return {"index": delta.index, "message": message, "logprobs": logprobs,
            "finish_reason": parsed.finish_reason(delta.finish_reason)}


def _parsed_choices(reply: Reply, delta: Delta, parsed: ChoiceText, opening: bool) -> list[dict[str, Any]]:
    """A streamed chat delta through its choice's parsers (reasoning, tool calls): one chunk's
    choice per delta body (a call's header and its arguments go in chunks of their own), the
    logprobs on the first, the finish_reason on the last; none while the parsers hold the text
    back, unless the delta carries logprobs, ends the choice or opens it (its prompt logprobs)."""
    bodies = parsed.deltas(delta.text, bool(delta.finish_reason))
    if not bodies and (delta.finish_reason or delta.logprobs or opening):
        bodies = [{}]
    logprobs = _logprobs(reply, delta) if delta.logprobs else None
    finish = parsed.finish_reason(delta.finish_reason)
    return [{"index": delta.index, "delta": body, "logprobs": logprobs if k == 0 else None,
             "finish_reason": finish if k == len(bodies) - 1 else None} for k, body in enumerate(bodies)]


def _joined(echo: dict[str, Any], generated: dict[str, Any] | None) -> dict[str, Any]:
    """Completions logprobs of the echoed prompt followed by the generated tokens'."""
    if generated is None:
        return echo
    return {key: echo[key] + generated[key] for key in echo}


def delta_logprobs(reply: Reply, delta: Delta) -> list[dict[str, Any]]:
    """A chat reply's delta's logprobs as chat's `logprobs.content` entries (the Responses API's
    output_text logprobs have the same form)."""
    content: list[dict[str, Any]] = _logprobs(reply, delta)["content"]
    return content


def _logprobs(reply: Reply, delta: Delta) -> dict[str, Any]:
    """OpenAI logprobs of the delta's tokens; the first candidate of each position is the sampled token."""
    tok = reply.gen.tokenizer
    positions = [(decode_token(tok, tid), pos)
                 for tid, pos in zip(delta.token_ids, delta.logprobs, strict=False)]
    sampled = [pos[0].logprob if pos else 0.0 for _, pos in positions]
    tops = [[(decode_token(tok, c.token_id), c.logprob)
             for c in top_candidates(pos, delta.top_n, not reply.chat)] for _, pos in positions]
    offset = delta.text_offset + (reply.echo_offsets[delta.index // reply.n] if reply.echo_offsets else 0)
    if reply.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                              for s, v in top]}
                            for (t, _), lp, top in zip(positions, sampled, tops, strict=True)]}
    return {"tokens": [t for t, _ in positions], "token_logprobs": sampled,
            "top_logprobs": [dict(top) for top in tops],
            "text_offset": list(itertools.accumulate((len(t) for t, _ in positions[:-1]),
                                                     initial=offset)) if positions else []}
