"""What the model runner remembers of one request between steps (its tokens, blocks and
sampling parameters: the scheduler sends only what changed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner remembers of one request between steps."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    token_buf: np.ndarray = field(repr=False)  # [capacity] int64, prompt + outputs
    num_tokens: int = 0

    def append_token(self, token_id: int) -> None:
        if self.num_tokens == len(self.token_buf):
            self.token_buf = np.concatenate([self.token_buf, np.zeros_like(self.token_buf)])
        self.token_buf[self.num_tokens] = token_id
        self.num_tokens += 1
        self.output_token_ids.append(token_id)

    def put_drafts(self, drafts: list[int]) -> None:
        """Writes draft tokens after the known ones (`num_tokens` unchanged): the step's inputs
        read them, and the tokens emitted after verification overwrite them."""
        end = self.num_tokens + len(drafts)
        if end > len(self.token_buf):
            self.token_buf = np.concatenate([self.token_buf, np.zeros(end, dtype=np.int64)])
        self.token_buf[self.num_tokens:end] = drafts
