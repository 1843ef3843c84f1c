"""Requests whose preparation is heavy (a large body: parsed, rendered and tokenized in the
tokenizer pool, services/router/prepare.py) are limited per caller and in all, so one client
cannot queue the pool full: over either limit, a 429 with Retry-After at once.

    limit = HeavyLimit(per_caller=2, total=8)
    with limit.slot(caller(scope), retry_after_s=1): ...   # OpenAIError 429 when full
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.router.errors import OpenAIError


class HeavyLimit:
    """Counts heavy requests in progress, by caller and in all (event loop only)."""

    def __init__(self, per_caller: int, total: int) -> None:
        if per_caller < 1 or total < per_caller:
            raise ValueError(f"heavy request limits: per caller >= 1 and total >= per caller, got "
                             f"{per_caller} and {total}")
        self.per_caller, self.total = per_caller, total
        self._running: dict[str, int] = {}
        self.rejected = 0

    @property
    def running(self) -> int:
        return sum(self._running.values())

    @contextmanager
    def slot(self, who: str, retry_after_s: int) -> Iterator[None]:
        mine = self._running.get(who, 0)
        if mine >= self.per_caller or self.running >= self.total:
            self.rejected += 1
            why = (f"{mine} large requests of this client are being prepared (at most {self.per_caller})"
                   if mine >= self.per_caller else f"{self.running} large requests are being prepared "
                                                   f"(at most {self.total})")
            raise OpenAIError(429, f"{why}; retry later", code="rate_limit_exceeded",
                              headers={"Retry-After": str(retry_after_s)})
        self._running[who] = mine + 1
        try:
            yield
        finally:
            left = self._running[who] - 1
            if left:
                self._running[who] = left
            else:
                del self._running[who]
