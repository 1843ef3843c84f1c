"""Components as real processes for fault tests: `pdserve worker` and `pdserve kvstore` children
on free ports below 32768, waited for until they serve, and killed, frozen or thawed by signal."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from services.procs import cli, free_port, spawn, stop_process
from services.readiness import router_ready, store_ready, worker_ready

ROOT = Path(__file__).resolve().parents[3]
TINY_ENGINE = ["--num-threads", "1", "--max-model-len", "512", "--num-kv-blocks", "96"]


class Proc:
    """One component process; `ready()` is its readiness check for this instance."""

    def __init__(self, argv: list[str], ready: object, target: str, log: Path | None = None) -> None:
        self.argv, self._ready, self.target, self.log = argv, ready, target, log
        self._spawn()

    def _spawn(self) -> None:
        self.instance = os.urandom(8).hex()
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.proc = spawn(self.argv, instance=self.instance, cwd=ROOT, stdout=out, stderr=out,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def wait_ready(self, timeout_s: float = 120) -> Proc:
        deadline = time.monotonic() + timeout_s
        while not self._ready(self.instance):  # type: ignore[operator]
            assert self.proc.poll() is None, f"{self.argv[3:5]} exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"{self.target} not ready after {timeout_s} s"
            time.sleep(0.1)
        return self

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def freeze(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, returning once every thread of the process is stopped: the signal stops a
        busy thread on another core a moment later, and a call sent in that moment is served."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all_threads_stopped(self.pid):
            assert time.monotonic() < deadline, f"pid {self.pid} did not stop"
            time.sleep(0.005)

    def core_pid(self) -> int:
        """A worker's engine-core child process (multiprocessing's spawned child)."""
        return core_of(self.pid)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout_s=20)


def worker_proc(role: str, model_dir: Path, store_url: str, *extra: str, port: int | None = None,
                log: Path | None = None) -> Proc:
    port = port or free_port()
    target = f"127.0.0.1:{port}"
    argv = cli("worker", "--role", role, "--port", str(port), "--kv-store-url", store_url,
               "--model", str(model_dir), *TINY_ENGINE, *extra)
    return Proc(argv, worker_ready(target), target, log)


def router_proc(model_dir: Path, decode: list[str], *extra: str, port: int | None = None,
                prefill: tuple[str, ...] = (), log: Path | None = None) -> Proc:
    """`pdserve router` (served model name "tiny") over the given workers."""
    port = port or free_port()
    argv = cli("router", "--model", "tiny", "--tokenizer", str(model_dir), "--port", str(port),
               *[a for t in decode for a in ("--decode", t)], *[a for t in prefill for a in ("--prefill", t)],
               "--log-level", "WARNING", *extra)
    return Proc(argv, router_ready(f"http://127.0.0.1:{port}"), f"127.0.0.1:{port}", log)


def store_proc(port: int | None = None, *extra: str) -> Proc:
    port = port or free_port()
    argv = cli("kvstore", "--port", str(port), "--capacity", "256MiB", "--log-level", "WARNING", *extra)
    return Proc(argv, store_ready(f"grpc://127.0.0.1:{port}"), f"127.0.0.1:{port}")


def core_of(worker_pid: int) -> int:
    """The engine-core process of the worker process `worker_pid`."""
    cores = []
    for child in psutil.Process(worker_pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                cores.append(child)
        except psutil.NoSuchProcess:
            continue
    assert len(cores) == 1, cores
    return int(cores[0].pid)


def all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` in state T (stopped), from /proc/<pid>/task/*/stat."""
    tasks = Path(f"/proc/{pid}/task")
    for stat in tasks.glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that just ended
        if state not in ("T", "t"):
            return False
    return True
