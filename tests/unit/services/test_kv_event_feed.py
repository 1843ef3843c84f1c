"""The router's precise prefix index (services/router/dispatch/kv_events.py) against the engine's
real publisher (engine/kv_events/publisher.py) over loopback ZMQ: joining mid-stream, a lost
last batch, an engine restart, and the pool's fallback to the approximate index."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_events.publisher import ZmqEventPublisher
from protos import worker_pb2 as pb
from services.procs import free_port
from services.router.dispatch.kv_events import KVEventFeed, subscriber_address
from services.router.dispatch.pool import PoolOptions, WorkerPool

BS = 4


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _stored(*ids: int) -> BlockStored:
    return BlockStored(block_hashes=[_h(i) for i in ids], parent_block_hash=None,
                       token_ids=list(range(BS * len(ids))), block_size=BS, lora_id=None,
                       medium="CPU", lora_name=None)


def _publisher(pub: int, replay: int) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub}", bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv-events"))


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _caught_up(feed: KVEventFeed, published: int, timeout_s: float = 5.0) -> None:
    """As the pool does on each load report: says how many batches were published until the
    feed has them all (a batch sent before its SUB socket joined comes back by replay)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while feed.index.last_seq + 1 < published:
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        feed.reported(published)
        await asyncio.sleep(0.1)


async def test_a_feed_joining_mid_stream_replays_from_the_start_and_tracks_the_cache() -> None:
    pub, replay = free_port(), free_port()
    publisher = _publisher(pub, replay)
    feed = KVEventFeed("w", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "kv-events")
    try:
        publisher.publish([AllBlocksCleared()])
        publisher.publish([_stored(1, 2, 3)])  # before the feed joins: replayed
        await _until(lambda: len(publisher._buffer) == 2)  # (sent)
        feed.start()
        await asyncio.sleep(0.3)  # (the SUB socket connects)
        publisher.publish([BlockRemoved(block_hashes=[_h(3)], medium="CPU"), _stored(4)])
        await _caught_up(feed, 3)
        assert feed.index.exact
        assert feed.index.blocks == {_h(1), _h(2), _h(4)}
        assert feed.index.match([_h(1), _h(2), _h(3)], BS) == 2 * BS
    finally:
        await feed.close()
        publisher.shutdown()


async def test_a_lost_last_batch_is_fetched_once_a_report_shows_it() -> None:
    pub, replay = free_port(), free_port()
    publisher = _publisher(pub, replay)
    feed = KVEventFeed("w", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "kv-events")
    try:
        feed.start()
        await asyncio.sleep(0.3)
        publisher.publish([AllBlocksCleared()])
        await _caught_up(feed, 1)
        # the feed misses seq 1 (as if the PUB socket dropped it): close its subscription
        await feed.close()
        publisher.publish([_stored(7)])
        await _until(lambda: len(publisher._buffer) == 2)  # (sent)
        feed.start()
        await asyncio.sleep(0.3)
        feed.reported(2)  # a report: 2 published, the feed has 1: maybe still on its way
        assert not feed.index.exact
        await asyncio.sleep(0.05)
        feed.reported(2)  # still behind at the next report: lost, asked for by replay
        await _until(lambda: feed.index.last_seq == 1)
        assert feed.index.exact and feed.index.blocks == {_h(7)}
    finally:
        await feed.close()
        publisher.shutdown()


async def test_an_engine_restart_starts_the_index_over() -> None:
    pub, replay = free_port(), free_port()
    publisher = _publisher(pub, replay)
    feed = KVEventFeed("w", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "kv-events")
    try:
        feed.start()
        await asyncio.sleep(0.3)
        for batch in ([AllBlocksCleared()], [_stored(1)], [_stored(2)], [_stored(3)]):
            publisher.publish(batch)
        await _caught_up(feed, 4)
        publisher.shutdown()
        publisher = _publisher(pub, replay)  # the engine restarted: sequences from 0 again
        publisher.publish([AllBlocksCleared()])
        for _ in range(40):  # until the SUB socket has reconnected and seen one
            publisher.publish([_stored(9)])
            await asyncio.sleep(0.25)
            if feed.index.blocks == {_h(9)}:
                break
        assert feed.index.blocks == {_h(9)}
        assert feed.index.exact
    finally:
        await feed.close()
        publisher.shutdown()


async def test_the_pool_scores_on_events_and_falls_back_without_them() -> None:
    pool = WorkerPool("decode", ["127.0.0.1:1", "127.0.0.1:2"], PoolOptions(block_size=BS))
    a, b = pool.workers
    pub, replay = free_port(), free_port()
    publisher = _publisher(pub, replay)
    try:
        for w in (a, b):
            w.load = pb.LoadReport(serving=True, num_total_blocks=100, num_free_blocks=100)
        report = pb.LoadReport(serving=True, num_total_blocks=100, num_free_blocks=100,
                               kv_events_endpoint=f"tcp://0.0.0.0:{pub}",
                               kv_events_replay_endpoint=f"tcp://0.0.0.0:{replay}",
                               kv_events_topic="kv-events")
        pool._follow_events(a, report)
        assert a.feed is not None and a.feed.endpoint == f"tcp://127.0.0.1:{pub}"
        await asyncio.sleep(0.3)
        publisher.publish([AllBlocksCleared()])
        publisher.publish([_stored(1, 2)])
        assert a.feed is not None
        await _caught_up(a.feed, 2)
        hashes = [_h(1), _h(2), _h(5)]
        # b was sent this prompt (approximate: it likely holds it); a's events say a holds it
        pool.acquire(b, hashes)
        assert a.exact and a.match(hashes, BS) == 2 * BS
        assert not b.exact and b.match(hashes, BS) == 3 * BS
        # a evicts it: its events say so at once, where an approximate index would not know
        publisher.publish([BlockRemoved(block_hashes=[_h(1)], medium="CPU")])
        await _caught_up(a.feed, 3)
        assert a.match(hashes, BS) == 0
        # a report without events (its engine is down, or it stopped publishing): the feed goes,
        # the approximate index scores it
        pool._follow_events(a, pb.LoadReport(serving=False))
        assert a.feed is None and not a.exact
        await asyncio.sleep(0.1)  # (the old feed's close runs)
    finally:
        await pool.close()
        publisher.shutdown()


@pytest.mark.parametrize(("reported", "target", "expected"), [
    ("tcp://0.0.0.0:5557", "10.1.2.3:50051", "tcp://10.1.2.3:5557"),
    ("tcp://*:5557", "worker-0:50051", "tcp://worker-0:5557"),
    ("tcp://127.0.0.1:5557", "10.1.2.3:50051", "tcp://127.0.0.1:5557"),
    ("ipc:///tmp/ev", "10.1.2.3:50051", "ipc:///tmp/ev"),
])
def test_subscriber_address(reported: str, target: str, expected: str) -> None:
    assert subscriber_address(reported, target) == expected


def _payload(*events: object) -> bytes:
    import msgspec

    from engine.kv_events.events import KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events)))


async def test_a_batch_a_replay_applied_first_is_skipped_and_a_sequence_going_back_restarts() -> None:
    """A catch-up may apply batches the SUB socket still holds: they arrive later as duplicates,
    not as a restart. The SUB stream's own sequence going back is one."""
    feed = KVEventFeed("w", "tcp://127.0.0.1:1", "", "kv-events")
    await feed._on_batch(0, _payload(AllBlocksCleared()))
    await feed._on_batch(1, _payload(_stored(1)))
    for seq, event in ((2, _stored(2)), (3, _stored(3))):  # as a catch-up's replay applies them
        feed._apply(seq, _payload(event))
    await feed._on_batch(2, _payload(_stored(2)))  # the SUB socket's copies, late
    await feed._on_batch(3, _payload(_stored(3)))
    assert feed.index.exact and feed.index.blocks == {_h(1), _h(2), _h(3)}
    assert feed.index.last_seq == 3
    await feed._on_batch(0, _payload(AllBlocksCleared()))  # the engine restarted
    assert feed.index.exact and feed.index.blocks == set() and feed.index.last_seq == 0


async def test_a_report_naming_a_new_publisher_starts_the_index_over() -> None:
    feed = KVEventFeed("w", "tcp://127.0.0.1:1", "", "kv-events")
    feed.reported(0, "first")
    await feed._on_batch(0, _payload(AllBlocksCleared()))
    await feed._on_batch(1, _payload(_stored(1)))
    feed.reported(2, "first")
    assert feed.index.exact
    feed.reported(5, "second")  # restarted, its first batches not seen yet
    assert not feed.index.exact and feed.index.blocks == set() and feed.index.last_seq == -1
