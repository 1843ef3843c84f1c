"""A throwaway Redis Cluster on loopback for tests and benchmarks: N masters (no replicas, no
persistence), made with `redis-cli --cluster create`, each node a child process that `stop()`
(or `kill(i)`, SIGKILL, for fault tests) ends.

Nodes run with `cluster-require-full-coverage no`: when one master is lost, the others keep
serving their slots (what a pdserve store over a cluster should be run with; see
docs/kvstore-cluster.md). Each node also listens on its bus port, port + 10000.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from kvstore.ports import port_free

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def missing_tools() -> str | None:
    """Why a cluster cannot be made here (None when it can)."""
    for tool in (REDIS_SERVER, REDIS_CLI):
        if not Path(tool).exists():
            return f"{Path(tool).name} is not installed (apt-get install redis-server redis-tools)"
    return None


def free_cluster_ports(n: int, low: int, high: int) -> list[int]:
    """`n` ports in [low, high) that are free, and whose bus ports (+10000) are free too."""
    candidates = list(range(low, high))
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        if port_free("127.0.0.1", port) and port_free("127.0.0.1", port + 10000):
            found.append(port)
            if len(found) == n:
                return found
    raise RuntimeError(f"no {n} free ports (with free bus ports) in [{low}, {high})")


def free_port_in(low: int, high: int, taken: set[int] | None = None) -> int:
    """A free loopback port in [low, high), not in `taken` (which it is added to)."""
    taken = taken if taken is not None else set()
    candidates = [p for p in range(low, high) if p not in taken]
    random.shuffle(candidates)
    for port in candidates:
        if port_free("127.0.0.1", port):
            taken.add(port)
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


class RedisCluster:
    """`masters` redis-server processes on `ports` (default: free ones in [low, high)) under
    `workdir`, joined into one cluster covering all 16384 slots; `start()` returns once every
    node reports cluster_state:ok."""

    def __init__(self, workdir: Path, masters: int = 3, ports: list[int] | None = None,
                 low: int = 21000, high: int = 21999, node_timeout_ms: int = 1000) -> None:
        self.workdir = workdir
        self.ports = ports or free_cluster_ports(masters, low, high)
        self.node_timeout_ms = node_timeout_ms
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """redis://h:p,h:p,... (the startup nodes)."""
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        try:
            for port in self.ports:
                self.procs.append(self._start_node(port))
            self._wait(lambda p: self._cli(p, "ping") == "PONG", timeout_s, "nodes answering")
            create = [REDIS_CLI, "--cluster", "create",
                      *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0",
                      "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-1500:]}"
                                   f"{done.stderr[-1500:]}")
            self._wait(lambda p: "cluster_state:ok" in self._cli(p, "cluster", "info"),
                       timeout_s, "cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILLs master `index` (a crash: no shutdown, no goodbye to the cluster)."""
        proc = self.procs[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start_node(self, port: int) -> subprocess.Popen[bytes]:
        cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
               "--loglevel", "warning", "--cluster-enabled", "yes",
               "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
               "--cluster-node-timeout", str(self.node_timeout_ms),
               "--cluster-require-full-coverage", "no"]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _cli(self, port: int, *args: str) -> str:
        done = subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True,
                              text=True, timeout=5, check=False)
        return done.stdout.strip()

    def _wait(self, ok: Callable[[int], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a redis-server of the cluster exited while waiting for {what}")
            if all(ok(port) for port in self.ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: no {what} within {timeout_s} s")
            time.sleep(0.05)
