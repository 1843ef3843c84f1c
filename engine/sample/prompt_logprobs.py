"""Prompt logprobs (vLLM's `prompt_logprobs=N`): for each prompt token after the first, its
logprob under the model given the tokens before it, its rank, and the N most likely tokens
there, from the raw logits (no penalty or temperature applies to the prompt).

The runner calls `prompt_logprobs` for each request that asks, with the rows its scheduled
prompt tokens occupy this step (a chunked prefill gives them chunk by chunk). The scheduler
runs such requests without prefix-cache or KV-store hits, so every position is computed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.core.outputs import LogprobsEntry

_ROWS_PER_PASS = 256  # logits rows at once: [256, vocab] float32 stays small


def prompt_logprobs(model: Any, hidden: torch.Tensor, state: Any, start: int, row_start: int,
                    num_rows: int) -> list[LogprobsEntry]:
    """Entries for the prompt tokens `start + 1 ...` predicted by this step's rows.

    hidden: [num_tokens, hidden] of the whole batch; the request's tokens at positions
    `start .. start + num_rows - 1` are rows `row_start ..`. `state`: the runner's
    RequestState (prompt_token_ids, sampling_params.prompt_logprobs)."""
    prompt: list[int] = state.prompt_token_ids
    end = min(start + num_rows, len(prompt) - 1)  # the last prompt position predicts an output
    if end <= start:
        return []
    rows = hidden[row_start:row_start + (end - start)]  # [n, hidden]
    targets = torch.as_tensor(prompt[start + 1:end + 1], dtype=torch.int64, device=hidden.device)
    return _entries(model.compute_logits, rows, targets, int(state.sampling_params.prompt_logprobs))


def _entries(compute_logits: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor,
             targets: torch.Tensor, top_n: int) -> list[LogprobsEntry]:
    out: list[LogprobsEntry] = []
    for lo in range(0, rows.shape[0], _ROWS_PER_PASS):
        logits = compute_logits(rows[lo:lo + _ROWS_PER_PASS]).to(torch.float32)  # [n, vocab]
        lp = torch.log_softmax(logits, dim=-1)
        tgt = targets[lo:lo + _ROWS_PER_PASS]
        tgt_lp = lp.gather(1, tgt[:, None])  # [n, 1]
        ranks = ((lp > tgt_lp).sum(dim=-1) + 1).tolist()
        if top_n:
            top_lp, top_ids = lp.topk(top_n, dim=-1)
            top_lps, top_idss = top_lp.tolist(), top_ids.tolist()
        else:
            top_lps = top_idss = [[] for _ in ranks]
        for t, t_lp, rank, ids, lps in zip(tgt.tolist(), tgt_lp[:, 0].tolist(), ranks, top_idss,
                                           top_lps, strict=True):
            out.append(LogprobsEntry(token_ids=[t, *ids], logprobs=[t_lp, *lps], sampled_rank=rank))
    return out
