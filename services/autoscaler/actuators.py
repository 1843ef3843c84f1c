"""Actuators: what starts and stops workers for the autoscaler. One small interface, so that local
processes, Docker or Kubernetes can each implement it:

    target = await actuator.start("prefill")   # returns once the worker serves (gRPC health)
    await actuator.stop("prefill", target)     # after the router drained it

`LocalProcessActuator` runs `pdserve worker` processes on this machine on free ports.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from services.procs import cli, free_port
from services.readiness import worker_alive, worker_ready
from services.secrets import component_env
from services.supervisor import ChildSpec, Supervisor
from services.worker.client import WorkerClient


class Actuator(Protocol):
    async def start(self, role: str) -> str:
        """Starts one worker of `role` and returns its host:port once it serves."""
        ...

    async def stop(self, role: str, target: str) -> None:
        """Stops a worker this actuator started (the router has drained it)."""
        ...

    def managed(self, role: str) -> list[str]:
        """The workers of `role` this actuator started and has not stopped."""
        ...


async def wait_serving(target: str, alive: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with WorkerClient(target) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"worker {target} exited while starting")
            try:
                if await asyncio.wait_for(client.health(), 2.0):
                    return
            except Exception:  # not listening yet
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"worker {target} not serving after {timeout_s} s")


class LocalProcessActuator:
    """`pdserve worker --role R` child processes on free ports: `worker_args` are the engine and
    KV-store flags every worker gets (model, threads, --kv-store-url ...), `role_args` those of
    one role (e.g. the prefill workers' scheduling flags); `cpus` pins them per role. They run
    under `supervisor` (services/supervisor.py; `pdserve up` passes its own, so a worker the
    autoscaler added is restarted like the others when it crashes)."""

    def __init__(self, worker_args: Sequence[str], host: str = "127.0.0.1",
                 cpus: dict[str, set[int] | None] | None = None, startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0,
                 role_args: Mapping[str, Sequence[str]] | None = None,
                 supervisor: Supervisor | None = None) -> None:
        self.worker_args = list(worker_args)
        self.role_args = {role: list(a) for role, a in (role_args or {}).items()}
        self.host = host
        self.cpus = cpus or {}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.supervisor = supervisor or Supervisor()
        self.started: dict[str, tuple[str, str]] = {}  # target -> (role, child name)

    def argv(self, role: str, port: int) -> list[str]:
        """The `services.cli` arguments of a worker of `role` on `port`."""
        return ["worker", "--role", role, "--host", self.host, "--port", str(port), *self.worker_args,
                *self.role_args.get(role, [])]

    async def start(self, role: str) -> str:
        port = free_port(self.host)
        target = f"{self.host}:{port}"
        cpus = self.cpus.get(role)
        name = f"{role}-auto-{port}"
        self.supervisor.start(ChildSpec(name, role, cli(*self.argv(role, port)), worker_ready(target),
                                        target=target, cpus=frozenset(cpus) if cpus else None,
                                        alive=worker_alive(target), env=component_env(role, os.environ)))
        self.started[target] = (role, name)
        try:
            await asyncio.to_thread(self.supervisor.wait_ready, name,
                                    time.monotonic() + self.startup_timeout_s)
        except BaseException:
            await self.stop(role, target)
            raise
        return target

    async def stop(self, role: str, target: str) -> None:
        entry = self.started.pop(target, None)
        if entry is not None:  # SIGTERM: the worker drains what it still has, then exits
            await asyncio.to_thread(self.supervisor.stop, entry[1], self.stop_timeout_s)

    def managed(self, role: str) -> list[str]:
        """Started and not stopped: running, or about to be restarted by the supervisor."""
        states = {c.spec.name: c.state for c in self.supervisor.children(role)}
        return [t for t, (r, name) in self.started.items()
                if r == role and states.get(name) in ("starting", "running", "backoff")]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(r, t) for t, (r, _) in list(self.started.items())))
