"""Clients of the engine core (vLLM's EngineCoreClient family).

- `InprocClient`: the EngineCore lives in this process; `get_output()` steps it.
- `SyncMPClient` / `AsyncMPClient`: the EngineCore runs in a spawned child process
  (engine/core_proc.py) behind two ZMQ PUSH/PULL ipc sockets in a temp dir; messages are typed
  msgpack (engine/serial.py). A reader thread receives outputs; when the child dies every
  waiting call raises `EngineDeadError` instead of hanging. `liveness()` says how long the core
  has been silent and how long its current step has run (from its heartbeats), so a watchdog
  can tell a frozen or stuck core; `kill()` ends one (its requests then fail as for a death).

All clients expose the resolved `config` (max_model_len set) and the model's `vocab_size`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from engine import core_entry
from engine.config import EngineConfig
from engine.core.outputs import EngineCoreOutputs, EngineCoreRequest, EngineStats, FirstToken
from engine.engine_core import EngineCore
from engine.serial import (
    ABORT,
    ADD,
    FAILED,
    FIRST_TOKEN,
    GET_STATS,
    HEARTBEAT,
    OUTPUTS,
    POLL_MS,
    READY,
    SHUTDOWN,
    STATS,
    CoreFailure,
    MessageCodec,
    ReadyInfo,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
STATS_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died or failed); no request can finish."""


@dataclass(frozen=True)
class CoreLiveness:
    """What the front end last heard from its core process."""

    silent_s: float  # seconds since its last message of any kind
    step_s: float  # seconds the step under way has run (0 between steps), as of now


class EngineCoreClient(ABC):
    """Front end's handle on one engine core."""

    config: EngineConfig  # resolved: max_model_len is set
    vocab_size: int

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def add_first_token(self, first: FirstToken) -> None:
        """The prefill's first token of a request added with await_first_token."""

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until there are some, or steps once in-process)."""

    @abstractmethod
    def get_stats(self) -> EngineStats: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def liveness(self) -> CoreLiveness | None:
        """None where the core shares this process (its steps are the caller's)."""
        return None

    def kill(self) -> None:  # noqa: B027 (a no-op where the core shares the process)
        """Ends a core process that no longer answers (no-op in process)."""

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    async def add_first_token_async(self, first: FirstToken) -> None:
        self.add_first_token(first)  # a send: never blocks (in process: overridden)

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def get_stats_async(self) -> EngineStats:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """EngineCore in this process. The async methods step it in a worker thread, one at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.config = self.engine_core.config
        self.vocab_size = self.engine_core.vocab_size
        self._lock = threading.Lock()  # the core is not thread-safe
        self._has_work: asyncio.Event | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self.engine_core.abort_requests(list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        with self._lock:
            return self.engine_core.step()

    def get_stats(self) -> EngineStats:
        with self._lock:
            return self.engine_core.get_stats()

    def shutdown(self) -> None:
        with self._lock:
            self.engine_core.shutdown()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await asyncio.to_thread(self.add_request, request)
        self._work_event().set()

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        await asyncio.to_thread(self.abort_requests, list(request_ids))

    async def add_first_token_async(self, first: FirstToken) -> None:
        await asyncio.to_thread(self.add_first_token, first)
        self._work_event().set()

    def add_first_token(self, first: FirstToken) -> None:
        with self._lock:
            self.engine_core.add_first_token(first)

    async def get_output_async(self) -> EngineCoreOutputs:
        """Waits until the core has requests, then runs one step off the event loop."""
        event = self._work_event()
        while not self.engine_core.has_unfinished_requests():
            event.clear()
            if self.engine_core.has_unfinished_requests():
                break
            await event.wait()
        return await asyncio.to_thread(self.get_output)

    async def get_stats_async(self) -> EngineStats:
        return await asyncio.to_thread(self.get_stats)

    def _work_event(self) -> asyncio.Event:
        if self._has_work is None:
            self._has_work = asyncio.Event()
        return self._has_work


class MPClient(EngineCoreClient):
    """EngineCore in a child process; see the module docstring."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self._codec = MessageCodec()
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-core-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        input_address = f"ipc://{self._tmpdir}/input.ipc"
        output_address = f"ipc://{self._tmpdir}/output.ipc"
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._stats: queue.Queue[EngineStats | EngineDeadError] = queue.Queue()
        self._dead: EngineDeadError | None = None
        self._closing = threading.Event()
        self._closed = False
        self._reader: threading.Thread | None = None
        self._notify_loop: asyncio.AbstractEventLoop | None = None
        self._notify_event: asyncio.Event | None = None
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(
            target=core_entry.main, name="pdserve-engine-core", daemon=True,
            args=(msgspec.msgpack.encode(config), input_address, output_address))
        self.proc.start()
        try:
            ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.config = config.resolved(ready.max_model_len)
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_kv_blocks
        self.ready_stats = ready.stats
        self._heard = time.monotonic()  # any message from the core
        self._step = (0.0, self._heard)  # (its last heartbeat's step seconds, when it came)
        self._reader = threading.Thread(target=self._read_outputs, name="core-client-reader",
                                        daemon=True)
        self._reader.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and self._dead is None and not self._closed:  # a dead core holds nothing
            self._send(ABORT, ids)

    def add_first_token(self, first: FirstToken) -> None:
        self._send(FIRST_TOKEN, first)

    def get_output(self) -> EngineCoreOutputs:
        return self._take(self._outputs, self._outputs.get())

    def get_stats(self) -> EngineStats:
        """A stats snapshot; TimeoutError when the core sends none within STATS_TIMEOUT_S (a
        frozen core), EngineDeadError once it is dead or shut down (a waiting caller too)."""
        self._send(GET_STATS, None)
        try:
            item = self._stats.get(timeout=STATS_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"the engine core sent no stats in {STATS_TIMEOUT_S:.0f} s") from None
        return self._take(self._stats, item)

    def shutdown(self) -> None:
        """Asks the child to stop, then terminates it if needed; closes sockets, removes files.
        Anyone still waiting for outputs or stats gets EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._dead is None:
            self._notify(EngineDeadError("the engine core client is shut down"))
        if self.proc.is_alive():
            try:
                with self._send_lock:
                    self._input.send_multipart(self._codec.encode(SHUTDOWN), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _send(self, kind: bytes, payload: Any) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")
        with self._send_lock:
            self._input.send_multipart(self._codec.encode(kind, payload))

    def _wait_ready(self, timeout_s: float) -> ReadyInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(POLL_MS):
                kind, payload = self._codec.decode(self._output.recv_multipart())
                if kind == READY:
                    return payload
                if kind == FAILED:
                    raise _startup_error(payload)
            elif not self.proc.is_alive():
                raise RuntimeError(f"engine core process exited with code {self.proc.exitcode} "
                                   f"while starting")
        raise TimeoutError(f"engine core did not start within {timeout_s:.0f} s")

    def liveness(self) -> CoreLiveness:
        now = time.monotonic()
        step_s, at = self._step
        return CoreLiveness(now - self._heard, step_s + (now - at) if step_s > 0 else 0.0)

    def kill(self) -> None:
        if self.proc.is_alive():
            logger.error("killing engine core process %s", self.proc.pid)
            self.proc.kill()

    def _read_outputs(self) -> None:
        while not self._closing.is_set():
            if self._output.poll(POLL_MS):
                kind, payload = self._codec.decode(self._output.recv_multipart())
                self._heard = time.monotonic()
                if kind == HEARTBEAT:
                    self._step = (payload, self._heard)
                elif kind == OUTPUTS:
                    self._deliver(self._outputs, payload)
                elif kind == STATS:
                    self._stats.put(payload)
                elif kind == FAILED:
                    self._die(f"engine core failed: {payload.error_type}: {payload.message}")
                    return
            elif not self.proc.is_alive() and not self._closing.is_set():
                self._die(f"engine core process died (exit code {self.proc.exitcode})")
                return

    def _take(self, q: queue.Queue[Any], item: Any) -> Any:
        """The item, or raises when it is the death notice (left in place for the next caller)."""
        if isinstance(item, EngineDeadError):
            self._deliver(q, item)
            raise item
        return item

    def _die(self, message: str) -> None:
        logger.error(message)
        self._notify(EngineDeadError(message))

    def _notify(self, dead: EngineDeadError) -> None:
        self._dead = dead
        self._stats.put(dead)
        self._deliver(self._outputs, dead)

    def _deliver(self, q: queue.Queue[Any], item: Any) -> None:
        q.put(item)
        loop, event = self._notify_loop, self._notify_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(event.set)


class SyncMPClient(MPClient):
    """Blocking use of a core process (the offline `LLM` on a separate process)."""


class AsyncMPClient(MPClient):
    """asyncio use of a core process (AsyncLLM): outputs are awaited, sends never block."""

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        event = self._bind_loop()
        while True:
            try:
                return self._take(self._outputs, self._outputs.get_nowait())
            except queue.Empty:
                pass
            event.clear()
            if self._outputs.empty():
                await event.wait()

    async def get_stats_async(self) -> EngineStats:
        return await asyncio.to_thread(self.get_stats)

    def _bind_loop(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._notify_loop is not loop or self._notify_event is None:
            self._notify_event = asyncio.Event()
            self._notify_loop = loop
        return self._notify_event


def _startup_error(failure: CoreFailure) -> Exception:
    message = f"engine core failed to start: {failure.message}"
    return ValueError(message) if failure.error_type == "ValueError" else RuntimeError(message)

