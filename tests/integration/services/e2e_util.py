"""Helpers for the end-to-end service tests: `pdserve up` as a child process, the router app under
uvicorn in a thread, and bounded polling of a worker's load report."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

from protos import worker_pb2 as pb
from services.procs import free_ports, stop_process
from services.worker.client import WorkerClient

ROOT = Path(__file__).resolve().parents[3]


class PdserveUp:
    """`pdserve up` in a child process on free ports; `start()` returns at once, `wait_ready()`
    blocks until it prints that it is up; `stop()` sends Ctrl-C and waits (bounded)."""

    def __init__(self, model: str, *extra: str, colocated: bool = False) -> None:
        self.port, store, self.prefill_port, self.decode_port, live = free_ports(5)
        self.model = model
        self.colocated = colocated
        # The liveness port too: its default (--port + 1000) is not known to be free (a CI run
        # lost both load-test cases to another test holding it)
        liveness = [] if "--router-liveness-port" in extra else ["--router-liveness-port", str(live)]
        self.argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--port", str(self.port),
                     "--kvstore-port", str(store), "--prefill-port", str(self.prefill_port),
                     "--decode-port", str(self.decode_port), *liveness,
                     # (events on gRPC port + 2000 could leave the test port range)
                     *([] if "--kv-events-port-offset" in extra else ["--kv-events-port-offset", "0"]),
                     *extra]
        if colocated:
            self.argv.append("--colocated")
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def prefill_target(self) -> str:
        return f"127.0.0.1:{self.prefill_port}"

    @property
    def decode_target(self) -> str:
        return f"127.0.0.1:{self.decode_port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Reads the launcher's stdout (the children print their own start lines too) until it is up."""
        assert self.proc is not None and self.proc.stdout is not None
        result: dict[str, bool] = {}

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for _ in range(100):
                line = self.proc.stdout.readline()
                self.lines.append(line)
                if "pdserve is up" in line or not line:
                    result["up"] = "pdserve is up" in line
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=timeout_s)
        if not result.get("up"):
            raise RuntimeError(f"pdserve up did not come up in {timeout_s} s "
                               f"(exit code {self.proc.poll()}): {self.lines}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        return stop_process(self.proc)


async def wait_for_load(target: str, want_free_blocks: int, timeout_s: float) -> pb.LoadReport:
    """Polls the worker's Load until nothing runs or waits and `want_free_blocks` blocks are free;
    fails with the last report after `timeout_s`."""
    async with WorkerClient(target) as worker:
        deadline = time.monotonic() + timeout_s
        while True:
            load = await worker.load()
            if load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == want_free_blocks:
                return load
            assert time.monotonic() < deadline, (
                f"worker {target} not idle after {timeout_s} s: running={load.num_running} "
                f"waiting={load.num_waiting} free={load.num_free_blocks} (want {want_free_blocks})")
            await asyncio.sleep(0.05)


async def load_of(target: str) -> pb.LoadReport:
    async with WorkerClient(target) as worker:
        return await worker.load()
