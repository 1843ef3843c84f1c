"""The router learns each worker's tensor-parallel size from its Load reports: a pool hands a
prefill off early only under the one size all its serving workers reported (none for a mix; a
worker yet to report counts as 1 beside reports of 1, as unknown beside a larger size)."""

from __future__ import annotations

from protos import worker_pb2 as pb
from services.router.dispatch.pool import WorkerPool


async def test_a_pool_shares_a_tp_size_only_when_its_serving_workers_report_one() -> None:
    pool = WorkerPool("prefill", ["127.0.0.1:1", "127.0.0.1:2"])
    a, b = pool.workers
    assert pool.shared_tp_size() == 1  # no report yet: as before tensor parallelism
    a.load = pb.LoadReport(serving=True, tensor_parallel_size=2)
    assert pool.shared_tp_size() is None  # b's size is unknown beside a's 2
    b.load = pb.LoadReport(serving=True, tensor_parallel_size=2)
    assert pool.shared_tp_size() == 2 and a.tp_size == 2
    b.load = pb.LoadReport(serving=True)  # an older worker: no size, read as 1
    assert b.tp_size == 1 and pool.shared_tp_size() is None
    b.healthy = False  # only the serving ones count
    assert pool.shared_tp_size() == 2
    await pool.close()
