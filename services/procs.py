"""Local child processes and ports: what `pdserve up`, its supervisor and the local autoscaler
actuator share.

- `spawn(argv)`: a child (`cli("worker", ...)` is `python -m services.cli worker ...`) that gets
  SIGTERM when its parent dies
  (PR_SET_PDEATHSIG: no orphans, even when the parent is SIGKILLed), optionally pinned to CPUs,
  with a fresh instance id in PDSERVE_INSTANCE_ID. Every component reports that id (a worker's
  Load report, the router's /health, the KV store's health action), so a readiness check knows
  it reached the process just started and not another one on the same port.
- `check_ports_free({port: "decode worker 0"})`: a one-line error naming the first port in use.
- `free_port()`: a free loopback port below 32768, outside Linux's ephemeral range.
- `stop_process(proc)`: a signal (SIGINT by default), a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from kvstore.ports import PortInUseError, listen, port_free, port_in_use_message
from services.child import child_argv

INSTANCE_ENV = "PDSERVE_INSTANCE_ID"
PORT_RANGE = (20000, 32767)  # below the ephemeral range (32768..60999 on Linux)


__all__ = ["INSTANCE_ENV", "PortInUseError", "check_ports_free", "cli", "describe_exit", "free_port",
           "free_ports", "instance_id", "listen", "new_instance_id", "port_free", "port_in_use_message",
           "spawn", "stop_process"]


def instance_id() -> str:
    """This process's instance id: the one its launcher gave it, else a new one (kept)."""
    value = os.environ.get(INSTANCE_ENV)
    if not value:
        value = uuid.uuid4().hex
        os.environ[INSTANCE_ENV] = value
    return value


def new_instance_id() -> str:
    return uuid.uuid4().hex


def cli(*args: str) -> list[str]:
    """The command line of `pdserve *args` run by this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]


def spawn(argv: list[str], env: Mapping[str, str] | None = None, cpus: set[int] | None = None,
          instance: str | None = None, **popen: object) -> subprocess.Popen[bytes]:
    """Starts `argv` (see the module docstring) through `services.child`, which sets the death
    signal and the CPUs (its children, the engine core, inherit them) and execs `argv`: no
    preexec_fn, whose fork would run gRPC's fork handlers in the child (services/child.py)."""
    child_env = dict(os.environ if env is None else env)
    child_env[INSTANCE_ENV] = instance or new_instance_id()
    program, cwd = argv[0], popen.get("cwd")
    if os.sep in program and cwd is not None:
        program = os.path.join(str(cwd), program)  # relative to the child's directory
    if shutil.which(program, path=child_env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(errno.ENOENT, "no such program", argv[0])  # as Popen says it
    return subprocess.Popen(child_argv(argv, signal.SIGTERM, cpus), env=child_env,  # type: ignore[call-overload]
                            **popen)


def check_ports_free(host: str, ports: Mapping[int, str]) -> None:
    """Raises PortInUseError naming the first port (and its component) that is taken."""
    for port, component in ports.items():
        if not port_free(host, port):
            raise PortInUseError(port_in_use_message(host, port, component))


def free_port(host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A port nothing listens on, in PORT_RANGE (tests and the local actuator use these)."""
    for _ in range(1000):
        port = random.randint(*PORT_RANGE)
        if (exclude is None or port not in exclude) and port_free(host, port):
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE} on {host}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port(host, exclude=ports))
    return list(ports)


def describe_exit(code: int) -> str:
    """"code 1", or "signal SIGKILL" for a negative Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGINT, timeout_s: float = 60) -> int:
    """Sends `sig` to a running `proc` (after SIGCONT, so a frozen one sees it), waits up to
    `timeout_s`, then kills it. Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return int(proc.returncode)
