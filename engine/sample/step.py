"""The sampling of one step: each sampling request's rows sampled, drafts verified
(engine/spec/verify.py), the emitted tokens appended to the runner's request state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.outputs import LogprobsEntry
from engine.sample.logprobs import sampled_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.spec.verify import accepted_tokens, expand_rows
from engine.structured.bitmask import GrammarBitmask, apply_grammar

if TYPE_CHECKING:
    from engine.spec.decoder import SpecDecoder


@dataclass
class SampleStep:
    req_ids: list[str]  # the requests that sample, in row order
    requests: Mapping[str, Any]  # req_id -> the runner's RequestState
    drafts: dict[str, list[int]]  # req_id -> its drafts this step (requests that have some)
    eos_token_id: int | None
    vocab_size: int
    device: torch.device


def sample_step(sampler: Sampler, logits: torch.Tensor, step: SampleStep,
                grammar: GrammarBitmask | None, spec: SpecDecoder | None
                ) -> list[tuple[list[int], list[LogprobsEntry] | None]]:
    """Per sampling request: the tokens it emits this step and their logprobs entries (None
    unless it asked). logits: [num_rows, vocab], each request's drafts' rows before its last
    token's row (one row without drafts)."""
    states = [step.requests[r] for r in step.req_ids]
    drafts = [step.drafts.get(r, []) for r in step.req_ids]
    rows = expand_rows([s.sampling_params for s in states], [s.output_token_ids for s in states],
                       [s.prompt_token_ids for s in states], drafts)
    row_ids = [r for r, n in zip(step.req_ids, rows.num_rows, strict=True) for _ in range(n)]
    argmax_fix = None if grammar is None else apply_grammar(logits, row_ids, grammar)
    meta = SamplingMetadata.build(rows.params, rows.output_token_ids, rows.prompt_token_ids,
                                  step.eos_token_id, step.vocab_size, step.device)
    out = sampler(logits, meta, argmax_fix)
    tokens = out.sampled_token_ids.tolist()
    entries = sampled_logprobs([p.logprobs for p in rows.params], out, tokens)
    result: list[tuple[list[int], list[LogprobsEntry] | None]] = []
    row = 0
    for state, d, n in zip(states, drafts, rows.num_rows, strict=True):
        kept = accepted_tokens(tokens[row:row + n], d) if d else 0
        emitted = tokens[row:row + kept + 1]
        lps = entries[row:row + kept + 1]
        for token in emitted:
            state.append_token(token)
        if d and spec is not None:
            spec.record(state.req_id, len(d), kept)
        result.append((emitted, None if lps[0] is None else [e for e in lps if e is not None]))
        row += n
    return result
