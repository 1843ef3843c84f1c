"""A worker process's configuration (services/worker/server.py): its role, where it listens,
its engine (with the KV connector its role needs), health and metrics settings, credentials."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from engine.config import EngineConfig
from kvstore.credentials import TLSFiles
from services.worker.engine_guard import GuardOptions

WorkerRole = Literal["prefill", "decode", "colocated"]
ROLES: tuple[WorkerRole, ...] = ("prefill", "decode", "colocated")
_KV_ROLES: dict[str, Literal["kv_producer", "kv_consumer"]] = {
    "prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class WorkerOptions:
    """One worker process: its role, where it listens, and its engine (connector set by role)."""

    role: WorkerRole
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    grace_s: float = 10.0  # how long shutdown waits for in-flight calls
    metrics_port: int | None = None  # Prometheus /metrics on `host`; None = off, 0 = any free port
    heartbeat_s: float = 1.0  # an idle Decode stream gets an empty chunk this often
    reuse_port: bool = False  # SO_REUSEPORT: several worker processes share `port` (asked for only)
    guard: GuardOptions = field(default_factory=GuardOptions)
    served_model_name: str | None = None  # the metrics' model_name (the router's); None = engine.model
    token: str | None = field(default=None, repr=False)  # calls need `authorization: Bearer <token>`
    tls: TLSFiles = field(default_factory=TLSFiles)  # cert + key: TLS; ca: clients need certificates
    no_auth: bool = False  # may listen beyond loopback with neither token nor client certificates

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be non-negative, got {self.grace_s}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.tls.enabled and self.tls.cert is None:
            raise ValueError("tls: a worker's TLS needs its certificate and key (a client CA alone "
                             "is not enough)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def engine_config(self) -> EngineConfig:
        """The engine config with the KV connector the role needs (none when colocated)."""
        if self.role == "colocated":
            return replace(self.engine, kv_connector=None)
        return replace(self.engine, kv_connector="kvstore", kv_role=_KV_ROLES[self.role])
