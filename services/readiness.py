"""Readiness checks that confirm they reached the process just started: each takes the instance
id the launcher gave that process (services/procs.py) and is True only when the component on
the address serves and reports that id. A second `pdserve up` on ports an earlier one holds can
never take the earlier one's answers for its own.

Liveness checks (`*_alive`) say whether a running component still answers at all (a worker whose
engine restarts is alive, not ready); a supervisor kills one that stays unresponsive."""

from __future__ import annotations

import http.client
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
    """The worker at host:port serves (engine up) as that instance (reached with the worker
    token and TLS files of the environment, as every client of workers)."""
    def ready(instance: str) -> bool:
        import grpc

        from protos import worker_pb2 as pb
        from protos import worker_pb2_grpc as pb_grpc
        from services.worker.auth import WorkerAccess

        access = WorkerAccess.from_env()
        try:
            with access.channel(target) as channel:
                report = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=1.0,
                                                          metadata=access.metadata)
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
        except (OSError, ValueError, http.client.HTTPException):
            return False

    return ready


AliveCheck = Callable[[], bool]


def worker_alive(target: str, timeout_s: float = 2.0) -> AliveCheck:
    """The worker answers its gRPC health service "liveness" with SERVING (health needs no
    token; the channel is TLS when the environment says so)."""
    def alive() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from services.worker.auth import WorkerAccess

        try:
            with WorkerAccess.from_env().channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="liveness"), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return alive


def router_alive(url: str, timeout_s: float = 2.0) -> AliveCheck:
    """The router answers /livez."""
    def alive() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/livez", timeout=timeout_s) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError, http.client.HTTPException):
            return False

    return alive


def store_alive(url: str, timeout_s: float = 2.0) -> AliveCheck:
    """The KV store answers its health action (whatever its backend says). A store that
    refuses this process's token answered too: alive (the client logs the refusal)."""
    def alive() -> bool:
        from kvstore.client import KVStoreAuthError, KVStoreClient, KVStoreClientError

        client = KVStoreClient(url, timeout_s=timeout_s, use_shm=False)
        try:
            client.health()
            return True
        except KVStoreAuthError:
            return True
        except KVStoreClientError:
            return False
        finally:
            client.close()

    return alive
