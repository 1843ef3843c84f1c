"""Worker servers for service tests: a real KV store, and prefill / decode / colocated workers
(gRPC in this process, each engine core in its own process) on a tiny random Llama."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.config import EngineConfig
from kvstore.service import KVStoreService, StoreOptions
from services.procs import free_port
from services.worker.server import ROLES, WorkerOptions, WorkerRole, WorkerServer
from tests.integration.kv_util import pages_like


def engine_config(model_dir: Path, kv_store_url: str) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_threads=1, max_model_len=512,
                        num_kv_blocks=pages_like(model_dir, 96), kv_store_url=kv_store_url)


@pytest.fixture(scope="module")
def store() -> Iterator[KVStoreService]:
    with KVStoreService(StoreOptions(capacity="256MiB", port=free_port())) as service:
        yield service


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


StartWorker = Callable[[WorkerRole], Awaitable[WorkerServer]]


def worker_options(model_dir: Path, store: KVStoreService, role: WorkerRole, **kw: Any) -> WorkerOptions:
    """A worker of `role` on the tiny model and the store, on a free port."""
    config = engine_config(model_dir, kv_store_url=store.location)
    return WorkerOptions(role=role, engine=config, port=free_port(), **{"grace_s": 5.0, **kw})


@pytest.fixture(scope="module")
def start_worker(model_dir: Path, store: KVStoreService) -> StartWorker:
    """`await start_worker(role)`: a started worker on the tiny model; the caller stops it."""

    async def start(role: WorkerRole) -> WorkerServer:
        server = WorkerServer(worker_options(model_dir, store, role))
        await server.start()
        return server

    return start


@contextlib.asynccontextmanager
async def running_together(servers: dict[str, WorkerServer]) -> AsyncIterator[dict[str, WorkerServer]]:
    """Starts `servers` at once (their engine cores load in parallel); stops every one of them
    at the end, also when one failed to start (its error is raised)."""
    started = await asyncio.gather(*(s.start() for s in servers.values()), return_exceptions=True)
    try:
        for result in started:
            if isinstance(result, BaseException):
                raise result
        yield servers
    finally:
        for server in servers.values():
            await server.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(model_dir: Path, store: KVStoreService) -> AsyncIterator[dict[str, WorkerServer]]:
    """One worker of each role, by role name (started together)."""
    async with running_together({role: WorkerServer(worker_options(model_dir, store, role))
                                 for role in ROLES}) as servers:
        yield servers


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def colocated_worker(start_worker: StartWorker) -> AsyncIterator[WorkerServer]:
    """A colocated worker of the module's own (apart from `workers`)."""
    server = await start_worker("colocated")
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def router(colocated_worker: WorkerServer, model_dir: Path) -> Iterator[Any]:
    """A router (a ServedRouter, model name "tiny") on the module's colocated worker; a module
    that needs another setup defines its own `router`."""
    from services.router.app import RouterConfig
    from services.router.dispatch.dispatcher import DispatchOptions
    from tests.integration.services.router_util import ServedRouter

    dispatch = DispatchOptions(decode=(colocated_worker.target,), decode_timeout_s=60)
    with ServedRouter(RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


@pytest_asyncio.fixture(loop_scope="module")
async def client(router: Any) -> AsyncIterator[Any]:
    """The official openai client (no retries) on the module's `router` fixture (a ServedRouter)."""
    import openai

    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def routers(workers: dict[str, WorkerServer], model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """Two routers (ServedRouters, model name "tiny") on the module's `workers`: (split over its
    prefill and decode workers, colocated on its colocated worker)."""
    from services.router.app import RouterConfig
    from services.router.dispatch.dispatcher import DispatchOptions
    from tests.integration.services.router_util import ServedRouter

    split = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,))
    colocated = DispatchOptions(decode=(workers["colocated"].target,))
    configs = [RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=512, dispatch=d)
               for d in (split, colocated)]
    with ServedRouter(configs[0]) as a, ServedRouter(configs[1]) as b:
        yield a, b
