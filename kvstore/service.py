"""`pdserve kvstore`: the KV store as a process (or embedded in another one): the Arrow Flight
server, optionally LMCache's `lm://` protocol on a second port and Prometheus metrics over
HTTP, all over one backend.

    pdserve kvstore --backend memory --capacity 8GiB --port 50071 [--lm-port 65432]
    pdserve kvstore --backend redis --redis-url redis://127.0.0.1:6379/0 --ttl 3600
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

from kvstore.backend import Backend
from kvstore.ports import PortInUseError, port_free, port_in_use_message
from kvstore.server import KVStoreServer
from kvstore.shm import resolve_root
from kvstore.sizes import parse_size

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50071


@dataclass
class StoreOptions:
    backend: str = "memory"
    capacity: str = "8GiB"
    max_object_size: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    ttl_s: float | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    lm_port: int | None = None
    metrics_port: int | None = None
    validate: bool = True
    # Same-host data path (kvstore/shm.py): "auto" = a directory under /dev/shm when there is
    # one, "off", or a directory to create it under (e.g. a volume shared with the workers).
    shm_dir: str = "auto"


def build_backend(opts: StoreOptions) -> Backend:
    if opts.backend == "memory":
        from kvstore.backends.memory import MemoryBackend

        capacity = parse_size(opts.capacity, "capacity")
        max_obj = parse_size(opts.max_object_size, "max_object_size") if opts.max_object_size else None
        return MemoryBackend(capacity, max_object_bytes=max_obj, default_ttl_s=opts.ttl_s)
    if opts.backend == "redis":
        from kvstore.backends.redis_backend import RedisBackend

        return RedisBackend(opts.redis_url, default_ttl_s=opts.ttl_s)
    raise ValueError(f"backend must be 'memory' or 'redis', got {opts.backend!r}")


class KVStoreService:
    """The Flight server (+ lm:// server, + metrics HTTP) over one backend. `start()` returns
    once every port is bound; `stop()` shuts all down."""

    def __init__(self, opts: StoreOptions, backend: Backend | None = None) -> None:
        for port, what in ((opts.port, "kvstore"), (opts.lm_port, "kvstore lm://"),
                           (opts.metrics_port, "kvstore metrics")):
            if port and not port_free(opts.host, port):  # gRPC alone would share it (SO_REUSEPORT)
                raise PortInUseError(port_in_use_message(opts.host, port, what))
        self.opts = opts
        self.backend = backend if backend is not None else build_backend(opts)
        max_obj = parse_size(opts.max_object_size, "max_object_size") if opts.max_object_size else None
        self.server = KVStoreServer(self.backend, f"grpc://{opts.host}:{opts.port}",
                                    max_object_bytes=max_obj, validate=opts.validate,
                                    default_ttl_s=opts.ttl_s, shm_root=resolve_root(opts.shm_dir))
        self.lm_server: Any = None
        self._metrics_httpd: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.port)

    @property
    def location(self) -> str:
        return f"grpc://{self.opts.host}:{self.port}"

    def start(self) -> KVStoreService:
        self._thread = threading.Thread(target=self.server.serve, name="kvstore-flight", daemon=True)
        self._thread.start()
        if self.opts.lm_port is not None:
            from kvstore.lm_server import LMServer

            self.lm_server = LMServer(self.backend, host=self.opts.host, port=self.opts.lm_port)
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
    p.add_argument("--backend", choices=["memory", "redis"], default="memory")
    p.add_argument("--capacity", default="8GiB", help="memory backend: bytes held (8GiB, 512MiB)")
    p.add_argument("--max-object-size", default=None, help="largest object accepted (e.g. 256MiB)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--ttl", type=float, default=None, help="default seconds until objects expire")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="Arrow Flight port")
    p.add_argument("--lm-port", type=int, default=None, help="also serve LMCache's lm:// protocol")
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
                        ttl_s=args.ttl, host=args.host, port=args.port, lm_port=args.lm_port,
                        metrics_port=args.metrics_port, validate=not args.no_validate,
                        shm_dir=args.shm_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before anything can signal us
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = KVStoreService(opts).start()
    except PortInUseError as e:
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
        os._exit(0)
    return 0
