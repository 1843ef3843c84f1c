"""The tensor-parallel group of one engine: this process's rank, the number of ranks, and the
collectives of a sharded forward.

    tp = TensorParallel.init(rank, size, "/tmp/pdserve-tp-x/rendezvous", timeout_s=60)
    out = tp.all_reduce(partial)            # row-parallel projection: sum of every rank's part
    logits = tp.gather_vocab(local, 49152)  # every rank's vocab shard, side by side

A group is a gloo process group of its own over a file rendezvous (not torch.distributed's
process-wide default group: one process may hold several engines, each with its ranks). `SINGLE`
is the group of one (no collectives). A collective waits at most `timeout_s` for the other ranks
(gloo raises past it), so a rank that hangs fails the step instead of hanging the engine forever.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommClock:
    """Time this rank spent in collectives (waiting for the other ranks included), and how many."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    clock: CommClock = field(default_factory=CommClock, compare=False, repr=False)

    def _run(self, collective: Callable[[], Any]) -> None:
        start = time.perf_counter()
        collective().wait()
        self.clock.seconds += time.perf_counter() - start
        self.clock.calls += 1

    @staticmethod
    def init(rank: int, size: int, rendezvous: str, timeout_s: float) -> TensorParallel:
        """Joins this process to the group (every rank calls it; it returns once all joined)."""
        if size == 1:
            return TensorParallel()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of an engine share a host
        store = dist.FileStore(rendezvous, size)
        # joining waits for ranks still starting (spawn, import torch: seconds on a busy host);
        # the collectives then wait `timeout_s`
        join = datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        group = dist.ProcessGroupGloo(store, rank, size, join)
        group.set_timeout(datetime.timedelta(seconds=timeout_s))
        return TensorParallel(rank, size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place."""
        if self.size > 1:
            self._run(lambda: self.group.allreduce([x]))
        return x

    def sync_layer(self, layer: int) -> None:
        """Every rank waits here until rank 0 arrives (a one-element broadcast from it)."""
        self._run(lambda: self.group.broadcast(torch.zeros(1), 0))

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """`[n, vocab_size]`: every rank's `[n, shard]` columns in rank order, the padding of the
        last shard cut off."""
        if self.size == 1:
            return local[:, :vocab_size] if local.shape[1] != vocab_size else local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self._run(lambda: self.group.allgather([parts], [local.contiguous()]))
        return torch.cat(parts, dim=1)[:, :vocab_size]


def then(first: Callable[[int], None], second: Callable[[int], None] | None) -> Callable[[int], None]:
    """`first(layer)`, then `second(layer)` (where given)."""
    if second is None:
        return first

    def both(layer: int) -> None:
        first(layer)
        second(layer)

    return both


SINGLE = TensorParallel()
JOIN_TIMEOUT_S = 120.0  # how long the ranks take to meet at start
