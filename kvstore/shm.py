"""Same-host data path of the KV store: payloads as files in a shared-memory directory.

Over Arrow Flight a payload is copied several times between two processes of one machine
(the sender's buffers, the socket, the server's buffers, the socket again, the reader's
buffers) and each side spends CPU on framing. Here a client writes the payload once into a file
of the server's directory on tmpfs (memory, not disk) and sends only the file's name; the
server adopts the file as the object's payload without reading it; a reader reads it straight
into its own buffer. Flight stays the path to other machines and for objects put over Flight
(and every object of the Redis backend, which copies payloads into Redis).

Visibility: the server writes a random token into `<dir>/.token`; a client takes this path only
when it reads the same token there (same machine, or a volume both mount), so a container that
does not share the directory falls back to Flight by itself.
Ownership: a client's `put-*` file becomes the server's `obj-*` file by a rename when adopted; it
is deleted once the store drops the object (eviction, delete, replacement, expiry) and the last
Flight read of it is done; a `put-*` file nobody handed over is deleted after `ORPHAN_AGE_S`;
the directory goes when the server stops, and a directory left by a killed server on this host
goes when the next one starts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import time
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

from kvstore.backend import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
PREFIX = "pdserve-kv-"
TOKEN_FILE = ".token"
OWNER_FILE = ".owner"
ORPHAN_AGE_S = 60.0
_PUT_NAME = re.compile(r"put-[A-Za-z0-9_-]{1,64}")


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class ShmFile:
    """A payload held in a file of the server's directory; the file is deleted when this
    object is garbage collected (the store dropped it and no read holds it)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self.name = os.path.basename(path)
        weakref.finalize(self, _unlink, path)

    def __len__(self) -> int:
        return self.size

    def contiguous(self) -> pa.Buffer:
        """The payload as a read-only buffer over the file's pages (no copy)."""
        if self.size == 0:
            return pa.py_buffer(b"")
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.size, prot=mmap.PROT_READ)
        return pa.py_buffer(mm)


def resolve_root(shm_dir: str | None) -> str | None:
    """'auto' -> /dev/shm where it is a writable directory (else None); 'off' / None / '' ->
    None; anything else is a directory the caller wants (created if missing)."""
    if shm_dir in (None, "", "off"):
        return None
    if shm_dir == "auto":
        ok = os.path.isdir(DEFAULT_ROOT) and os.access(DEFAULT_ROOT, os.W_OK | os.X_OK)
        return DEFAULT_ROOT if ok else None
    assert shm_dir is not None
    os.makedirs(shm_dir, exist_ok=True)
    return shm_dir


class ShmArea:
    """The server's directory: created under `root`, removed by `close()`."""

    def __init__(self, root: str) -> None:
        _remove_dead_areas(root)
        # mkdtemp makes the directory 0700: only this user's processes may write payloads into
        # it, read them or the token; its files are 0600.
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        os.chmod(self.dir, 0o700)
        self.token = secrets.token_hex(16)
        _write_private(os.path.join(self.dir, OWNER_FILE), f"{socket.gethostname()} {os.getpid()}")
        _write_private(os.path.join(self.dir, TOKEN_FILE), self.token)  # last: clients check it
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()

    def adopt(self, name: str, size: int) -> ShmFile:
        """Takes over the client's file `name` of `size` bytes as an object's payload."""
        if not _PUT_NAME.fullmatch(name):
            raise InvalidRequestError(f"shm_put: file {name[:100]!r} is not a put-* name of this "
                                      f"store's directory")
        src = os.path.join(self.dir, name)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            raise InvalidRequestError(f"shm_put: no file {name!r} in {self.dir}") from None
        if not stat.S_ISREG(st.st_mode):
            _unlink(src)
            raise InvalidRequestError(f"shm_put: {name!r} is not a regular file")
        if st.st_size != size:
            _unlink(src)
            raise InvalidRequestError(f"shm_put: file {name!r} holds {st.st_size} bytes, the "
                                      f"request says size {size}")
        with self._lock:
            dst = os.path.join(self.dir, f"obj-{next(self._ids)}")
        os.rename(src, dst)
        with contextlib.suppress(OSError):  # whatever mode the client gave it: private now
            os.chmod(dst, 0o600)
        return ShmFile(dst, size)

    def discard(self, name: str) -> None:
        """Deletes a client's file that was not adopted."""
        if _PUT_NAME.fullmatch(name):
            _unlink(os.path.join(self.dir, name))

    def sweep(self, max_age_s: float = ORPHAN_AGE_S, every_s: float = 30.0) -> int:
        """Deletes put-* files older than `max_age_s` (their writer died before handing them
        over); runs at most once every `every_s`. Returns how many went."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_sweep < every_s:
                return 0
            self._last_sweep = now
        cutoff, removed = time.time() - max_age_s, 0
        with contextlib.suppress(OSError), os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.startswith("put-") and entry.stat().st_mtime < cutoff:
                    _unlink(entry.path)
                    removed += 1
        return removed

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _remove_dead_areas(root: str) -> None:
    """Deletes directories left under `root` by store processes of this host that died
    without cleaning up (SIGKILL, OOM): their memory would otherwise stay taken."""
    host = socket.gethostname()
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                with open(os.path.join(entry.path, OWNER_FILE)) as f:
                    owner_host, pid = f.read().split()
            except (OSError, ValueError):
                continue
            if owner_host == host and not _alive(int(pid)):
                logger.info("removing %s, left by a dead kvstore (pid %s)", entry.path, pid)
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- client side ------------------------------------------------------------------------------

def usable_dir(directory: str, token: str) -> str | None:
    """`directory` if this process sees the server's token in it, else None."""
    if not directory or not token:
        return None
    try:
        with open(os.path.join(directory, TOKEN_FILE)) as f:
            return directory if f.read() == token else None
    except OSError:
        return None


def write_file(directory: str, data: Any) -> str:
    """Writes `data` (anything with the buffer protocol) into a new put-* file; its name."""
    name = f"put-{os.getpid()}-{secrets.token_hex(8)}"
    view = memoryview(data).cast("B")
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while view.nbytes:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _unlink(os.path.join(directory, name))
        raise
    os.close(fd)
    return name


def read_file(directory: str, name: str, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """The file's `size` bytes, read into `out` (a uint8 array of that size) or a new array.
    FileNotFoundError when the store dropped the object since it named the file."""
    if "/" in name or name.startswith("."):
        raise OSError(f"bad shared-memory file name {name!r}")
    arr = np.empty(size, dtype=np.uint8) if out is None else out
    view = arr.data.cast("B")
    with open(os.path.join(directory, name), "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"shared-memory file {name!r} holds {got} bytes, expected {size}")
            got += n
    return arr


def discard_file(directory: str, name: str) -> None:
    """Deletes a put-* file this client wrote (when its put failed)."""
    if _PUT_NAME.fullmatch(name):
        _unlink(os.path.join(directory, name))
