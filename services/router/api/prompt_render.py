"""What a response says about its prompt: completions `echo` (the prompt text, and with
`logprobs` the prompt tokens' logprobs, the first `null`, as OpenAI) and vLLM's
`prompt_logprobs` (per prompt token: `null` for the first, then `{token id: {logprob, rank,
decoded_token}}` with the prompt token and the top-N).

The workers send each prompt position's candidates (the prompt token first, then the top-N) with
a sample's first tokens; render.py calls these for the first delta of each choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.detokenizer import decode_token
from services.worker.client import Logprob, PositionLogprobs


def top_candidates(candidates: Sequence[Logprob], n: int, with_sampled: bool) -> list[Logprob]:
    """The top `n` candidates by rank; with `with_sampled`, also the position's own token (the
    first candidate) when it is outside the top n, as OpenAI and vLLM list completions'."""
    top = sorted((c for c in candidates if 1 <= c.rank <= n), key=lambda c: c.rank)
    if with_sampled and candidates and candidates[0].rank > n:
        top.append(candidates[0])
    return top


def echo_logprobs(tokenizer: Any, prompt_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                  top_n: int) -> dict[str, Any]:
    """Completions logprobs of the echoed prompt: every prompt token, the first without a logprob."""
    tokens = [decode_token(tokenizer, t) for t in prompt_ids]
    token_logprobs: list[float | None] = [None, *(pos[0].logprob if pos else None for pos in positions)]
    tops: list[dict[str, float] | None] = [None, *(
        {decode_token(tokenizer, c.token_id): c.logprob for c in top_candidates(pos, top_n, True)}
        for pos in positions)]
    return {"tokens": tokens, "token_logprobs": token_logprobs[:len(tokens)],
            "top_logprobs": tops[:len(tokens)],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))}


def echo_chars(tokenizer: Any, prompt_ids: Sequence[int]) -> int:
    """Characters of the prompt's token strings (where the generated tokens' text_offset starts)."""
    return sum(len(decode_token(tokenizer, t)) for t in prompt_ids)


def prompt_logprobs_body(tokenizer: Any, positions: Sequence[PositionLogprobs], top_n: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each one its token and
    the top `top_n`, by token id (as a JSON key)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for pos in positions:
        keep = [pos[0], *top_candidates(pos, top_n, False)] if pos else []
        out.append({str(c.token_id): {"logprob": c.logprob, "rank": c.rank,
                                      "decoded_token": decode_token(tokenizer, c.token_id)}
                    for c in keep})
    return out
