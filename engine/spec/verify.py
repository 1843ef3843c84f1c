"""Verification: sample the target at every drafted position as non-speculative decoding would,
keep the drafts while they equal those samples.

A request with drafts `d_1..d_k` runs its last known token and the drafts through the target in
one forward: `k + 1` logits rows. Row `j` is sampled as the non-speculative step `j` would be if
`d_1..d_j` had been emitted: its outputs so far are the request's outputs plus `d_1..d_j` (what
penalties, min_tokens, bad words and the seeded draw of output position `len(outputs) + j` see).
Then `d_{j+1}` is accepted while it equals row `j`'s token, and the first row that differs (or
row `k`, the bonus token, when all are accepted) gives the last emitted token. Each emitted
token is therefore the token non-speculative decoding samples at its position, given the same
earlier tokens: greedy and seeded outputs are unchanged, and an unseeded token is still a draw
from the target's distribution (a drafted token is kept exactly when the target's own draw is
that token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass
class SampleRows:
    """The sampling rows of one step, a request's drafts expanded into rows of their own."""

    params: list[SamplingParams]
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    num_rows: list[int]  # per request: 1 + its drafts


def expand_rows(params: Sequence[SamplingParams], outputs: Sequence[list[int]],
                prompts: Sequence[list[int]], drafts: Sequence[Sequence[int]]) -> SampleRows:
    """Rows for requests (in order) with `drafts[i]` drafted after their outputs `outputs[i]`."""
    rows = SampleRows([], [], [], [])
    for p, out, prompt, d in zip(params, outputs, prompts, drafts, strict=True):
        rows.num_rows.append(1 + len(d))
        for j in range(len(d) + 1):
            rows.params.append(p)
            rows.output_token_ids.append(out if j == 0 else [*out, *d[:j]])
            rows.prompt_token_ids.append(prompt)
    return rows


def accepted_tokens(row_tokens: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of the drafts are kept: the longest prefix equal to the rows' tokens."""
    a = 0
    while a < len(drafts) and drafts[a] == row_tokens[a]:
        a += 1
    return a
