"""A `pdserve kvstore` process on a free loopback port, for benchmarks (started and stopped)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent


class StoreProcess:
    def __init__(self, capacity: str = "4GiB") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "kvstore", "--capacity", capacity, "--port",
             str(self.port), "--log-level", "WARNING"], cwd=ROOT, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("kvstore did not start in 30 s")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
