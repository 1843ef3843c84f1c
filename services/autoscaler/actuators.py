"""Actuators: what starts and stops workers for the autoscaler. One small interface, so that local
processes, Docker or Kubernetes can each implement it:

    target = await actuator.start("prefill")   # returns once the worker serves (gRPC health)
    await actuator.stop("prefill", target)     # after the router drained it

`LocalProcessActuator` runs `pdserve worker` processes on this machine on free ports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    """`pdserve worker --role R` child processes: `worker_args` are the engine and KV-store flags
    every worker gets (model, threads, --kv-store-url ...), `role_args` those of one role
    (e.g. the prefill workers' scheduling flags); `cpus` pins them per role."""

    def __init__(self, worker_args: Sequence[str], host: str = "127.0.0.1",
                 cpus: dict[str, set[int] | None] | None = None, startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0,
                 role_args: Mapping[str, Sequence[str]] | None = None) -> None:
        self.worker_args = list(worker_args)
        self.role_args = {role: list(a) for role, a in (role_args or {}).items()}
        self.host = host
        self.cpus = cpus or {}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}  # target -> (role, process)

    def command(self, role: str, port: int) -> list[str]:
        return [sys.executable, "-m", "services.cli", "worker", "--role", role, "--host", self.host,
                "--port", str(port), *self.worker_args, *self.role_args.get(role, [])]

    async def start(self, role: str) -> str:
        port = free_port(self.host)
        target = f"{self.host}:{port}"
        cpus = self.cpus.get(role)

        def setup() -> None:
            try:
                import ctypes

                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # die with us
            except OSError:
                pass
            if cpus:
                os.sched_setaffinity(0, cpus)

        proc = subprocess.Popen(self.command(role, port), preexec_fn=setup)
        self.procs[target] = (role, proc)
        try:
            await wait_serving(target, lambda: proc.poll() is None, self.startup_timeout_s)
        except BaseException:
            await self.stop(role, target)
            raise
        return target

    async def stop(self, role: str, target: str) -> None:
        entry = self.procs.pop(target, None)
        if entry is None:
            return
        proc = entry[1]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the worker drains what it still has, then exits
            try:
                await asyncio.to_thread(proc.wait, self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)

    def managed(self, role: str) -> list[str]:
        return [t for t, (r, p) in self.procs.items() if r == role and p.poll() is None]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(r, t) for t, (r, _) in list(self.procs.items())))
