"""Builds a CPU kernel's C source once with the system C compiler and opens it with ctypes.

The shared object is cached under `$PDSERVE_CACHE_DIR/kernels` (default ~/.cache/pdserve),
named by a hash of the sources, flags, machine and host (it is built with -march=native), and
written atomically so concurrent builders never see half a file. `PDSERVE_DISABLE_CPU_KERNELS=1`
turns every C kernel off (the PyTorch paths serve instead).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Compiled with -ffast-math (vectorized expf) but linked without it, so the shared object does
# not carry crtfastmath's flush-to-zero start-up code into the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp"]


def disabled() -> bool:
    return os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1"


def build_and_open(source: Path, headers: tuple[Path, ...] = (),
                   compile_flags: list[str] | None = None) -> ctypes.CDLL:
    """The compiled `source` (which may include `headers`), built on first use. Raises OSError
    or subprocess.SubprocessError when it cannot be built."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise OSError("no C compiler found")
    cflags = compile_flags or COMPILE_FLAGS
    text = source.read_bytes() + b"".join(h.read_bytes() for h in headers)
    flags = " ".join(cflags + LINK_FLAGS)
    key = hashlib.sha256(text + flags.encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "kernels"
    target = cache / f"{source.stem}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built, obj = Path(tmp) / target.name, Path(tmp) / f"{source.stem}.o"
            subprocess.run([cc, *cflags, "-c", "-o", str(obj), str(source)], check=True,
                           capture_output=True, timeout=120)
            subprocess.run([cc, *LINK_FLAGS, "-o", str(built), str(obj), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return ctypes.CDLL(str(target))


def ptr(t: Any) -> ctypes.c_void_p:
    """A tensor's data pointer for a ctypes call."""
    return ctypes.c_void_p(t.data_ptr())


class LazyLibrary:
    """A kernel library built and opened on first use, once per process: `get()` returns it,
    or None where it cannot be built (logged once; callers take their PyTorch path) or C
    kernels are disabled. `declare(lib)` sets the functions' ctypes signatures."""

    def __init__(self, source: Path, headers: tuple[Path, ...], what: str,
                 declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.headers, self.what, self.declare = source, headers, what, declare
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        self._tried = True
        if disabled():
            return None
        try:
            lib = build_and_open(self.source, self.headers)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("%s unavailable, using the PyTorch path: %s", self.what, exc)
            return None
        self.declare(lib)
        self._lib = lib
        return lib
