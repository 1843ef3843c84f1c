"""The draft-model proposer (vLLM's `draft_model` method): a smaller model with the target's
vocabulary guesses the next tokens greedily, one forward per drafted position.

The draft runs in its own `ModelRunner` with its own paged KV cache and block pool (the target's
blocks and scheduler are untouched). Its KV is kept in step with the target's verified tokens:

- A request's first proposal computes the draft's KV of every token the request holds (its
  prompt and outputs: in a split setup, the decode worker builds the draft's KV of the whole
  prompt itself, one draft-model prefill).
- Each later proposal first computes the tokens verified since the last one (from the draft's
  `computed` count on, so the KV of its own drafts, written at those positions before, is
  overwritten with the verified tokens'), which samples draft 1; each further draft is one more
  single-token forward of every drafting request together.
- A request's draft blocks cover its verified tokens and the positions of its drafts. When the
  draft's pool has no room, the request gets no drafts that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclass
class _State:
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # the draft's KV is valid for positions below this (verified tokens)
    known: bool = False  # whether the draft runner holds the request


class DraftModelProposer:
    def __init__(self, model: Any, block_size: int, num_blocks: int, max_num_seqs: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device) -> None:
        from engine.runner import ModelRunner

        self.block_size = block_size
        self.runner = ModelRunner(model, block_size, num_blocks, max_num_seqs, max_model_len,
                                  2048, dtype, device, None, 0)
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 stays unused (a null block)
        self._states: dict[str, _State] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def forget(self, req_id: str) -> None:
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))
            self.runner.requests.pop(req_id, None)

    def propose(self, wanted: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
        """wanted: req_id -> (its verified tokens, how many drafts). Returns the drafts."""
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        left: dict[str, int] = {}
        for req_id, (tokens, k) in wanted.items():
            state = self._states.setdefault(req_id, _State())
            added = self._grow(state, len(tokens) + k - 1)
            if added is None:
                continue
            if not state.known:
                state.known = True
                new.append(NewRequestData(req_id, list(tokens), len(tokens), _GREEDY,
                                          [list(state.blocks)], state.computed))
            else:
                held = self.runner.requests[req_id]  # back to the verified tokens
                held.num_tokens = state.computed
                held.output_token_ids.clear()
                for token in tokens[state.computed:]:
                    held.append_token(token)
                cached.append(CachedRequestData(req_id, [added], state.computed))
            num_scheduled[req_id] = len(tokens) - state.computed
            state.computed = len(tokens)
            left[req_id] = k
        drafts: dict[str, list[int]] = {r: [] for r in left}
        while num_scheduled:
            out = self.runner.execute_model(SchedulerOutput(
                new, cached, num_scheduled, sum(num_scheduled.values()), set()))
            for req_id, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
                drafts[req_id] += sampled
            # the next position of each request still drafting
            going = [r for r in num_scheduled if len(drafts[r]) < left[r]]
            new = []
            cached = [CachedRequestData(r, [[]], self.runner.requests[r].num_tokens - 1)
                      for r in going]
            num_scheduled = {r: 1 for r in going}
        return {r: d for r, d in drafts.items() if d}

    def _grow(self, state: _State, num_positions: int) -> list[int] | None:
        """Blocks for `num_positions` positions; the new block ids, or None when the pool is
        short (nothing taken then)."""
        need = -(-num_positions // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return None
        added = [self._free.pop() for _ in range(max(0, need))]
        state.blocks += added
        return added
