"""The engine core in a process of its own (vLLM's EngineCoreProc).

Four threads: an input thread reads ZMQ messages into a queue, the main loop applies adds and
aborts then steps the core whenever it has work, an output thread encodes and sends outputs, and
a heartbeat thread says every HEARTBEAT_S how long the step under way has run (the front end's
watchdog: engine/core_client.py).
The front end binds both sockets; this process connects, loads the model, then says READY (or
FAILED with the error). It exits on SHUTDOWN, or when its parent process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason
from engine.engine_core import EngineCore
from engine.serial import (
    ABORT,
    ADD,
    FAILED,
    FIRST_TOKEN,
    GET_STATS,
    HEARTBEAT,
    HEARTBEAT_S,
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
_WAKE = b"wake"  # internal: from the core's own threads, never from the socket (a no-op)
_RANK_DIED = b"rank_died"  # internal: a tensor-parallel rank of this core exited



def run_engine_core(config_bytes: bytes, input_address: str, output_address: str) -> None:
    """Process entry point: `config_bytes` is the msgpack-encoded `EngineConfig`."""
    # The parent owns this process's life (shutdown message, then SIGTERM; a daemon child): a
    # terminal's Ctrl-C, sent to the whole process group, is the parent's to handle, not a
    # KeyboardInterrupt traceback in every engine core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
                            format="%(asctime)s %(levelname)s [engine-core] %(message)s")
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_address)
    codec = MessageCodec()
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        core = EngineCore(config)
    except Exception as e:
        logger.exception("engine core failed to start")
        output_socket.send_multipart(codec.encode(FAILED, CoreFailure(type(e).__name__, str(e))))
        _close(ctx, input_socket, output_socket, linger_ms=2000)
        raise SystemExit(1) from None
    stats = core.get_stats()
    ready = ReadyInfo(core.config.model_len, core.vocab_size, stats.num_total_blocks, stats)
    output_socket.send_multipart(codec.encode(READY, ready))
    try:
        EngineCoreProc(core, input_socket, output_socket, codec).run()
    finally:
        _close(ctx, input_socket, output_socket, linger_ms=2000)


class EngineCoreProc:
    """Busy loop around one EngineCore; sockets are owned by the input / output threads."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 codec: MessageCodec) -> None:
        self.core = core
        self.codec = codec
        self._input_socket = input_socket
        self._output_socket = output_socket
        self._inputs: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self._outputs: queue.Queue[tuple[bytes, Any] | None] = queue.Queue()
        self._stop = threading.Event()
        self._step_started: float | None = None  # monotonic time the step under way began
        # a KV load that finishes wakes a loop waiting for input (it steps again at once)
        core.set_wakeup(lambda: self._inputs.put((_WAKE, None)))
        # a tensor-parallel rank that dies stops this core (its front end restarts the engine)
        if core.tp_executor is not None:
            core.tp_executor.on_failure = lambda why: self._inputs.put((_RANK_DIED, why))

    def run(self) -> None:
        reader = threading.Thread(target=self._read_inputs, name="core-input", daemon=True)
        writer = threading.Thread(target=self._write_outputs, name="core-output", daemon=True)
        heart = threading.Thread(target=self._heartbeat, name="core-heartbeat", daemon=True)
        reader.start()
        writer.start()
        heart.start()
        try:
            self._loop()
        except Exception as e:
            logger.exception("engine core failed")
            self._outputs.put((FAILED, CoreFailure(type(e).__name__, str(e))))
            raise
        finally:
            self._stop.set()
            self._outputs.put(None)
            writer.join(timeout=5)
            reader.join(timeout=5)
            self.core.shutdown()

    def _loop(self) -> None:
        idle = False
        while True:
            # Nothing to run: wait for a message; only loads in flight (or grammars compiling):
            # wait for one at most the core's idle_wait_s, then step again to see what finished.
            timeout = self.core.idle_wait_s if idle else None
            if not self._handle_inputs(block=idle or not self.core.has_unfinished_requests(),
                                       timeout=timeout):
                return
            idle = False
            if self.core.has_unfinished_requests():
                self._step_started = time.monotonic()
                outputs = self.core.step(idle_sleep_s=0.0)
                self._step_started = None
                idle = self.core.last_step_idle
                if outputs.outputs:
                    self._outputs.put((OUTPUTS, outputs))

    def _handle_inputs(self, block: bool, timeout: float | None = None) -> bool:
        """Applies every queued message (waiting for one when `block`, at most `timeout`
        seconds when given); False on SHUTDOWN."""
        try:
            message = self._inputs.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return True
        while True:
            if not self._handle(*message):
                return False
            try:
                message = self._inputs.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: bytes, payload: Any) -> bool:
        if kind == ADD:
            try:
                self.core.add_request(payload)
            except Exception as e:  # the front end validates; a request never takes the core down
                logger.warning("request %s rejected: %r", payload.request_id, e)
                rejected = EngineCoreOutput(payload.request_id, [], finish_reason=FinishReason.ABORT,
                                            stop_reason=f"rejected: {e}")
                self._outputs.put((OUTPUTS, EngineCoreOutputs([rejected])))
        elif kind == ABORT:
            self.core.abort_requests(payload)
        elif kind == FIRST_TOKEN:
            self.core.add_first_token(payload)
        elif kind == GET_STATS:
            self._outputs.put((STATS, self.core.get_stats()))
        elif kind == SHUTDOWN:
            return False
        elif kind == _RANK_DIED:
            from engine.parallel.executor import RankFailed

            raise RankFailed(payload)
        return True

    def _read_inputs(self) -> None:
        parent = multiprocessing.parent_process()
        while not self._stop.is_set():
            if self._input_socket.poll(POLL_MS):
                frames = self._input_socket.recv_multipart(copy=False)
                self._inputs.put(self.codec.decode([f.bytes for f in frames]))
            elif parent is not None and not parent.is_alive():
                logger.warning("parent process is gone; engine core exits")
                self._inputs.put((SHUTDOWN, None))
                return

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            started = self._step_started
            self._outputs.put((HEARTBEAT, 0.0 if started is None else time.monotonic() - started))

    def _write_outputs(self) -> None:
        while True:
            item = self._outputs.get()
            if item is None:
                return
            self._output_socket.send_multipart(self.codec.encode(*item), copy=False)


def _close(ctx: zmq.Context, *sockets: zmq.Socket, linger_ms: int) -> None:
    for s in sockets:
        s.close(linger=linger_ms)
    ctx.term()
