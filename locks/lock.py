"""The locked installs: every package `make setup`, the images and the LMCache peer install, pinned
with its hashes, for CPython 3.11 on x86_64 Linux.

    python3 locks/lock.py check            # offline: each lock was made from today's inputs (make lint)
    python3 locks/lock.py lock [--upgrade]  # make lock / make lock-upgrade (needs uv: .venv/bin/uv)
    python3 locks/lock.py torch-links      # where pip finds the torch CPU wheel (for --find-links)

A lock's inputs are pyproject.toml's dependency lists and the locks/*.in files it is made from;
`lock` writes their digest into the lock's header and `check` recomputes it, so a dependency
added, removed or re-ranged in pyproject.toml without `make lock` fails CI. `lock` keeps every
pin the inputs still allow (uv prefers the versions in the lock it rewrites); `--upgrade` takes
the newest versions instead. The locks:

- dev.txt: `make setup` (the dependencies, the dev and k8s extras, locks/dev.in);
- runtime.txt: the CPU image (the dependencies, the k8s extra, locks/runtime.in), each version
  as in dev.txt;
- runtime-cuda.txt: the CUDA image (compose.gpu.yaml): PyPI's CUDA build of torch, the rest as
  in dev.txt;
- lmcache-peer.txt: the LMCache 0.5.6 peer's own venv (lmcache itself without its dependencies).

Stdlib only: the Makefile runs `check` and `torch-links` before the venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_PAGE = "https://download.pytorch.org/whl/cpu/torch/"  # PyTorch's CPU wheels of torch
DIGEST_PREFIX = "# inputs-sha256: "
# What every lock is made for (and with): part of each lock's digest.
UV_OPTIONS = ("--generate-hashes", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
              "--overrides", "locks/overrides.txt", "--custom-compile-command", "make lock")


@dataclass(frozen=True)
class Lock:
    name: str  # locks/<name>.txt
    requirements: tuple[str, ...]  # locks/*.in files
    extras: tuple[str, ...] = ()  # pyproject.toml's extras; () with `project` False: none of it
    project: bool = True  # pyproject.toml's dependencies are inputs
    constrained_by: str | None = None  # a lock whose versions this one keeps (torch apart)
    no_deps: str | None = None  # a locks/*.in locked without its dependencies, appended
    cpu_torch: bool = True  # torch's CPU build: its wheel comes from --find-links
    overrides: tuple[str, ...] = ()  # locks/*.txt overrides beside locks/overrides.txt

    @property
    def path(self) -> Path:
        return ROOT / "locks" / f"{self.name}.txt"


LOCKS = (
    Lock("dev", ("dev.in",), extras=("dev", "k8s")),
    Lock("runtime", ("runtime.in",), extras=("k8s",), constrained_by="dev"),
    Lock("runtime-cuda", ("runtime-cuda.in",), extras=("k8s",), constrained_by="dev", cpu_torch=False,
         overrides=("cuda-overrides.txt",)),
    Lock("lmcache-peer", ("lmcache-peer.in",), project=False, no_deps="lmcache-peer-nodeps.in"),
)
BY_NAME = {lock.name: lock for lock in LOCKS}


# --- digests ---------------------------------------------------------------------------------
def _requirement_lines(path: Path) -> list[str]:
    """The requirements of a requirements file, `-r` includes expanded, comments and spaces gone."""
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            lines += _requirement_lines(path.parent / line[3:].strip())
        else:
            lines.append(re.sub(r"\s+", "", line))
    return lines


def _project_requirements(lock: Lock) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [f"{extra}:{r}" for extra in lock.extras for r in project["optional-dependencies"][extra]]
    if lock.project:
        reqs += list(project["dependencies"])
    return sorted(re.sub(r"\s+", "", r) for r in reqs)


def digest(lock: Lock) -> str:
    """sha256 of what the lock is made from: pyproject.toml's lists it takes, its .in files, the
    overrides, uv's options, and the digest of the lock it is constrained by."""
    h = hashlib.sha256()
    parts = [repr(lock), repr(UV_OPTIONS), *_project_requirements(lock)]
    no_deps = [lock.no_deps] if lock.no_deps else []
    for name in (*lock.requirements, "overrides.txt", *lock.overrides, *no_deps):
        parts += [f"[{name}]", *_requirement_lines(ROOT / "locks" / name)]
    if lock.constrained_by is not None:
        parts.append(digest(BY_NAME[lock.constrained_by]))
    for part in parts:
        h.update(part.encode() + b"\n")
    return h.hexdigest()


def recorded_digest(path: Path) -> str | None:
    for line in path.read_text().splitlines()[:10]:
        if line.startswith(DIGEST_PREFIX):
            return line[len(DIGEST_PREFIX):].strip()
    return None


def check() -> int:
    """0 when every lock exists and was made from the inputs the repository holds now."""
    stale = []
    for lock in LOCKS:
        rel = lock.path.relative_to(ROOT)
        if not lock.path.exists():
            stale.append(f"{rel} is missing")
        elif recorded_digest(lock.path) != digest(lock):
            inputs = ["pyproject.toml"] if lock.project or lock.extras else []
            inputs += [f"locks/{n}" for n in (*lock.requirements, "overrides.txt", *lock.overrides)]
            stale.append(f"{rel} was not made from what {', '.join(inputs)} hold now")
    for line in stale:
        print(f"lock check: {line}", file=sys.stderr)
    if stale:
        print("lock check: run `make lock` and commit the locks", file=sys.stderr)
        return 1
    print(f"lock check: {len(LOCKS)} locks match their inputs")
    return 0


# --- torch's CPU wheel -------------------------------------------------------------------------
def torch_pin() -> str:
    """The CPU torch version locks/runtime.in pins, e.g. 2.13.0+cpu."""
    for line in _requirement_lines(ROOT / "locks" / "runtime.in"):
        if line.startswith("torch=="):
            return line.split("==", 1)[1]
    raise SystemExit("locks/runtime.in pins no torch")


def _pip_find_links() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    for key in ("global.find-links", "install.find-links"):
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True,
                                 text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        links += out.split()
    return [link.removeprefix("file://") for link in links]


def torch_links() -> str:
    """A local folder from pip's find-links that holds the pinned torch CPU wheel for CPython
    3.11, else PyTorch's page of CPU wheels."""
    wheel = f"torch-{torch_pin()}-cp311-cp311-*.whl"
    for link in _pip_find_links():
        folder = Path(link)
        if folder.is_dir() and any(folder.glob(wheel)):
            return str(folder)
    return TORCH_CPU_PAGE


# --- making the locks ------------------------------------------------------------------------
def _uv() -> str:
    for candidate in (ROOT / ".venv" / "bin" / "uv", shutil.which("uv")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("uv not found: `make setup` installs it into .venv (locks/dev.in)")


def _compile(uv: str, inputs: list[str], out: Path, extra: list[str]) -> None:
    cmd = [uv, "pip", "compile", *inputs, *UV_OPTIONS, "--quiet", "-o", str(out), *extra]
    subprocess.run(cmd, cwd=ROOT, check=True)


def _without_torch(lock: Path, into: Path) -> Path:
    """The pins of `lock` other than torch, as a constraints file (no hashes)."""
    pins = [line.split()[0] for line in lock.read_text().splitlines()
            if re.match(r"^[A-Za-z0-9][^ ]*==", line) and not line.startswith("torch==")]
    into.write_text("\n".join(pins) + "\n")
    return into


def _with_digest(path: Path, lock: Lock) -> None:
    lines = path.read_text().splitlines()
    body = [line for line in lines if not line.startswith(DIGEST_PREFIX)]
    header = 0
    while header < len(body) and body[header].startswith("#"):
        header += 1
    note = [f"{DIGEST_PREFIX}{digest(lock)}",
            "# (what it was made from: pyproject.toml's lists and locks/*.in; see locks/lock.py)"]
    body = [line for line in body if not line.startswith("# (what it was made from")]
    header = min(header, len(body))
    path.write_text("\n".join([*body[:header], *note, *body[header:]]) + "\n")


def make(lock: Lock, uv: str, upgrade: bool, torch_source: str, work: Path) -> None:
    inputs = [f"locks/{name}" for name in lock.requirements]
    if lock.project or lock.extras:
        inputs.insert(0, "pyproject.toml")
    extra = [arg for e in lock.extras for arg in ("--extra", e)]
    extra += [arg for name in lock.overrides for arg in ("--overrides", f"locks/{name}")]
    if lock.cpu_torch:
        extra += ["--find-links", torch_source]
    if upgrade:
        extra.append("--upgrade")
    constraints = None
    if lock.constrained_by is not None:
        constraints = _without_torch(BY_NAME[lock.constrained_by].path, work / f"{lock.name}.constraints")
        extra += ["--constraints", str(constraints)]
    out = work / f"{lock.name}.txt"
    if lock.path.exists():  # uv keeps the versions of the file it writes, where it can
        shutil.copy(lock.path, out)
    _compile(uv, inputs, out, extra)
    if lock.no_deps is not None:
        nodeps = work / f"{lock.name}.nodeps.txt"
        if lock.path.exists():
            shutil.copy(lock.path, nodeps)
        _compile(uv, [f"locks/{lock.no_deps}"], nodeps, ["--no-deps", *extra])
        pins = [line for line in nodeps.read_text().splitlines() if not line.startswith("#")]
        out.write_text(out.read_text() + "\n".join(pins) + "\n")
    if constraints is not None:  # the annotations name the lock, not the temporary file
        out.write_text(out.read_text().replace(str(constraints), f"locks/{lock.constrained_by}.txt"))
    _with_digest(out, lock)
    shutil.copy(out, lock.path)
    print(f"locked {lock.path.relative_to(ROOT)}")


def lock_all(upgrade: bool, only: list[str]) -> int:
    uv = _uv()
    source = torch_links()
    with tempfile.TemporaryDirectory() as tmp:
        for lock in LOCKS:  # in order: a lock is made after the one it is constrained by
            if not only or lock.name in only:
                make(lock, uv, upgrade, source, Path(tmp))
    return check()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="offline: every lock matches its inputs")
    make_parser = sub.add_parser("lock", help="make the locks again (uv; network)")
    make_parser.add_argument("--upgrade", action="store_true", help="the newest versions the inputs allow")
    make_parser.add_argument("names", nargs="*", metavar="NAME", help=f"only these: {', '.join(BY_NAME)}")
    sub.add_parser("torch-links", help="where pip finds the torch CPU wheel")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    if args.command == "torch-links":
        print(torch_links())
        return 0
    unknown = set(args.names) - set(BY_NAME)
    if unknown:
        parser.error(f"no lock named {', '.join(sorted(unknown))} (the locks: {', '.join(BY_NAME)})")
    return lock_all(args.upgrade, args.names)


if __name__ == "__main__":
    sys.exit(main())
