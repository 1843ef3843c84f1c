"""Rank 0's side of a tensor-parallel engine (vLLM's MultiProcExecutor, in small): it starts the
other ranks, joins their process group, tells them the KV cache size, sends each step's
scheduler output before its own forward, and watches them.

A rank that dies makes `failure` say so and calls `on_failure(why)` (the engine-core process
stops on it: its front end sees the core die, fails the requests in flight with EngineDeadError
and the worker's guard builds a new engine, every rank anew); a rank that hangs leaves rank 0's
next collective waiting at most `tp_timeout_s`, which then fails the step the same way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from engine.kv_cache_sizing import mapped_caches, shared_cache_file
from engine.parallel.channel import StepChannel, StepMessage
from engine.parallel.follower import follower_main, threads_per_rank
from engine.parallel.group import TensorParallel
from engine.parallel.shard import kv_head_range
from engine.runner import ModelRunner

logger = logging.getLogger(__name__)
WATCH_S = 0.2
# how long rank 0 waits for the other ranks to load their shards and build their runners
BUILD_TIMEOUT_S = 600.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank of this engine died."""


class TPExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        size = config.tensor_parallel_size
        ctx = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        rendezvous = str(Path(self._dir) / "rendezvous")
        self.channel = StepChannel(ctx, size - 1)
        self._built = ctx.Semaphore(0)  # each other rank releases it once its runner is built
        self.procs = [ctx.Process(target=follower_main, name=f"pdserve-tp-rank{r}", daemon=True,
                                  args=(config, r, rendezvous, self.channel.reader(r - 1),
                                        self._built))
                      for r in range(1, size)]
        self.failure: str | None = None
        self._on_failure: Callable[[str], None] | None = None
        self.runner: ModelRunner | None = None
        self._fds: list[int] = []
        self._sampled: dict[str, list[int]] = {}
        self._closing = threading.Event()
        _start_children(self.procs)
        try:
            self.tp = TensorParallel.init(0, size, rendezvous, config.tp_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    @property
    def on_failure(self) -> Callable[[str], None] | None:
        return self._on_failure

    @on_failure.setter
    def on_failure(self, handler: Callable[[str], None] | None) -> None:
        """Called when a rank dies; at once when one already died (while the engine was built)."""
        self._on_failure = handler
        if handler is not None and self.failure is not None:
            handler(self.failure)

    def check(self) -> None:
        """RankFailed if a rank has died (the engine's build checks before it says it is ready)."""
        if self.failure is not None:
            raise RankFailed(self.failure)

    @staticmethod
    def threads(config: EngineConfig) -> int:
        return threads_per_rank(config)

    def start(self, runner: ModelRunner, max_model_len: int) -> list[list[torch.Tensor]]:
        """The other ranks build their runners for rank 0's cache size and context length, each
        cache in shared memory that rank 0 maps too. Returns every rank's caches per layer (rank
        0's first), for rank 0's KV connector."""
        self.runner = runner
        slots, dtype = runner.layout.layers_per_block, runner.kv_caches[0].dtype
        full = runner.model.shard.full  # type: ignore[attr-defined]
        caches = [runner.kv_caches]
        for rank in range(1, self.tp.size):  # each its own KV heads (an uneven split differs)
            heads = kv_head_range(full.num_kv_heads, self.tp.size, rank)[1]
            shape = (*runner.kv_caches[0].shape[:3], heads, runner.kv_caches[0].shape[4])
            fd = shared_cache_file(slots * math.prod(shape) * dtype.itemsize)
            self._fds.append(fd)
            mapped = mapped_caches(fd, slots, shape, dtype)
            caches.append([mapped[slot] for slot in runner.layout.layer_slot])
        self._send(StepMessage(num_kv_blocks=runner.num_blocks, max_model_len=max_model_len,
                               kv_cache_fds=self._fds))
        self._wait_built()
        return caches

    def _wait_built(self) -> None:
        """Until every other rank has built its runner (loading its shard may take long on a
        busy host: the start-up bound, not `tp_timeout_s`); RankFailed when one died first."""
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for _ in self.procs:
            while not self._built.acquire(timeout=WATCH_S):
                self.check()
                if time.monotonic() > deadline:
                    raise RankFailed(f"a tensor-parallel rank did not build its runner within "
                                     f"{BUILD_TIMEOUT_S:.0f} s")
        self.check()

    def before_step(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to the other ranks (with what rank 0 sampled in the step before)."""
        self.check()
        meta = scheduler_output.kv_connector_metadata
        sync = any(load.layerwise for load in getattr(meta, "loads", None) or [])
        so = replace(scheduler_output, kv_connector_metadata=None)
        self._send(StepMessage(scheduler_output=so, sampled=self._sampled, layer_sync=sync))
        self._sampled = {}
        if self.runner is not None:
            self.runner.layer_sync = self.tp.sync_layer if sync else None

    def after_step(self, output: ModelRunnerOutput) -> None:
        self._sampled = {r: t for r, t in zip(output.req_ids, output.sampled_token_ids, strict=True) if t}

    def _send(self, message: StepMessage) -> None:
        self.channel.send(message, self.config.tp_timeout_s)

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_S):
            dead = [p for p in self.procs if not p.is_alive()]
            if dead:
                self.failure = (f"tensor-parallel rank {self.procs.index(dead[0]) + 1} of "
                                f"{self.config.tensor_parallel_size} exited (code {dead[0].exitcode})")
                logger.error("%s; the engine stops", self.failure)
                if self._on_failure is not None:
                    self._on_failure(self.failure)
                return

    def shutdown(self) -> None:
        """Stops the other ranks (asked, then killed after a grace) and leaves the group."""
        self._closing.set()
        if all(p.is_alive() for p in self.procs) and self.procs:
            with contextlib.suppress(Exception):  # a rank that took no message: killed below
                self.channel.send(StepMessage(shutdown=True), timeout_s=2.0)
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutil.rmtree(self._dir, ignore_errors=True)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def _start_children(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Starts the rank processes, also from a daemonic process (an engine core started by its
    front end is one, and multiprocessing refuses children there): each rank dies with this
    process by PR_SET_PDEATHSIG (follower.py), which is what the daemon flag would give."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemonic = config.get("daemon", False)
    config["daemon"] = False
    try:
        for p in procs:
            p.start()
    finally:
        config["daemon"] = daemonic
