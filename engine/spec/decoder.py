"""The runner's proposer: after a step's tokens are known, drafts for each request that goes on
decoding, sized per request by engine/spec/adaptive.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.spec.adaptive import DraftBudget
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import propose_ngram
from engine.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.spec.draft_model import DraftModelProposer


class DraftSource(Protocol):
    """What the proposer reads of a request (the runner's RequestState)."""

    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int]
    token_buf: np.ndarray
    num_tokens: int


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.draft = draft
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
            if self.draft is not None:
                self.draft.forget(req_id)

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
        wanted: dict[str, tuple[list[int], int]] = {}  # the draft model's, all in one batch
        for s in states:
            max_tokens = s.sampling_params.max_tokens
            if max_tokens is not None and len(s.output_token_ids) >= max_tokens:
                continue  # it ends with this step
            k = min(self._budget(s.req_id).length(cfg.num_speculative_tokens), share,
                    self.max_model_len - s.num_tokens - 1)
            if k < 1:
                continue
            tokens = s.token_buf[:s.num_tokens]
            if self.draft is not None:
                wanted[s.req_id] = (tokens.tolist(), k)
                continue
            if self.suffix is not None:
                d = self.suffix.propose(s.req_id, tokens.tolist(), k)
            else:
                d = propose_ngram(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d:
                drafts[s.req_id] = d
        if wanted:
            assert self.draft is not None
            drafts = self.draft.propose(wanted)
        return drafts

    def _budget(self, req_id: str) -> DraftBudget:
        budget = self._budgets.get(req_id)
        if budget is None:
            budget = self._budgets[req_id] = DraftBudget()
        return budget


def draft_proposer(name: str, vocab_size: int, backend: Any, config: EngineConfig,
                   num_blocks: int, dtype: torch.dtype, device: torch.device) -> DraftModelProposer:
    """Loads the draft model (`speculative_config.model`) with the target's dtype and device;
    its KV pool has as many blocks as the target's (the draft's own block size in bytes)."""
    from engine.model.loader import load_model, model_max_len, resolve_model_path
    from engine.spec.draft_model import DraftModelProposer

    draft, hf_config = load_model(resolve_model_path(name), dtype, backend, device, None)
    if model_max_len(hf_config) < config.model_len:
        raise ValueError(f"speculative_config.model: the draft's context ({model_max_len(hf_config)} "
                         f"tokens) is shorter than max_model_len {config.model_len}")
    if draft.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} "
                         f"tokens, the target's {vocab_size}: they must share one tokenizer")
    return DraftModelProposer(draft, config.block_size, num_blocks, config.max_num_seqs,
                              config.model_len, dtype, device)
