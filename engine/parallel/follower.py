"""A tensor-parallel rank other than 0: its own process, its shard of the model and of the KV
cache, the same forward as rank 0 every step (it takes part in every collective), no sampling.

It dies with rank 0's process (PR_SET_PDEATHSIG), and leaves when rank 0 says so or is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
from typing import Any

from engine.config import EngineConfig
from engine.parallel.channel import ChannelClosed, StepReader

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def follower_main(config: EngineConfig, rank: int, rendezvous: str, reader: StepReader,
                  built: Any) -> None:
    """`built`: a semaphore this rank releases once its runner is built (rank 0 says the engine
    is ready once every rank has)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the group; rank 0 stops it
    parent = multiprocessing.parent_process()
    if parent is None or not parent.is_alive():
        os._exit(1)
    import torch

    from engine.attention.selector import backend_for_device
    from engine.engine_core import DTYPES, eos_token_id_of, kv_layout
    from engine.model.loader import load_model, resolve_model_path
    from engine.parallel.group import TensorParallel
    from engine.runner import ModelRunner

    torch.set_num_threads(threads_per_rank(config))
    torch.manual_seed(config.seed)
    tp = TensorParallel.init(rank, config.tensor_parallel_size, rendezvous, config.tp_timeout_s)
    try:  # a collective that fails (rank 0 died in the middle of one) raises: this rank exits
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        model, hf_config = load_model(resolve_model_path(config.model), dtype,
                                      backend_for_device(device, config.attention_backend), device, tp)
        start = reader.recv(parent.is_alive)
        config = config.resolved(start.max_model_len)
        # this rank's cache: the shared memory rank 0 made for it (rank 0's connector moves it)
        fd = os.open(f"/proc/{parent.pid}/fd/{start.kv_cache_fds[rank - 1]}", os.O_RDWR)
        runner = ModelRunner(model, config.block_size, start.num_kv_blocks, config.max_num_seqs,
                             config.model_len, config.max_num_batched_tokens, dtype, device,
                             eos_token_id_of(hf_config), config.seed, kv_layout(model, config),
                             kv_cache_fd=fd)
        os.close(fd)  # (the mapping keeps its own)
        runner.samples = False
        built.release()
        while True:
            message = reader.recv(parent.is_alive)
            if message.shutdown or message.scheduler_output is None:
                break
            runner.append_sampled(message.sampled)
            runner.layer_sync = tp.sync_layer if message.layer_sync else None
            runner.execute_model(message.scheduler_output)
    except ChannelClosed:
        logger.warning("tensor-parallel rank %d: rank 0 is gone; exiting", rank)


def threads_per_rank(config: EngineConfig) -> int:
    """`num_threads`, else the CPUs this process may run on shared out between the ranks."""
    if config.num_threads is not None:
        return config.num_threads
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this worker may use (pinned: fewer)
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // config.tensor_parallel_size)
