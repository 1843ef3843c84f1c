"""The runner's proposer: after a step's tokens are known, drafts for each request that goes on
decoding, sized per request by engine/spec/adaptive.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from engine.sampling_params import SamplingParams
from engine.spec.adaptive import DraftBudget
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import propose_ngram
from engine.spec.suffix import SuffixProposer


class DraftSource(Protocol):
    """What the proposer reads of a request (the runner's RequestState)."""

    req_id: str
    sampling_params: SamplingParams
    token_buf: np.ndarray
    num_tokens: int


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._budgets: dict[str, DraftBudget] = {}
        self.suffix = None if config.method != "suffix" else SuffixProposer(
            config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)

    def forget(self, req_ids: Iterable[str], outputs: dict[str, list[int]] | None = None) -> None:
        """Drops the requests' state; `outputs` (finished requests' output tokens) feed the
        suffix method's worker-wide trie."""
        for req_id in req_ids:
            self._budgets.pop(req_id, None)
            if self.suffix is not None:
                self.suffix.finished(req_id, (outputs or {}).get(req_id))

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        self._budget(req_id).record(num_drafted, num_accepted)

    def propose(self, states: Iterable[DraftSource], num_decoding: int) -> dict[str, list[int]]:
        """Drafts for the next step of each request (none when more than
        `disable_by_batch_size` requests decode; the scheduler keeps of a constrained request's
        drafts those its grammar accepts)."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and num_decoding > cfg.disable_by_batch_size:
            return {}
        drafts: dict[str, list[int]] = {}
        share = cfg.draft_tokens_per_step // max(1, num_decoding)  # as the scheduler cuts them
        for s in states:
            k = min(self._budget(s.req_id).length(cfg.num_speculative_tokens), share,
                    self.max_model_len - s.num_tokens - 1)
            if k < 1:
                continue
            tokens = s.token_buf[:s.num_tokens]
            if self.suffix is not None:
                d = self.suffix.propose(s.req_id, tokens.tolist(), k)
            else:
                d = propose_ngram(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d:
                drafts[s.req_id] = d
        return drafts

    def _budget(self, req_id: str) -> DraftBudget:
        budget = self._budgets.get(req_id)
        if budget is None:
            budget = self._budgets[req_id] = DraftBudget()
        return budget
