"""KV store on Redis Cluster benchmark (issue #21): pdserve's store as 1 and as 3 stateless
front-ends (`pdserve kvstore --backend redis-cluster`) over a 3-master Redis Cluster, against the
peer: one front-end over one plain redis-server (`--backend redis`), all on loopback, in one run.

Rows: p50 / p99 latency of one 30-layer get (one client, the 30 per-layer objects of one chunk
in one call), then put and get throughput (MB/s of payload) with `--clients` concurrent clients
(threads, each with its own KVStoreClient), each putting then getting `--ops` chunks of 30
per-layer objects of its own. A 3-front-end client names all three front-ends
(`grpc://a,grpc://b,grpc://c`); its calls spread by the hash of their first key. Medians over
`--repeats` interleaved rounds (the order rotating each round). Clients reach front-ends over
Flight (`--shm` to let them use the same-host shared-memory path instead).

    python benchmarks/bench_kvstore_cluster.py [--repeats 5] [--clients 4] [--layer-tokens 256]

On one machine every front-end, Redis node and client shares the same cores: what a cluster
adds (more masters, more front-ends) shows as capacity on several hosts, not here; the ratios
say what the cluster path costs per operation against the one-Redis path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.bench_kvstore import LAYERS, interleaved, lmcache_items
from benchmarks.common import markdown_table, median, percentile
from benchmarks.kvstore_process import StoreProcess
from loadtest.redis_cluster import RedisCluster, free_port_in, missing_tools

MB = 1_000_000
PEER = "1 FE / 1 redis"
ONE, THREE = "1 FE / cluster", "3 FE / cluster"
PORTS = (21000, 22000)  # the Redis nodes and front-ends of this benchmark


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--latency-samples", type=int, default=50)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--ops", type=int, default=3, help="chunks each client puts and gets per round")
    p.add_argument("--layer-tokens", type=int, default=256,
                   help="tokens per layer object (256: 384 KiB, the default model's shape)")
    p.add_argument("--shm", action="store_true", help="clients may use the shared-memory path")
    return p.parse_args(argv)


class PlainRedis:
    """The peer's Redis: one redis-server, no persistence."""

    def __init__(self, taken: set[int]) -> None:
        import redis

        self.port = free_port_in(*PORTS, taken)
        self.dir = tempfile.mkdtemp(prefix="pdserve-bench-redis-")
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class System:
    """A store as clients see it: a location naming its front-ends, and a client per user."""

    def __init__(self, name: str, fronts: list[StoreProcess], args: argparse.Namespace) -> None:
        self.name = name
        self.fronts = fronts
        self.location = ",".join(f.url for f in fronts)
        self.args = args
        self.clients = [self.client() for _ in range(args.clients)]

    def client(self) -> Any:
        from kvstore.client import KVStoreClient

        return KVStoreClient(self.location, timeout_s=120, use_shm=self.args.shm, token="")

    def close(self) -> None:
        for c in self.clients:
            c.close()


def concurrent(clients: list[Any], work: Callable[[int, Any], None]) -> None:
    """Runs work(i, client) on every client at once, each in its own thread."""
    errors: list[BaseException] = []

    def run(i: int, client: Any) -> None:
        try:
            work(i, client)
        except BaseException as exc:  # reported below: a failed round must not be timed
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def measure(systems: list[System], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(0)
    shape = (args.layer_tokens, 2, 192)  # tokens, K/V, kv_heads * head_dim of SmolLM2-135M
    layers = [rng.standard_normal(shape, dtype=np.float32) for _ in range(LAYERS)]
    chunk_bytes = sum(a.nbytes for a in layers)
    chunks = {(c, o): lmcache_items(10_000 * c + o, layers, shape)
              for c in range(args.clients) for o in range(args.ops)}

    def put_all(s: System) -> None:
        def work(i: int, cl: Any) -> None:
            for o in range(args.ops):
                cl.put(chunks[i, o])
        concurrent(s.clients, work)

    def get_all(s: System) -> None:
        def work(i: int, cl: Any) -> None:
            for o in range(args.ops):
                got = cl.get([k for k, _, _ in chunks[i, o]])
                if any(g is None for g in got):
                    raise RuntimeError(f"{s.name}: a stored layer is missing")
        concurrent(s.clients, work)

    res: dict[str, dict[str, Any]] = {s.name: {} for s in systems}
    total = args.clients * args.ops * chunk_bytes
    puts = interleaved({s.name: partial(put_all, s) for s in systems}, args.repeats)
    gets = interleaved({s.name: partial(get_all, s) for s in systems}, args.repeats)
    keys = [k for k, _, _ in chunks[0, 0]]
    lat = interleaved({s.name: partial(s.clients[0].get, keys) for s in systems},
                      args.latency_samples)
    for s in systems:
        res[s.name] = {"put": total / median(puts[s.name]), "get": total / median(gets[s.name]),
                       "p50": percentile(lat[s.name], 50), "p99": percentile(lat[s.name], 99)}
    res["_"] = {"chunk_bytes": chunk_bytes}
    return res


def start(args: argparse.Namespace, stack: list[Any]) -> list[System]:
    taken: set[int] = set()
    plain = PlainRedis(taken)
    stack.append(plain)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-bench-cluster-"))
    cluster = RedisCluster(workdir, low=PORTS[0], high=PORTS[1]).start()
    stack.append(cluster)

    def front(*extra: str) -> StoreProcess:
        proc = StoreProcess(extra=extra, port=free_port_in(*PORTS, taken | set(cluster.ports)))
        taken.add(proc.port)
        stack.append(proc)
        return proc

    peer = front("--backend", "redis", "--redis-url", plain.url)
    fronts = [front("--backend", "redis-cluster", "--redis-url", cluster.url) for _ in range(3)]
    return [System(PEER, [peer], args), System(ONE, fronts[:1], args), System(THREE, fronts, args)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = missing_tools()
    if why is not None:
        print(f"bench_kvstore_cluster: {why}", file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    stack: list[Any] = []
    systems: list[System] = []
    try:
        systems = start(args, stack)
        res = measure(systems, args)
    finally:
        for s in systems:
            s.close()
        for thing in reversed(stack):
            thing.stop()
    names = [s.name for s in systems]
    peer = res[PEER]
    rows: list[list[object]] = []
    for key, label in (("p50", "30-layer get latency p50 (ms)"), ("p99", "30-layer get latency p99 (ms)")):
        rows.append([label, *[f"{res[n][key] * 1e3:.2f}" for n in names],
                     *[f"{peer[key] / res[n][key]:.2f}" for n in (ONE, THREE)]])
    for key in ("put", "get"):
        rows.append([f"{key} MB/s, {args.clients} clients", *[f"{res[n][key] / MB:.0f}" for n in names],
                     *[f"{res[n][key] / peer[key]:.2f}" for n in (ONE, THREE)]])
    layer_kib = res["_"]["chunk_bytes"] / LAYERS / 1024
    print(f"kvstore cluster benchmark: loopback, 3-master Redis Cluster (no replicas) vs one "
          f"redis-server; 30-layer chunks of {layer_kib:.0f} KiB per layer; {args.clients} "
          f"concurrent clients x {args.ops} chunks; median of {args.repeats} interleaved rounds, "
          f"latency over {args.latency_samples} gets; client path "
          f"{'shared memory allowed' if args.shm else 'Flight'}; ratios > 1 favour the cluster "
          f"column; load average {_load(load_before)} before, {_load(os.getloadavg())} after "
          f"(on {os.cpu_count()} cores)")
    print(markdown_table(["measure", *names, f"{ONE} vs peer", f"{THREE} vs peer"], rows))
    return 0


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


if __name__ == "__main__":
    raise SystemExit(main())
