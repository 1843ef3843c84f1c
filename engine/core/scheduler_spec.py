"""The scheduler's side of speculative decoding (pure Python, no tensors).

A running request caught up with its tokens (a decode) is scheduled with the drafts the runner
proposed after its last step: `1 + k` tokens, budget and slots counted for all, `k` cut to what
the budget, `max_model_len` and the request's `max_tokens` leave, and to its share of
`max_draft_tokens_per_step` (that divided by the running requests), and to 0 when more requests
decode than `disable_by_batch_size`, or when the drafts' blocks would not fit (the request then
runs as a plain decode before anything is preempted). A request with a grammar keeps only the
drafts its grammar accepts.

After the step, `num_computed_tokens` goes back over the rejected drafts (their KV is stale and
is overwritten later), the blocks that only they filled are freed, and the emitted tokens are
appended one at a time, each checked for a stop, so a stop token or `max_tokens` met early drops
the tokens after it. Prefix caching, the connector and the store see only verified tokens:
blocks are recorded up to the request's known tokens, never its drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import LogprobsEntry, SpecDecodingStats
from engine.core.request import Request
from engine.core.stop_check import check_stop
from engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.structured.backends import Matcher


def valid_draft(matcher: Matcher, drafts: list[int]) -> int:
    """How many of the drafts, in order, a request's grammar accepts (checked on a fork: the
    request's matcher stays where it is). Drafts end at a token the grammar refuses or after
    the one that ends it; the engine core fills a bitmask row for each drafted position."""
    fork = matcher.fork()
    n = 0
    for token in drafts:
        if fork.is_terminated() or not fork.accept_tokens([token]):
            break
        n += 1
    return n


class SpecSchedule:
    kv: KVCacheManager
    running: list[Request]
    max_model_len: int

    def __init__(self, spec: SpeculativeConfig | None) -> None:
        self.spec_config = spec
        self.spec_stats = (None if spec is None else
                           SpecDecodingStats(accepted_per_pos=[0] * spec.num_speculative_tokens))
        self._trimmed: dict[str, list[int]] = {}  # req_id -> blocks kept per group, runner not told

    def _draft_count(self, request: Request, n: int, budget: int) -> int:
        """How many of the request's drafts join its `n` tokens this step."""
        drafts = request.spec_token_ids
        if not drafts or n != request.num_tokens - request.num_computed_tokens:
            return 0
        cfg = self.spec_config
        if cfg is None or (cfg.disable_by_batch_size is not None
                           and len(self.running) > cfg.disable_by_batch_size):
            return 0
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - request.num_prompt_tokens
        share = cfg.draft_tokens_per_step // max(1, len(self.running))
        k = max(0, min(len(drafts), share, budget - n, self.max_model_len - request.num_tokens - 1,
                       max_tokens - request.num_output_tokens - 1))
        grammar = request.grammar
        if k and grammar is not None and grammar.matcher is not None:
            k = valid_draft(grammar.matcher, drafts[:k])
        return k

    def _verified(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """The step verified `num_drafts` drafts and emitted `num_emitted` tokens: rejected
        drafts' positions are computed again."""
        accepted = num_emitted - 1
        request.num_computed_tokens -= num_drafts - accepted
        assert self.spec_stats is not None
        self.spec_stats.observe(num_drafts, accepted)

    def _append_checked(self, request: Request, token_ids: list[int],
                        lps: list[LogprobsEntry] | None
                        ) -> tuple[list[int], list[LogprobsEntry] | None, bool]:
        """Appends the step's tokens one by one until one ends the request (which the returned
        flag says); returns the tokens and logprobs kept."""
        if len(token_ids) == 1:
            request.append_output_token_ids(token_ids)
            return token_ids, lps, check_stop(request, self.max_model_len)
        for i, token in enumerate(token_ids):
            request.append_output_token_ids([token])
            if check_stop(request, self.max_model_len):
                return token_ids[:i + 1], None if lps is None else lps[:i + 1], True
        return token_ids, lps, False

    def _trim_rejected(self, request: Request) -> None:
        """Frees the blocks past those the request's next step needs (rejected drafts' only)."""
        kept = self.kv.trim(request, request.num_tokens)
        if kept is not None:
            self._trimmed[request.request_id] = kept
