"""Keeps a worker's engine serving, and its health truthful.

    guard = EngineGuard(lambda: AsyncLLM(config), GuardOptions(), on_change=set_health)
    await guard.start()           # the first engine; then `guard.engine` serves
    task = asyncio.create_task(guard.run())

Every `check_s` the guard asks the engine about its core process (engine/core_client.py's
heartbeats):
- silent for `unready_after_s` (frozen, stopped, a host stall): not serving (health says
  NOT_SERVING, Load says why, the router sends nothing new); serving again when it speaks;
- died, silent for `silence_s`, or one step running `step_timeout_s`: the core is killed, every
  request on it fails with EngineDeadError (UNAVAILABLE to the caller, which moves it to another
  worker), and a new engine is built. At most `max_restarts` within `restart_window_s`; past
  that the guard gives up (`on_give_up`), and the worker exits non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardOptions:
    check_s: float = 0.5
    unready_after_s: float = 3.0
    silence_s: float = 10.0
    step_timeout_s: float = 300.0
    max_restarts: int = 3
    restart_window_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("check_s", "unready_after_s", "silence_s", "step_timeout_s", "restart_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.unready_after_s > self.silence_s:
            raise ValueError("unready_after_s must not exceed silence_s")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")


class EngineGaveUp(RuntimeError):
    """The engine could not be kept serving within the restart budget."""


class EngineGuard:
    def __init__(self, make_engine: Callable[[], AsyncLLM], options: GuardOptions = GuardOptions(),
                 on_change: Callable[[bool, str], Awaitable[None]] | None = None) -> None:
        self.make_engine = make_engine
        self.options = options
        self.on_change = on_change
        self.engine: AsyncLLM | None = None
        self.reason = "the engine is starting"  # why it does not serve; "" while it does
        self.restarts: deque[float] = deque()
        self.restart_count = 0  # engine restarts since the worker started (pdserve:engine_restarts)
        self.gave_up: str | None = None

    @property
    def serving(self) -> bool:
        """The engine takes requests (a dead one does not, even before the next check)."""
        return self.engine is not None and not self.reason and not self.engine.errored

    def core_alive(self, within_s: float) -> bool:
        """Whether the engine core was heard from within `within_s` (an in-process core: always)."""
        engine = self.engine
        if engine is None or engine.errored:
            return False
        live = engine.engine_core.liveness()
        return live is None or live.silent_s <= within_s

    async def start(self) -> None:
        self.engine = await self._build()
        await self._set("")

    async def _build(self) -> AsyncLLM:
        """A new engine, built in a thread; one whose build outlives a cancellation (the worker
        stopping mid-restart) is shut down when it is ready, not left running."""
        build = asyncio.ensure_future(asyncio.to_thread(self.make_engine))
        try:
            return await asyncio.shield(build)
        except asyncio.CancelledError:
            build.add_done_callback(_shut_down_built)
            raise

    async def run(self) -> None:
        """Watches until cancelled; raises EngineGaveUp when the restart budget is spent."""
        o = self.options
        while True:
            await asyncio.sleep(o.check_s)
            engine = self.engine
            if engine is None:
                continue
            problem = engine.core_problem(o.silence_s, o.step_timeout_s)
            if problem is not None:
                await self._replace(engine, problem)
                continue
            live = engine.engine_core.liveness()
            silent = live is not None and live.silent_s > o.unready_after_s
            await self._set(f"engine core silent for over {o.unready_after_s:g} s" if silent else "")

    async def _replace(self, engine: AsyncLLM, problem: str) -> None:
        o = self.options
        logger.error("engine core cannot serve (%s): failing its requests and restarting it", problem)
        await self._set(f"restarting the engine core: {problem}")
        engine.fail(problem)
        self.engine = None
        await engine.close()
        delay = 1.0
        while True:
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > o.restart_window_s:
                self.restarts.popleft()
            if len(self.restarts) >= o.max_restarts:
                self.gave_up = (f"{problem}; {o.max_restarts} engine restarts in "
                                f"{o.restart_window_s:.0f} s already")
                await self._set(f"gave up: {self.gave_up}")
                raise EngineGaveUp(self.gave_up)
            self.restarts.append(now)
            try:
                self.engine = await self._build()
                self.restart_count += 1  # (a restart that built an engine)
            except Exception as e:  # counts against the budget like a crash
                logger.error("engine restart failed: %r; retrying in %.0f s", e, delay)
                problem = f"engine restart failed: {e}"
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            logger.warning("engine core restarted (%d in the last %.0f s)", len(self.restarts),
                           o.restart_window_s)
            await self._set("")
            return

    async def _set(self, reason: str) -> None:
        if reason == self.reason:
            return
        self.reason = reason
        if reason:
            logger.warning("not serving: %s", reason)
        else:
            logger.info("serving")
        if self.on_change is not None:
            await self.on_change(not reason, reason)

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        self.reason = "stopping"
        if engine is not None:
            await engine.close()


def _shut_down_built(build: asyncio.Future[AsyncLLM]) -> None:
    if not build.cancelled() and build.exception() is None:
        engine = build.result()
        asyncio.get_running_loop().create_task(engine.close())
