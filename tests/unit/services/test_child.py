"""`services.child`, the launcher `spawn` runs children through: the death signal, CPU pinning,
and no fork handlers in the child (a busy gRPC parent's children never abort before their exec)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.child import child_argv
from services.procs import spawn

PY = sys.executable
LAUNCHER = child_argv([], death_signal=None)[:-1]  # python -I .../services/child.py


def test_the_child_runs_argv_in_its_own_pid_with_the_given_env() -> None:
    proc = spawn([PY, "-c", "import os; print(os.getpid(), os.environ['PDSERVE_INSTANCE_ID'])"],
                 instance="abc", stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert out.decode().split() == [str(proc.pid), "abc"]  # exec: the Popen's pid runs argv
    assert proc.returncode == 0


def test_cpus_pin_the_child_and_what_it_starts() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); "
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])")
    proc = spawn([PY, "-c", code], cpus={cpu}, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert out.decode().split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]


def test_the_child_gets_sigterm_when_its_launcher_is_sigkilled(tmp_path: Path) -> None:
    got = tmp_path / "got"
    child_code = (f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
                  f"(open({str(got)!r}, 'w').write('TERM'), sys.exit(0))); print('ready', flush=True); "
                  f"time.sleep(60)")
    launcher = textwrap.dedent(f"""
        import sys, time
        from services.procs import spawn
        child = spawn([sys.executable, "-c", {child_code!r}])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([PY, "-c", launcher], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline() == b"ready\n"  # the child's handler is set
        parent.kill()
        parent.wait(timeout=10)
        child.wait(timeout=10)  # not this process's child: no exit status, but gone
        assert got.read_text() == "TERM"
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_a_launcher_that_is_gone_already_runs_nothing_and_bad_arguments_fail() -> None:
    # Its parent is this process, not the (ended) process named: as if that one had died
    # before the prctl.
    ended = subprocess.Popen(["true"])
    ended.wait(timeout=30)
    gone = subprocess.run([*LAUNCHER, "--parent", str(ended.pid), "--", "sh", "-c", "echo ran"],
                          capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1 and "ran" not in gone.stdout
    nothing = subprocess.run([*LAUNCHER, "--"], capture_output=True, text=True, timeout=30)
    assert nothing.returncode == 2 and "nothing to run" in nothing.stderr
    bad = subprocess.run([*LAUNCHER, "--parent", str(os.getpid()), "--signal", "NOPE", "--", "true"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown signal 'NOPE'" in bad.stderr
    missing = subprocess.run(child_argv(["/nonexistent/program"]), capture_output=True, text=True,
                             timeout=30)
    assert missing.returncode == 127 and "cannot run /nonexistent/program" in missing.stderr
    with pytest.raises(FileNotFoundError, match="no-such-program"):  # spawn says it at once, as Popen
        spawn(["no-such-program"])
    with pytest.raises(FileNotFoundError):
        spawn(["./true"], cwd="/")


def test_the_child_has_popens_signal_dispositions_and_inherits_passed_fds() -> None:
    """Python's start-up ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: the
    launcher gives them back their defaults (a pipeline's writer dies quietly, as usual)."""
    ignored = "grep SigIgn /proc/self/status"
    plain = subprocess.run(["sh", "-c", ignored], capture_output=True, text=True, timeout=30).stdout
    proc = spawn(["sh", "-c", ignored], stdout=subprocess.PIPE)
    assert proc.communicate(timeout=30)[0].decode() == plain
    proc = spawn(["sh", "-c", "yes | head -1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=30)
    assert (out, err) == (b"y\n", b"")  # no "Broken pipe" from yes
    r, w = os.pipe()
    try:
        proc = spawn([PY, "-c", f"import os; os.write({w}, b'through')"], pass_fds=(w,))
        assert proc.wait(timeout=30) == 0
        assert os.read(r, 100) == b"through"
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def busy_grpc() -> Iterator[None]:
    """gRPC channels calling in two threads: what `pdserve up` (readiness checks) and the tests
    hold while they spawn components."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(timeout=10)
    server.stop(None)


def test_children_of_a_busy_grpc_parent_never_abort_before_their_exec(busy_grpc: None) -> None:
    """With a preexec_fn (a fork), about 2% of such children died of SIGABRT in gRPC's fork
    handler ("epoll_wait error: Bad file descriptor", grpc/grpc#43055): 40 of 2,000 here."""
    codes = []
    for _ in range(100):
        proc = spawn(["true"], stderr=subprocess.PIPE)
        err = proc.communicate(timeout=30)[1]
        codes.append((proc.returncode, err.decode(errors="replace")[-300:]))
    assert [c for c in codes if c[0] != 0] == []
