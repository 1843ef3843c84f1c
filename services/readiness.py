"""Readiness checks that confirm they reached the process just started: each takes the instance
id the launcher gave that process (services/procs.py) and is True only when the component on
the address serves and reports that id. A second `pdserve up` on ports an earlier one holds can
never take the earlier one's answers for its own."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

ReadyCheck = Callable[[str], bool]


def store_ready(url: str) -> ReadyCheck:
    """The KV store at `url` (grpc://host:port) serves as that instance."""
    def ready(instance: str) -> bool:
        from kvstore.client import KVStoreClient, KVStoreClientError

        client = KVStoreClient(url, timeout_s=1.0, use_shm=False)
        try:
            return client.instance_id() == instance
        except KVStoreClientError:
            return False
        finally:
            client.close()

    return ready


def worker_ready(target: str) -> ReadyCheck:
    """The worker at host:port serves (engine up) as that instance."""
    def ready(instance: str) -> bool:
        import grpc

        from protos import worker_pb2 as pb
        from protos import worker_pb2_grpc as pb_grpc

        try:
            with grpc.insecure_channel(target) as channel:
                report = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(report.serving and report.instance_id == instance)

    return ready


def router_ready(url: str) -> ReadyCheck:
    """The router at `url` (http://host:port) answers /health with 200 as that instance."""
    def ready(instance: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                body = json.loads(resp.read())
                return bool(resp.status == 200 and body.get("instance_id") == instance)
        except (OSError, ValueError):
            return False

    return ready
