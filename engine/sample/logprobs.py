"""The sampled tokens' logprobs entries of one step (vLLM's `logprobs`: the sampled token, then
the `n` most likely, with the sampled token's rank)."""

from __future__ import annotations

from engine.core.outputs import LogprobsEntry
from engine.sample.sampler import SamplerOutput


def sampled_logprobs(num_top: list[int | None], out: SamplerOutput, token_ids: list[int]
                     ) -> list[LogprobsEntry | None]:
    """Per sampled row: its entry, or None where its request asked for no logprobs
    (`num_top[row]` None)."""
    if out.logprobs is None:
        return [None] * len(num_top)
    lp = out.logprobs
    top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
    sampled_lps, ranks = lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist()
    entries: list[LogprobsEntry | None] = []
    for row, n in enumerate(num_top):
        if n is None:
            entries.append(None)
            continue
        entries.append(LogprobsEntry(
            token_ids=[token_ids[row], *top_ids[row][:n]],
            logprobs=[sampled_lps[row], *top_lps[row][:n]],
            sampled_rank=ranks[row],
        ))
    return entries
