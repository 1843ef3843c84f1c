"""A worker's port is its own unless asked: a second worker on a taken port is refused with the
port and the component named; with `reuse_port` (`--reuse-port`) both bind (SO_REUSEPORT)."""

from __future__ import annotations

import pytest

from services.procs import PortInUseError, free_port
from services.worker.server import WorkerOptions, WorkerServer


@pytest.mark.asyncio  # a gRPC aio server is built inside a running loop
async def test_a_taken_worker_port_is_refused_unless_reuse_port_is_asked_for() -> None:
    port = free_port()
    first = WorkerServer(WorkerOptions(role="decode", port=port))  # binds its port when built
    assert first.port == port
    with pytest.raises(PortInUseError, match=f"port {port} \\(decode worker\\).*already in use"):
        WorkerServer(WorkerOptions(role="decode", port=port))

    shared_port = free_port(exclude={port})
    shared = [WorkerServer(WorkerOptions(role="decode", port=shared_port, reuse_port=True)) for _ in range(2)]
    assert [s.port for s in shared] == [shared_port, shared_port]
    with pytest.raises(PortInUseError):  # one that does not ask still cannot take it
        WorkerServer(WorkerOptions(role="decode", port=shared_port))
