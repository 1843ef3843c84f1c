"""`pdserve up` as an operator meets it: a killed worker, store or router is restarted (logged with
its exit), rejoins, and requests succeed again; the rest keeps serving meanwhile. A second
instance on the same ports, or a worker, router or store started on a taken port, exits 1 with a
one-line error naming the port, and the first instance is unharmed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from services.procs import free_ports, stop_process

ROOT = Path(__file__).resolve().parents[4]


class Up:
    def __init__(self, model: Path, tmp: Path, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.router, self.store, self.prefill, self.decode, self.liveness = free_ports(5)
        self.state = tmp / "state.json"
        self.stderr_path = tmp / "up.err"
        self.argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model),
                     "--port", str(self.router), "--kvstore-port", str(self.store),
                     "--prefill-port", str(self.prefill), "--decode-port", str(self.decode),
                     "--num-threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "512",
                     "--metrics-port-offset", "0", "--kv-events-port-offset", "0",
                     "--startup-timeout-s", "180",
                     "--router-liveness-port", str(self.liveness), *extra]
        self.proc = subprocess.Popen([*self.argv, "--state-file", str(self.state)], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=open(self.stderr_path, "wb"),  # noqa: SIM115
                                     text=True, env={**os.environ, **(env or {})})

    def wait_up(self) -> None:
        assert self.proc.stdout is not None
        for _ in range(50):
            line = self.proc.stdout.readline()
            if "pdserve is up" in line or not line:
                break
        assert "pdserve is up" in line, self.stderr()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def component(self, name: str) -> dict[str, object]:
        comps = json.loads(self.state.read_text())["components"]
        return next(c for c in comps if c["name"] == name)

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.router}/v1", api_key="x", timeout=60, max_retries=0)

    def stop(self) -> int:
        return stop_process(self.proc, timeout_s=90)


@pytest.fixture(scope="module")
def up(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    instance = Up(tiny_model_dir("llama"), tmp_path_factory.mktemp("up"))
    try:
        instance.wait_up()
        yield instance
    finally:
        assert instance.stop() == 0


def complete(up: Up) -> str:
    out = up.client().completions.create(model=str(up.argv[5]), prompt="The quick brown fox", max_tokens=8,
                                         temperature=0)
    return str(out.choices[0].text)


def wait_restarted(up: Up, name: str, old_pid: object, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        c = up.component(name)
        if c["pid"] != old_pid and c["state"] == "running":
            return
        assert time.monotonic() < deadline, (c, up.stderr()[-2000:])
        time.sleep(0.2)


def test_killed_components_are_restarted_and_requests_succeed_again(up: Up) -> None:
    """A decode worker, a prefill worker and the store killed together: each is restarted and
    logged, the router takes the workers back, requests succeed again (the router's own restart:
    the test below)."""
    want = complete(up)
    names = ["decode-0", "prefill-0", "kvstore"]
    old = {name: up.component(name) for name in names}
    for comp in old.values():
        os.kill(int(comp["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    for name, comp in old.items():
        wait_restarted(up, name, comp["pid"])
        assert f"{name} (pid {comp['pid']}) exited with signal SIGKILL; restarting it" in up.stderr()
        assert up.component(name)["restarts"] == 1
    deadline = time.monotonic() + 60
    while True:  # the router's pools take the workers back as soon as their health says so
        try:
            assert complete(up) == want
            break
        except Exception:
            assert time.monotonic() < deadline, up.stderr()[-2000:]
            time.sleep(0.5)
    assert up.proc.poll() is None


def test_a_second_up_on_the_same_ports_exits_1_naming_the_port(up: Up) -> None:
    want = complete(up)
    second = subprocess.run(up.argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"port {up.router} (router)" in second.stderr and "already in use" in second.stderr
    assert "pdserve is up" not in second.stdout
    assert complete(up) == want


@pytest.mark.parametrize("what", ["worker", "router", "kvstore"])
def test_a_component_on_a_taken_port_exits_1_naming_it(up: Up, what: str) -> None:
    model = str(up.argv[5])
    argv = {"worker": ["worker", "--role", "decode", "--port", str(up.decode), "--model", model],
            "router": ["router", "--decode", f"127.0.0.1:{up.decode}", "--port", str(up.router),
                       "--model", model],
            "kvstore": ["kvstore", "--port", str(up.store)]}[what]
    port = argv[argv.index("--port") + 1]
    done = subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "already in use" in line]
    assert len(lines) == 1 and f"port {port} (" in lines[0], done.stderr[-2000:]
    assert complete(up)


def test_requests_sent_while_the_router_restarts_wait_for_it_instead_of_failing(up: Up) -> None:
    """`up` holds the router's listening socket across its restarts: connections made while no
    router runs wait in the backlog and are served by the next one (no connection refused)."""
    import concurrent.futures

    want = complete(up)
    old = up.component("router")
    os.kill(int(old["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda _: complete(up), range(3)))  # max_retries=0: no retry hides it
    assert texts == [want] * 3
    assert up.component("router")["pid"] != old["pid"]
    assert "router (pid" in up.stderr() and "exited with signal SIGKILL; restarting it" in up.stderr()


@pytest.mark.slow  # ~50 s (8 s of load delay, a 6 s watch, a full up/stop): keeps make test < 15 min
def test_a_slow_model_load_does_not_get_the_store_killed(tiny_model_dir: Callable[[str], Path],
                                                         tmp_path: Path) -> None:
    """Workers whose engines start 8 s late (the load-delay test hook) with --unresponsive-s 4:
    the store, ready long before them, keeps running once the watch begins (its liveness clock
    starts then, not when the store became ready), and the system serves."""
    from services.worker.server import LOAD_DELAY_ENV

    up = Up(tiny_model_dir("llama"), tmp_path, extra=("--unresponsive-s", "4"), env={LOAD_DELAY_ENV: "8"})
    try:
        up.wait_up()
        store = up.component("kvstore")
        time.sleep(6)  # past --unresponsive-s since the watch began
        now = up.component("kvstore")
        assert now["pid"] == store["pid"] and now["restarts"] == 0, up.stderr()[-2000:]
        assert "liveness check" not in up.stderr()
        assert complete(up)
    finally:
        assert up.stop() == 0
