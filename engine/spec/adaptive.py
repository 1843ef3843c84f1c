"""How many tokens to draft for each request, from how many of its drafts were accepted.

The rule, per request (the target's extra cost is about the same for each drafted token, the
gain falls with acceptance):

- it keeps an exponential average `a` (weight 0.3 on the newest step) of the share of its drafted
  tokens that were accepted, starting at 1;
- `a >= 0.5`: it drafts `num_speculative_tokens`; `0.2 <= a < 0.5`: half of them (rounded up);
- `a < 0.2`: it drafts nothing for its next `PAUSE_STEPS` steps, then probes with one token
  (if that is accepted, `a` climbs back);
- a step with more decoding requests than `disable_by_batch_size` drafts nothing (the scheduler
  drops drafts then: at large batches the forward is compute-bound and verifying costs more
  than it saves).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.3
FULL_AT = 0.5
OFF_BELOW = 0.2
PAUSE_STEPS = 8


@dataclass
class DraftBudget:
    """One request's acceptance history."""

    acceptance: float = 1.0
    paused: int = 0  # steps left without drafts

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.acceptance += WEIGHT * (num_accepted / num_drafted - self.acceptance)
        if self.acceptance < OFF_BELOW:
            self.paused = PAUSE_STEPS

    def length(self, k: int) -> int:
        """How many tokens to draft now (out of at most `k`)."""
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0:
                self.acceptance = OFF_BELOW  # the probe: one token, half a chance to climb back
                return 1
            return 0
        if self.acceptance >= FULL_AT:
            return k
        return -(-k // 2)
