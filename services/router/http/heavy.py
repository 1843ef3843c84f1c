"""Requests prepared off the event loop (a body over inline_bytes: parsed, rendered and
tokenized in the tokenizer pool, services/router/prepare.py) are limited per caller and in all,
so one client cannot queue the pool full: over a limit, a 429 with Retry-After at once. Bodies
over heavy_bytes have a second, tighter limit.

    limits = PoolLimits(config)
    with limits.slot(caller(scope), len(raw)): ...   # OpenAIError 429 when full
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from services.router.errors import OpenAIError

if TYPE_CHECKING:
    from services.router.config import RouterConfig


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


class PoolLimits:
    """The two tiers: every body prepared in the pool, and the heavy ones among them."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pooled = HeavyLimit(config.max_pooled_per_caller, config.max_pooled)
        self.heavy = HeavyLimit(config.max_heavy_per_caller, config.max_heavy)

    @contextmanager
    def slot(self, who: str, size: int) -> Iterator[None]:
        retry = self.config.retry_after_s
        with ExitStack() as held:
            held.enter_context(self.pooled.slot(who, retry))
            if size > self.config.heavy_bytes:
                held.enter_context(self.heavy.slot(who, retry))
            yield
