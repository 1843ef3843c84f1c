"""`python -I services/child.py [--parent PID] [--signal NAME] [--cpus 0,1] -- ARGV...`: sets up
this process the way its launcher wants it, then execs ARGV (the same pid; nothing of this module
stays). It imports the standard library only and runs isolated (-I: no script or working
directory on its path, PYTHON* variables ignored by it, not by ARGV).

- `--parent PID --signal TERM`: PR_SET_PDEATHSIG, so ARGV gets that signal when its launcher dies
  (even by SIGKILL: no orphans). If the launcher is already gone (it died between the spawn and
  here), ARGV is not run at all: exit 1.
- `--cpus 0,1`: pinned to those CPUs before ARGV starts any thread (its children inherit it).

Why a launcher and not `subprocess.Popen(preexec_fn=...)`: a preexec_fn makes Python fork the
whole process, which runs every library's fork handlers in the child before the exec. gRPC's
(grpcio >= 1.81, grpc/grpc#43055) restarts a poller thread in that child, and Popen's close_fds
then closes the poller's epoll fd under it: "epoll_wait ... Bad file descriptor", SIGABRT, and
the child dies before it runs anything (seen as rare start-up aborts of workers and KV stores
spawned by a process that holds gRPC channels: `pdserve up`, the tests). Without a preexec_fn,
Python starts the child with vfork, which runs no fork handlers. Python's start-up ignores
SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec: both go back to their
default before ARGV runs, as Popen's restore_signals gives any child.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Sequence

PR_SET_PDEATHSIG = 1


def child_argv(argv: Sequence[str], death_signal: signal.Signals | None = signal.SIGTERM,
               cpus: Iterable[int] | None = None) -> list[str]:
    """The command line that runs `argv` through this launcher, set up for the calling process
    as its parent (`death_signal` when it dies; None: none) and pinned to `cpus`."""
    out = [sys.executable, "-I", os.path.abspath(__file__)]
    if death_signal is not None:
        out += ["--parent", str(os.getpid()), "--signal", death_signal.name]
    if cpus:
        out += ["--cpus", ",".join(str(c) for c in sorted(cpus))]
    return [*out, "--", *argv]


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="services/child.py", description=__doc__)
    parser.add_argument("--parent", type=int, help="the launcher's pid")
    parser.add_argument("--signal", default="SIGTERM", help="sent when the launcher dies")
    parser.add_argument("--cpus", help="comma-separated CPU ids to pin to")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        parser.error("nothing to run: give the command after --")
    if ns.parent is not None:
        name = ns.signal if ns.signal.startswith("SIG") else f"SIG{ns.signal}"
        try:
            sig = signal.Signals[name]
        except KeyError:
            parser.error(f"--signal: unknown signal {ns.signal!r}")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            print(f"services/child.py: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}",
                  file=sys.stderr)
            return 1
        if os.getppid() != ns.parent:  # the launcher died before the prctl: nobody to serve
            return 1
    if ns.cpus:
        os.sched_setaffinity(0, {int(c) for c in ns.cpus.split(",") if c.strip()})
    for restored in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(restored, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"services/child.py: cannot run {argv[0]}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
