"""Grammar rows for a step in which constrained requests verify drafts: row `j` of a request
is its grammar's bitmask after its first `j` drafts (the scheduler kept only drafts the grammar
accepts), so each drafted position is sampled from what non-speculative decoding would allow
there. Filled on a fork of each matcher: the matcher itself moves only over the emitted tokens,
after the step (the scheduler's `_advance_grammar`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from engine.structured.bitmask import GrammarBitmask, StepMask, additive_mask

if TYPE_CHECKING:
    from engine.structured.backends import Matcher
    from engine.structured.manager import StructuredOutputManager


def draft_rows(structured: StructuredOutputManager, req_ids: list[str], matchers: list[Matcher],
               drafts: dict[str, list[int]], additive: bool) -> GrammarBitmask:
    """Every row filled now, on this thread (no argmax check: drafted rows are masked)."""
    rows: list[str] = []
    positions: list[int] = []
    masks: list[torch.Tensor] = []
    for req_id, matcher in zip(req_ids, matchers, strict=True):
        d = drafts.get(req_id, [])
        fork = matcher.fork() if d else matcher
        for j in range(len(d) + 1):
            masks.append(structured.bitmask([fork]))
            rows.append(req_id)
            positions.append(j)
            if j < len(d) and not fork.accept_tokens([d[j]]):
                raise RuntimeError(f"request {req_id}: draft {j} was refused by its grammar after "
                                   "the scheduler checked it")
    bitmask = torch.cat(masks)
    done: Future[StepMask] = Future()
    done.set_result(StepMask(bitmask, additive_mask(bitmask, structured.vocab_size) if additive
                             else None))
    return GrammarBitmask(rows, done, positions=positions)
