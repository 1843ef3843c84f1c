"""Where pdserve keeps what it fetches and converts, and how it writes there without clashes.

The cache is `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`: `models/<name>/` holds converted
models, `packages/<name>/` the packages a catalog model was fetched as. `build_once` fills a
folder through a temporary sibling renamed into place, so a crash never leaves a half-written
folder and concurrent builders do not clash (the first rename wins; the others find it done).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def build_once(target: Path, build: Callable[[Path], None], is_done: Callable[[Path], bool]) -> Path:
    """`target`, made by `build(empty temporary folder)` unless `is_done(target)` already."""
    if is_done(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        if target.exists() and not is_done(target):
            shutil.rmtree(target)  # a stale or partial folder from an older layout
        try:
            tmp.rename(target)
        except OSError:
            if not is_done(target):  # another process did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
