"""A `pdserve kvstore` process on a free loopback port, for benchmarks (started and stopped):
open (no tokens) or secured (`--auth-file` with one producer,consumer token, written by this
helper into a private temporary directory and removed on stop)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent
# Server settings a benchmark's environment must not pass on: each store is open or secured
# as its caller asked, whatever the shell that started the benchmark exports.
_SERVER_ENV = ("PDSERVE_KV_AUTH_FILE",)


class StoreProcess:
    """`secured`: the server checks tokens; `token` is the one client credential it accepts
    (roles producer and consumer, what a connector needs). Open: `token` is None."""

    def __init__(self, capacity: str = "4GiB", secured: bool = False, extra: Sequence[str] = (),
                 port: int | None = None) -> None:
        """`extra`: more `pdserve kvstore` flags (e.g. `--backend redis-cluster --redis-url ..`)."""
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        self.port = port
        self.token: str | None = None
        self._dir: str | None = None
        argv = [sys.executable, "-m", "services.cli", "kvstore", "--capacity", capacity, "--port",
                str(self.port), "--log-level", "WARNING", *extra]
        if secured:
            self.token = secrets.token_urlsafe(32)
            self._dir = tempfile.mkdtemp(prefix="pdserve-bench-auth-")  # mode 0700
            path = os.path.join(self._dir, "tokens")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.token} producer,consumer\n")
            argv += ["--auth-file", path]
        env = {k: v for k, v in os.environ.items() if k not in _SERVER_ENV}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("kvstore did not start in 30 s")
            time.sleep(0.05)

    @property
    def secured(self) -> bool:
        return self.token is not None

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
