"""The front-ends a KV store client spreads its calls over (used by kvstore/client.py).

A client location is one store, `grpc://a:50071`, or several stateless front-ends over one
Redis Cluster: a comma-separated list (`grpc://a:50071,grpc://b:50071`) and / or `dns:name:port`
(every address the name resolves to, resolved again every `resolve_s`, as the router's `dns:`
worker targets: a Kubernetes headless Service). Each front-end has its own channels and breaker
(kvstore/link.py). A call goes to the front-end picked by the hash of its first key (any front-end
serves any key; hashing spreads the load and keeps one key's calls on one connection), else in
turn; when that front-end is unreachable or timed out, the call moves on to the next one, and
the failed one is skipped until its breaker closes.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.link import KVStoreUnavailableError

logger = logging.getLogger(__name__)
T = TypeVar("T")
F = TypeVar("F")
DNS_PREFIX = "dns:"
# With several front-ends, one that failed is skipped at least this long (the caller's own
# breaker_s when longer), so a dead one costs one failed attempt, not one per call.
MIN_FAILOVER_BREAKER_S = 1.0
Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class Target:
    """One front-end: its location and, for a `dns:` address, the name (TLS checks it)."""

    location: str
    server_name: str | None = None


def is_multi(spec: str) -> bool:
    """Whether `spec` names more than one front-end, or may (a `dns:` name)."""
    return "," in spec or spec.strip().startswith(DNS_PREFIX)


def getaddrinfo(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Frontends(Generic[F]):
    """The front-ends of `spec`, each built once by `make(target)` and closed by `close_one` when
    its address goes away. `with_scheme` adds the scheme to a bare host:port."""

    def __init__(self, spec: str, make: Callable[[Target], F], close_one: Callable[[F], None],
                 with_scheme: Callable[[str], str], resolve_s: float = 5.0,
                 resolver: Resolver = getaddrinfo) -> None:
        items = [item.strip() for item in spec.split(",") if item.strip()]
        if not items:
            raise ValueError(f"KV store location {spec!r} names no store")
        self._static = [Target(with_scheme(i)) for i in items if not i.startswith(DNS_PREFIX)]
        self._names = [_split_name(i.removeprefix(DNS_PREFIX)) for i in items
                       if i.startswith(DNS_PREFIX)]
        self._with_scheme = with_scheme
        self._make = make
        self._close_one = close_one
        self._resolve_s = resolve_s
        self._resolver = resolver
        self._lock = threading.Lock()
        self._built: dict[Target, F] = {}
        self._current: list[Target] = list(self._static)
        self._resolved_at = -float("inf")
        self._turn = itertools.count()

    def all(self) -> list[F]:
        """Every current front-end, in a stable order (resolving `dns:` names when due)."""
        with self._lock:
            if self._names and time.monotonic() - self._resolved_at >= self._resolve_s:
                self._resolve()
            if not self._current:
                raise KVStoreUnavailableError(
                    f"no KV store front-end: {', '.join(f'dns:{h}:{p}' for h, p in self._names)} "
                    "resolved to no address")
            return [self._get(t) for t in self._current]

    def order(self, hint: str | None, is_down: Callable[[F], bool]) -> list[F]:
        """The front-ends in the order a call tries them: from the one `hint` hashes to (or the
        next in turn), those whose breaker is open last."""
        fronts = self.all()
        start = zlib.crc32(hint.encode()) if hint is not None else next(self._turn)
        start %= len(fronts)
        rotated = fronts[start:] + fronts[:start]
        return [f for f in rotated if not is_down(f)] + [f for f in rotated if is_down(f)]

    def run(self, hint: str | None, is_down: Callable[[F], bool], fn: Callable[[F], T]) -> T:
        """`fn` on the first front-end that is reachable; KVStoreUnavailableError (the last
        one's) when none is."""
        last: KVStoreUnavailableError | None = None
        for front in self.order(hint, is_down):
            try:
                return fn(front)
            except KVStoreUnavailableError as exc:
                last = exc
        assert last is not None
        raise last

    def close(self) -> None:
        with self._lock:
            built, self._built = list(self._built.values()), {}
        for front in built:
            self._close_one(front)

    def _get(self, target: Target) -> F:
        if target not in self._built:
            self._built[target] = self._make(target)
        return self._built[target]

    def _resolve(self) -> None:
        """Every address the names resolve to (a name that fails keeps its last addresses)."""
        self._resolved_at = time.monotonic()
        found: list[Target] = []
        for host, port in self._names:
            try:
                addresses = self._resolver(host, port)
            except OSError as exc:
                logger.warning("KV store: resolving %s failed: %s", host, exc)
                found += [t for t in self._current if t.server_name == host]
                continue
            found += [Target(self._with_scheme(_join(ip, port)), host) for ip in addresses]
        gone = set(self._built) - set(self._static) - set(found)
        for target in gone:
            logger.info("KV store front-end %s is gone from DNS", target.location)
            self._close_one(self._built.pop(target))
        self._current = list(dict.fromkeys(self._static + found))


def _split_name(name: str) -> tuple[str, int]:
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"KV store location dns:{name}: expected dns:<name>:<port>")
    return host, int(port)


def _join(ip: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(ip).version == 6
    except ValueError:
        is_v6 = False
    return f"[{ip}]:{port}" if is_v6 else f"{ip}:{port}"
