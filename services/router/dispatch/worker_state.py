"""One worker as the router's pool sees it: its last load report, the requests sent to it, and
what it is known (KV events) or likely (the approximate index) to hold in its prefix cache."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protos import worker_pb2 as pb
from services.router.dispatch.kv_events import KVEventFeed
from services.router.dispatch.prefix_index import PrefixIndex
from services.worker.client import WorkerClient


def load_score(load: pb.LoadReport) -> int:
    return int(load.num_waiting) * 4 + int(load.num_running)


@dataclass
class WorkerState:
    client: WorkerClient
    prefix: PrefixIndex
    healthy: bool = True  # optimistic until the first report says otherwise
    draining: bool = False  # gets no new requests; removed once its in-flight ones ended
    load: pb.LoadReport | None = None
    sent_since_report: int = 0
    inflight: int = 0  # router-side: dispatched and not finished
    requests: int = 0  # dispatched in all
    failures: int = 0
    missed_reports: int = 0  # load reports in a row that failed or came late
    last_error: str = ""
    instance: str = ""  # the worker process's instance id, from its reports
    reported_at: float = -math.inf  # monotonic time of its last load report
    # What the last report may have counted: every request dispatched before it arrived (a
    # lease carries its dispatch number; the worker computes the report at some moment between
    # the ask and the answer), and the KV tokens of those that ended after it was asked for.
    counted_upto: int = 0
    freed_since_report: int = 0
    asking: bool = False  # a report is in flight
    freed_since_ask: int = 0
    feed: KVEventFeed | None = None  # its KV cache events, when it publishes them

    @property
    def exact(self) -> bool:
        """Whether its prefix matches come from its own KV events (else the approximate index)."""
        return self.feed is not None and self.feed.index.exact

    def match(self, hashes: Sequence[bytes], block_size: int) -> int:
        """Prompt tokens, from the first, it holds (exact) or likely holds (approximate)."""
        if self.feed is not None and self.feed.index.exact:
            return self.feed.index.match(hashes, block_size)
        return self.prefix.match(hashes)

    def forget_cache(self) -> None:
        """It restarted or went down: what the approximate index knew of its cache is gone (its
        KV events say for themselves when its engine restarted: dispatch/kv_events.py)."""
        self.prefix.clear()

    def held_tokens(self, block_size: int, prompt_tokens: int) -> int:
        """Work the worker holds, in tokens: its KV blocks in use, and a prompt's worth for each
        request queued there or sent since its last report (those hold no blocks yet). Requests
        the last report counted that have ended since are taken off: a report taken while one
        request ran would otherwise make an idle worker look busy until the next report, and
        send the next request sharing its prefix elsewhere."""
        load = self.load
        reported = 0
        if load is not None:
            # in tokens of every layer: a hybrid model's blocks are pages of some of its layers
            share = float(load.block_layer_share) or 1.0
            used = round((int(load.num_total_blocks) - int(load.num_free_blocks)) * block_size * share)
            reported = max(0, used + int(load.num_waiting) * prompt_tokens - self.freed_since_report)
        return reported + self.unreported * prompt_tokens

    @property
    def target(self) -> str:
        return self.client.target

    @property
    def tp_size(self) -> int:
        """Its engine's tensor-parallel size, from its last report (1 before one, or from an older
        worker)."""
        reported = int(self.load.tensor_parallel_size) if self.load is not None else 0
        return reported or 1

    @property
    def unreported(self) -> int:
        """Requests sent since the last load report that are still in flight (at most): the
        ones that already finished must not count, or a late report would let the estimate grow
        without bound under a fast stream of short requests."""
        return min(self.sent_since_report, self.inflight)

    @property
    def score(self) -> float:
        reported = load_score(self.load) if self.load is not None else 0
        return reported + self.unreported

    @property
    def waiting(self) -> int:
        """Requests likely queued on the worker: reported waiting plus those sent since."""
        return (int(self.load.num_waiting) if self.load is not None else 0) + self.unreported
