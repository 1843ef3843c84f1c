"""KV store benchmark (issues #4, #19): pdserve's store (memory backend, Arrow Flight) open and
secured, against raw redis-py SET/GET on a real redis-server and against plain gRPC bytes (unary
calls carrying the payload), all on loopback, in one run.

"pdserve secured" is a second `pdserve kvstore` started with `--auth-file` (a token file this
script writes, 0600, in a private temporary directory); its client presents a producer,consumer
bearer token, its puts carry keyed BLAKE3 checksums and its gets verify them, as the KV
connector does (kvstore/auth.py, kvstore/integrity.py). Both pdserve stores take the same data
path: same-host shared memory when the server offers it (the default), else Flight.

Rows: put and get throughput (MB/s of payload, median of the repeats) for 1, 8 and 64 MB
objects, and for batches of 30 per-layer objects of 256 tokens (KV_T2D, the default model's
shape: 256 x 2 x 192 float32 = 384 KiB each); then p50 / p99 latency of one 30-layer get.
Targets: open pdserve >= 2x plain gRPC and >= raw Redis throughput for large objects; secured
costs under 5%: its time per operation (1 / throughput, or latency) <= 1.05x open's.

    python benchmarks/bench_kvstore.py [--repeats 15] [--latency-samples 100]

All four servers run at once, each in its own process; rounds are interleaved across them, the
order rotating each round.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import markdown_table, median, percentile
from benchmarks.kvstore_process import StoreProcess
from services.procs import free_port

MB = 1_000_000
LAYER_SHAPE = (256, 2, 192)  # tokens, K/V, kv_heads * head_dim of SmolLM2-135M
LAYERS = 30
OPEN, SECURED = "pdserve", "pdserve secured"
COST_TARGET = 1.05  # secured / open time per operation: a cost under 5%


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--latency-samples", type=int, default=100)
    p.add_argument("--sizes-mb", default="1,8,64")
    p.add_argument("--skip-redis", action="store_true")
    return p.parse_args(argv)


# --- systems: put(items) / get(keys) over (key, metadata, payload) -------------------------
class PdserveStore:
    """`pdserve kvstore` in its own process, as deployed (each server here has its own).
    Secured: the server checks tokens, the client presents one, puts carry keyed checksums and
    gets verify them (a failure raises: the benchmark must not time a broken path)."""

    def __init__(self, secured: bool = False) -> None:
        from kvstore.client import KVStoreClient
        from kvstore.integrity import derive_key

        self.name = SECURED if secured else OPEN
        self.key = derive_key(secrets.token_hex(16)) if secured else None
        self.store = StoreProcess(capacity="6GiB", secured=secured)
        # token "": send none, whatever PDSERVE_KV_TOKEN says (the open store takes any call)
        self.client = KVStoreClient(self.store.url, timeout_s=120, token=self.store.token or "")
        self.shm = self.client.shm_dir() is not None

    def put(self, items: list[tuple[str, bytes, np.ndarray]]) -> None:
        from kvstore.integrity import checksum

        if self.key is None:
            self.client.put(items)
            return
        self.client.put([(k, meta, data, checksum(k, meta, data, self.key)) for k, meta, data in items])

    def get(self, keys: list[str]) -> int:
        from kvstore.integrity import verify

        objs = self.client.get(keys)
        if self.key is not None:
            for k, o in zip(keys, objs, strict=True):
                if o is not None and not verify(k, o.metadata, o.data, o.checksum, self.key):
                    raise RuntimeError(f"{k}: checksum does not verify")
        return sum(len(o.data) for o in objs if o is not None)

    def close(self) -> None:
        self.client.close()
        self.store.stop()


class RawRedis:
    name = "redis-py SET/GET"

    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.r = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def put(self, items: list[tuple[str, bytes, np.ndarray]]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for key, meta, data in items:  # LMCache's layout: two keys per object
            pipe.set(key + "metadata", meta)
            pipe.set(key + "kv_bytes", data.reshape(-1).view(np.uint8).data)  # 1-D: redis-py sends len()
        pipe.execute()

    def get(self, keys: list[str]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.get(key + "metadata")
            pipe.get(key + "kv_bytes")
        return sum(len(v) for v in pipe.execute()[1::2] if v is not None)

    def close(self) -> None:
        self.r.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


GRPC_OPTIONS = [("grpc.max_receive_message_length", 256 * MB),
                ("grpc.max_send_message_length", 256 * MB)]


def plain_grpc_server(port: int) -> None:
    """The peer's server process: a dict behind two unary byte methods."""
    import grpc

    store: dict[str, bytes] = {}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)

    def put(request: bytes, context: Any) -> bytes:
        n = int.from_bytes(request[:2], "little")
        store[request[2:2 + n].decode()] = request[2 + n:]
        return b""

    def get(request: bytes, context: Any) -> bytes:
        return store.get(request.decode(), b"")

    handlers = {"Put": grpc.unary_unary_rpc_method_handler(put),
                "Get": grpc.unary_unary_rpc_method_handler(get)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bytes", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination(timeout=3600)


class PlainGrpc:
    """A bytes-in, bytes-out gRPC store in its own process: one unary call per object
    (key length, key, metadata length, metadata, data), as a service without a bulk data
    plane would do."""

    name = "plain gRPC bytes"

    def __init__(self) -> None:
        import multiprocessing

        import grpc

        port = free_port()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=plain_grpc_server, args=(port,), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("plain gRPC server did not start")
            time.sleep(0.05)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        self._put = self.channel.unary_unary("/bench.Bytes/Put")
        self._get = self.channel.unary_unary("/bench.Bytes/Get")

    def put(self, items: list[tuple[str, bytes, np.ndarray]]) -> None:
        for key, meta, data in items:
            k = key.encode()
            self._put(len(k).to_bytes(2, "little") + k + len(meta).to_bytes(4, "little") + meta
                      + data.tobytes(), timeout=120)

    def get(self, keys: list[str]) -> int:
        return sum(len(self._get(k.encode(), timeout=120)) for k in keys)

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.join(timeout=30)


# --- workloads -----------------------------------------------------------------------------
def lmcache_items(chunk_hash: int, payloads: list[np.ndarray], shape: tuple[int, ...]
                  ) -> list[tuple[str, bytes, np.ndarray]]:
    """LMCache layer keys of one chunk and KV_T2D RemoteMetadata headers for the payloads."""
    from kvstore.lmcache_format import CacheEngineKey, MemoryFormat, RemoteMetadata

    chunk = CacheEngineKey("smollm2-135m-instruct", 1, 0, chunk_hash, "float32")
    meta = RemoteMetadata.single(shape, "float32", MemoryFormat.KV_T2D).pack()
    return [(chunk.layer(i).to_string(), meta, p) for i, p in enumerate(payloads)]


def interleaved(ops: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Times each system's op `repeats` times, rounds interleaved (A, B, C, then B, C, A, ...:
    the order rotates each round) so that load from elsewhere on the machine, and whatever one
    system leaves behind for the next, hits every system alike; one warm-up each first."""
    for fn in ops.values():
        fn()
    names = list(ops)
    out: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            ops[name]()
            out[name].append(time.perf_counter() - start)
    return out


def run_all(systems: list[Any], args: argparse.Namespace, rng: np.random.Generator
            ) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {s.name: {} for s in systems}

    def measure(label: str, nbytes: int, items: list[tuple[str, bytes, np.ndarray]]) -> None:
        keys = [k for k, _, _ in items]
        puts = interleaved({s.name: partial(s.put, items) for s in systems}, args.repeats)
        gets = interleaved({s.name: partial(s.get, keys) for s in systems}, args.repeats)
        for s in systems:
            res[s.name][f"put {label}"] = nbytes / median(puts[s.name])
            res[s.name][f"get {label}"] = nbytes / median(gets[s.name])

    for mb in [int(s) for s in args.sizes_mb.split(",")]:
        data = rng.integers(0, 255, size=mb * MB, dtype=np.uint8).view(np.float32)
        measure(f"{mb} MB", mb * MB, lmcache_items(1000 + mb, [data], (mb * MB // 4,)))
    layers = [rng.standard_normal(LAYER_SHAPE, dtype=np.float32) for _ in range(LAYERS)]
    items = lmcache_items(7, layers, LAYER_SHAPE)
    measure(f"{LAYERS} x 384 KiB", sum(a.nbytes for a in layers), items)
    keys = [k for k, _, _ in items]
    lat = interleaved({s.name: partial(s.get, keys) for s in systems}, args.latency_samples)
    for s in systems:
        res[s.name]["lat"] = (percentile(lat[s.name], 50), percentile(lat[s.name], 99))
    return res


def cost_cells(cost: float) -> list[object]:
    """The secured / open time ratio and its verdict against the 5% target."""
    return [f"{cost:.3f}", "ok" if cost <= COST_TARGET else "MISS"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    makers: list[Callable[[], Any]] = [PdserveStore, partial(PdserveStore, True), PlainGrpc]
    if not args.skip_redis:
        makers.insert(2, RawRedis)
    systems: list[Any] = []
    try:
        for make in makers:
            systems.append(make())
        shm = {s.name: s.shm for s in systems if isinstance(s, PdserveStore)}
        if shm[OPEN] != shm[SECURED]:
            raise RuntimeError(f"the pdserve stores take different data paths (shared memory: {shm})")
        results = run_all(systems, args, rng)
    finally:
        for system in systems:
            system.close()
    names = list(results)
    grpc_name = "plain gRPC bytes"
    redis_name = "redis-py SET/GET" if "redis-py SET/GET" in results else None
    ours, secured = results[OPEN], results[SECURED]
    rows = []
    for measure in [m for m in ours if m != "lat"]:
        row: list[object] = [measure, *[f"{results[n][measure] / MB:.0f}" for n in names]]
        row += cost_cells(ours[measure] / secured[measure])  # time ratio = inverse throughput ratio
        row.append(f"{ours[measure] / results[grpc_name][measure]:.2f}")
        row.append(f"{ours[measure] / results[redis_name][measure]:.2f}" if redis_name else "-")
        rows.append(row)
    for q, label in ((0, "p50"), (1, "p99")):
        row = [f"30-layer get latency {label} (ms)", *[f"{results[n]['lat'][q] * 1e3:.2f}" for n in names]]
        row += cost_cells(secured["lat"][q] / ours["lat"][q])
        row.append(f"{results[grpc_name]['lat'][q] / ours['lat'][q]:.2f}")
        row.append(f"{results[redis_name]['lat'][q] / ours['lat'][q]:.2f}" if redis_name else "-")
        rows.append(row)
    print(f"kvstore benchmark: loopback, median of {args.repeats} interleaved runs (MB/s of "
          f"payload; latency over {args.latency_samples} gets); pdserve same-host shared memory "
          f"{'on' if shm[OPEN] else 'off'} for both; '{SECURED}' = bearer token + keyed BLAKE3 "
          f"checksums put and verified; 'secured/open time' = its time per operation over open's "
          f"(target <= {COST_TARGET}x: cost under 5%); 'vs' ratios > 1 favour open pdserve")
    print(markdown_table(["measure", *names, "secured/open time", f"target <= {COST_TARGET}x",
                          "vs gRPC", "vs Redis"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
