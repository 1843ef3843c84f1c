"""A minimal OTLP/gRPC trace collector on loopback, for tests: it keeps every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.procs import free_port


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False
    start_ns: int = 0
    end_ns: int = 0
    message: str = ""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(),
                                    {a.key: _value(a.value) for a in s.attributes},
                                    s.status.code == 2, s.start_time_unix_nano, s.end_time_unix_nano,
                                    s.status.message))
        with self._lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, ready: Any, timeout_s: float = 30.0) -> list[Span]:
        """The trace's spans once `ready(spans)` holds (fails with them after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if ready(spans):
                return spans
            assert time.monotonic() < deadline, [(s.service, s.name) for s in spans]
            time.sleep(0.2)

    def stop(self) -> None:
        self.server.stop(0)
