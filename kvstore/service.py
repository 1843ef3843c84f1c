"""`pdserve kvstore`: the KV store as a process (or embedded in another one): the Arrow Flight
server, optionally LMCache's `lm://` protocol on a second port and Prometheus metrics over
HTTP, all over one backend.

    pdserve kvstore --backend memory --capacity 8GiB --port 50071 [--lm-port 65432]
    pdserve kvstore --backend redis --redis-url redis://127.0.0.1:6379/0 --ttl 3600
    pdserve kvstore --backend redis-cluster --redis-url redis://r1:6379,r2:6379,r3:6379
    pdserve kvstore --host 0.0.0.0 --auth-file tokens.txt --tls-cert s.pem --tls-key s.key

Protected mode (as Redis's): without a token file the store serves only a loopback address
(with a warning); bound elsewhere it refuses to start unless `--no-auth` says open on purpose.
The `lm://` port speaks LMCache's protocol, which has no authentication: it binds `--lm-host`
(127.0.0.1 unless told) and belongs on a trusted network only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from kvstore.backend import Backend, KVStoreError
from kvstore.credentials import TLSFiles, is_loopback, parse_token_file
from kvstore.ports import PortInUseError, port_free, port_in_use_message
from kvstore.server import KVStoreServer
from kvstore.shm import resolve_root
from kvstore.sizes import parse_size

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50071
AUTH_FILE_ENV = "PDSERVE_KV_AUTH_FILE"


class InsecureBindError(ValueError):
    """The store would serve a non-loopback address to anyone (no token file, no --no-auth)."""


@dataclass
class StoreOptions:
    backend: str = "memory"
    capacity: str = "8GiB"
    max_object_size: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"  # redis-cluster: comma-separated startup nodes
    redis_cluster_layout: str = "slot"  # kvstore/backends/cluster_keys.py
    ttl_s: float | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    lm_port: int | None = None
    metrics_port: int | None = None
    validate: bool = True
    # Same-host data path (kvstore/shm.py): "auto" = a directory under /dev/shm when there is
    # one, "off", or a directory to create it under (e.g. a volume shared with the workers).
    shm_dir: str = "auto"
    # Token file (kvstore/credentials.py: `<token> <role>[,<role>...]` lines); None with
    # `no_auth` False = open on loopback only (protected mode).
    auth_file: str | None = None
    no_auth: bool = False
    # TLS: the server's certificate and key; a client CA turns on mutual TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    lm_host: str = "127.0.0.1"

    @property
    def tls(self) -> TLSFiles | None:
        if self.tls_cert is None and self.tls_key is None and self.tls_client_ca is None:
            return None
        if self.tls_cert is None or self.tls_key is None:
            raise ValueError("kvstore TLS needs both --tls-cert and --tls-key")
        return TLSFiles(cert=self.tls_cert, key=self.tls_key, ca=self.tls_client_ca)

    @property
    def scheme(self) -> str:
        return "grpc+tls" if self.tls is not None else "grpc"


def load_tokens(opts: StoreOptions) -> dict[str, frozenset[str]] | None:
    """The token -> roles map the server checks, or None (open). Applies protected mode:
    open is allowed on a loopback host, or anywhere with `no_auth`."""
    if opts.no_auth and opts.auth_file:
        raise ValueError("kvstore: --no-auth and an auth file (--auth-file / "
                         f"{AUTH_FILE_ENV}) contradict each other; give one")
    if opts.auth_file:
        _warn_if_readable_by_others(opts.auth_file)
        tokens = parse_token_file(opts.auth_file)
        if not tokens:
            raise ValueError(f"kvstore: auth file {opts.auth_file} holds no tokens")
        return tokens
    if opts.no_auth:
        logger.warning("kvstore: --no-auth: anyone who reaches %s can read and write every "
                       "object", opts.host)
    elif is_loopback(opts.host):
        logger.warning("kvstore: no auth file: open to every process of this machine "
                       "(give --auth-file to require tokens)")
    else:
        raise InsecureBindError(
            f"refusing to serve {opts.host} without credentials: give --auth-file (or "
            f"{AUTH_FILE_ENV}), bind a loopback --host, or pass --no-auth to run open")
    return None


def _warn_if_readable_by_others(path: str) -> None:
    if os.stat(path).st_mode & 0o077:
        logger.warning("kvstore: auth file %s is readable by other users (chmod 600 it)", path)


def build_backend(opts: StoreOptions) -> Backend:
    if opts.backend == "memory":
        from kvstore.backends.memory import MemoryBackend

        capacity = parse_size(opts.capacity, "capacity")
        max_obj = parse_size(opts.max_object_size, "max_object_size") if opts.max_object_size else None
        return MemoryBackend(capacity, max_object_bytes=max_obj, default_ttl_s=opts.ttl_s)
    if opts.backend == "redis":
        from kvstore.backends.redis_backend import RedisBackend

        return RedisBackend(opts.redis_url, default_ttl_s=opts.ttl_s)
    if opts.backend == "redis-cluster":
        from kvstore.backends.redis_cluster import RedisClusterBackend

        return RedisClusterBackend(opts.redis_url, layout=opts.redis_cluster_layout,
                                   default_ttl_s=opts.ttl_s)
    raise ValueError(f"backend must be 'memory', 'redis' or 'redis-cluster', got {opts.backend!r}")


class KVStoreService:
    """The Flight server (+ lm:// server, + metrics HTTP) over one backend. `start()` returns
    once every port is bound; `stop()` shuts all down."""

    def __init__(self, opts: StoreOptions, backend: Backend | None = None) -> None:
        tokens = load_tokens(opts)  # first: a refused start binds nothing
        for host, port, what in ((opts.host, opts.port, "kvstore"),
                                 (opts.lm_host, opts.lm_port, "kvstore lm://"),
                                 (opts.host, opts.metrics_port, "kvstore metrics")):
            if port and not port_free(host, port):  # gRPC alone would share it (SO_REUSEPORT)
                raise PortInUseError(port_in_use_message(host, port, what))
        self.opts = opts
        self.backend = backend if backend is not None else build_backend(opts)
        max_obj = parse_size(opts.max_object_size, "max_object_size") if opts.max_object_size else None
        self.server = KVStoreServer(self.backend, f"{opts.scheme}://{opts.host}:{opts.port}",
                                    max_object_bytes=max_obj, validate=opts.validate,
                                    default_ttl_s=opts.ttl_s, shm_root=resolve_root(opts.shm_dir),
                                    tokens=tokens, tls=opts.tls)
        self.lm_server: Any = None
        self._metrics_httpd: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.port)

    @property
    def location(self) -> str:
        return f"{self.opts.scheme}://{self.opts.host}:{self.port}"

    def start(self) -> KVStoreService:
        self._thread = threading.Thread(target=self.server.serve, name="kvstore-flight", daemon=True)
        self._thread.start()
        if self.opts.lm_port is not None:
            from kvstore.lm_server import LMServer

            if not is_loopback(self.opts.lm_host):
                logger.warning("kvstore: lm:// on %s has no authentication (LMCache's protocol "
                               "has none): keep it on a trusted network", self.opts.lm_host)
            self.lm_server = LMServer(self.backend, host=self.opts.lm_host, port=self.opts.lm_port)
            self.lm_server.start()
        if self.opts.metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_httpd, _ = start_http_server(self.opts.metrics_port, addr=self.opts.host,
                                                       registry=self.server.metrics.registry)
        shm = self.server.shm
        logger.info("kvstore (%s backend) on %s%s%s", self.backend.name, self.location,
                    f", lm:// on {self.lm_server.port}" if self.lm_server is not None else "",
                    f", same-host payloads in {shm.dir}" if shm is not None else "")
        return self

    def stop(self) -> None:
        if self.lm_server is not None:
            self.lm_server.stop()
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
        self.server.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.server.close_shm()
        self.backend.close()

    def __enter__(self) -> KVStoreService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_kvstore_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("kvstore", help="run the shared KV store service")
    p.add_argument("--backend", choices=["memory", "redis", "redis-cluster"], default="memory",
                   help="redis-cluster: a stateless front-end; run several over one cluster")
    p.add_argument("--capacity", default="8GiB", help="memory backend: bytes held (8GiB, 512MiB)")
    p.add_argument("--max-object-size", default=None, help="largest object accepted (e.g. 256MiB)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="redis-cluster: startup nodes, redis://host:port[,host:port...]")
    p.add_argument("--redis-cluster-layout", choices=["slot", "lmcache"], default="slot",
                   help="slot: an object's keys in one hash slot (atomic puts); lmcache: "
                        "LMCache's RedisClusterConnector keys (not atomic across slots)")
    p.add_argument("--ttl", type=float, default=None, help="default seconds until objects expire")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="Arrow Flight port")
    p.add_argument("--lm-port", type=int, default=None, help="also serve LMCache's lm:// protocol")
    p.add_argument("--lm-host", default="127.0.0.1",
                   help="address of the lm:// port (no authentication: trusted networks only)")
    p.add_argument("--auth-file", default=None,
                   help=f"token file, lines '<token> <role>[,<role>...]' with roles producer, "
                        f"consumer, admin (default: ${AUTH_FILE_ENV})")
    p.add_argument("--no-auth", action="store_true",
                   help="serve a non-loopback --host without tokens (anyone reaching it may "
                        "read and write)")
    p.add_argument("--tls-cert", default=None, help="server certificate (PEM): serve grpc+tls")
    p.add_argument("--tls-key", default=None, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default=None,
                   help="CA (PEM) that signs client certificates: mutual TLS, certificates required")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics over HTTP")
    p.add_argument("--no-validate", action="store_true",
                   help="accept any key and metadata (not only LMCache keys / RemoteMetadata)")
    p.add_argument("--shm-dir", default="auto", metavar="auto|off|DIR",
                   help="same-host data path: clients that see this directory exchange payloads "
                        "as files in it instead of over the network (auto: under /dev/shm)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_kvstore)


def run_kvstore(args: argparse.Namespace) -> int:
    opts = StoreOptions(backend=args.backend, capacity=args.capacity,
                        max_object_size=args.max_object_size, redis_url=args.redis_url,
                        redis_cluster_layout=args.redis_cluster_layout,
                        ttl_s=args.ttl, host=args.host, port=args.port, lm_port=args.lm_port,
                        metrics_port=args.metrics_port, validate=not args.no_validate,
                        shm_dir=args.shm_dir,
                        auth_file=args.auth_file or os.environ.get(AUTH_FILE_ENV) or None,
                        no_auth=args.no_auth, tls_cert=args.tls_cert, tls_key=args.tls_key,
                        tls_client_ca=args.tls_client_ca, lm_host=args.lm_host)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before anything can signal us
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = KVStoreService(opts).start()
    # InsecureBindError, bad auth/TLS files, a Redis (Cluster) that cannot be reached
    except (PortInUseError, ValueError, OSError, KVStoreError) as e:
        print(f"pdserve kvstore: {e}", file=sys.stderr)
        return 1
    print(f"kvstore: {service.backend.name} backend on {service.location}", flush=True)
    while not stop.wait(0.5):  # polling: a signal is always seen within half a second
        pass
    stopper = threading.Thread(target=service.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=15)
    if stopper.is_alive():
        logger.warning("kvstore: shutdown did not finish in 15 s; exiting anyway")
        print(f"kvstore: stopped ({service.location})", flush=True)
        os._exit(0)
    print(f"kvstore: stopped ({service.location})", flush=True)
    return 0
