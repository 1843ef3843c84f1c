"""`pdserve up --autoscale`: the autoscaler loop in a thread of the launcher, starting and stopping
local worker processes, with its options.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

from services.autoscaler.actuators import LocalProcessActuator
from services.autoscaler.loop import Autoscaler, AutoscalerOptions
from services.autoscaler.observe import RouterObserver
from services.autoscaler.planner import Planner, PlannerConfig
from services.router.http.api_keys import first_api_key

logger = logging.getLogger(__name__)


def _env(name: str, default: Any, kind: Any = float) -> Any:
    """PDSERVE_<NAME> from the environment (the variables compose.yaml uses), else `default`."""
    value = os.environ.get(f"PDSERVE_{name}")
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"PDSERVE_{name}={value!r}: expected a {kind.__name__}") from None


def _flag(value: str) -> bool:
    if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError("expected 1/0, true/false or yes/no")
    return value.lower() in ("1", "true", "yes")


def add_autoscale_args(p: argparse.ArgumentParser) -> None:
    """Options, each defaulting to its PDSERVE_* environment variable (e.g. PDSERVE_TTFT_MS)."""
    g = p.add_argument_group("autoscaling (--autoscale; --prefill/--decode are then the minimums; "
                             "each option also reads PDSERVE_<OPTION>, e.g. PDSERVE_TTFT_MS)")
    g.add_argument("--autoscale", action="store_true", default=_env("AUTOSCALE", False, _flag),
                   help="size the pools from TTFT / ITL targets (PDSERVE_AUTOSCALE=1)")
    g.add_argument("--max-prefill", type=int, default=_env("MAX_PREFILL", 3, int),
                   help="the most prefill workers it runs")
    g.add_argument("--max-decode", type=int, default=_env("MAX_DECODE", 3, int),
                   help="the most decode (or colocated) workers it runs")
    g.add_argument("--ttft-ms", type=float, default=_env("TTFT_MS", 2000.0), help="TTFT p90 target")
    g.add_argument("--itl-ms", type=float, default=_env("ITL_MS", 200.0), help="ITL p90 target")
    g.add_argument("--autoscale-interval-s", type=float, default=_env("AUTOSCALE_INTERVAL_S", 5.0),
                   help="seconds between its observations")
    g.add_argument("--prefill-tokens-per-s", type=float, default=_env("PREFILL_TOKENS_PER_S", 1500.0),
                   help="one prefill worker's throughput, until measured")
    g.add_argument("--up-cooldown-s", type=float, default=_env("UP_COOLDOWN_S", 20.0),
                   help="seconds after a change before a pool grows again")
    g.add_argument("--down-cooldown-s", type=float, default=_env("DOWN_COOLDOWN_S", 60.0),
                   help="seconds after a change before a pool shrinks")
    g.add_argument("--autoscale-log", type=Path, default=_env("AUTOSCALE_LOG", None, Path),
                   help="JSON lines of observations/decisions (default: none)")


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, min_prefill=args.prefill,
                         max_prefill=max(args.prefill, args.max_prefill), min_decode=args.decode,
                         max_decode=max(args.decode, args.max_decode),
                         prefill_tokens_per_s=args.prefill_tokens_per_s, up_cooldown_s=args.up_cooldown_s,
                         down_cooldown_s=args.down_cooldown_s)


class AutoscalerThread:
    """Runs the loop in its own thread and event loop; `stop()` lets drains finish (bounded)."""

    def __init__(self, args: argparse.Namespace, router_url: str, worker_args: list[str],
                 cpus: dict[str, Any], decode_role: str,
                 role_args: dict[str, list[str]] | None = None, supervisor: Any = None) -> None:
        self.config = planner_config(args)
        self.options = AutoscalerOptions(interval_s=args.autoscale_interval_s, log_path=args.autoscale_log,
                                         decode_role=decode_role)
        self.router_url = router_url
        self.api_key = first_api_key(args.api_key, getattr(args, "api_key_file", None))
        self.actuator = LocalProcessActuator(worker_args, host=args.host, cpus=cpus,
                                             role_args=role_args, supervisor=supervisor)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        observer = RouterObserver(self.router_url, self.api_key)
        scaler = Autoscaler(observer, Planner(self.config), self.actuator, self.options)
        try:
            await scaler.run(self._stop)
        finally:
            await self.actuator.close()
            await observer.close()

    def stop(self, timeout_s: float = 120.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout_s)
