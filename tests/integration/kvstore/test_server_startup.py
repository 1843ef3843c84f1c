"""A store answers no call before it is whole. pyarrow's FlightServerBase starts serving inside
its own __init__, and callers of `pdserve kvstore` poll a fixed port, so a call can arrive while
KVStoreServer.__init__ is still running: `shm_info` once answered "'KVStoreServer' object has no
attribute 'shm'" to a benchmark whose health poll had just succeeded (make test, 2026-11-27)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.flight as flight

from kvstore.backends.memory import MemoryBackend
from kvstore.server import KVStoreServer
from protos import kvstore_pb2 as pb


class _CallsOnceServing(flight.FlightServerBase):
    """Placed after KVStoreServer in the MRO: its super().__init__ lands here, which lets the
    base start serving and then calls the server before KVStoreServer.__init__ goes on."""

    answers: dict[str, bytes]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        client = flight.connect(f"grpc://127.0.0.1:{self.port}")
        try:
            self.answers = {
                name: b"".join(r.body.to_pybytes() for r in client.do_action(
                    flight.Action(name, pb.Empty().SerializeToString())))
                for name in ("health", "stats", "shm_info")}
        finally:
            client.close()


class _Probed(KVStoreServer, _CallsOnceServing):
    pass


def test_calls_in_the_first_instant_of_serving_get_whole_answers(tmp_path: Path) -> None:
    server = _Probed(MemoryBackend(2**20), "grpc://127.0.0.1:0", shm_root=str(tmp_path))
    try:
        health = pb.HealthResponse.FromString(server.answers["health"])
        assert health.status == "SERVING"
        assert health.instance_id == server.instance_id
        info = pb.ShmInfo.FromString(server.answers["shm_info"])
        assert server.shm is not None and info.dir == server.shm.dir
    finally:
        server.shutdown()
        server.close_shm()
    assert not any(tmp_path.iterdir())
