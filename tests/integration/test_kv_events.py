"""KV cache events from the engine, read by a subscriber written as vLLM's documented example
(examples/online_serving/kv_events_subscriber.py) reads them: its own msgspec types, a SUB socket
on the topic, a REQ socket for replay."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import zmq

from engine.core.kv_cache_manager import block_hashes_for
from engine.sampling_params import SamplingParams
from services.procs import free_port

# --- the subscriber's side: vLLM's documented types, written out as the example does ----------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """The example's loop: SUB on the topic, replay from the first missed sequence on a gap."""

    def __init__(self, pub: str, replay: str, topic: str = "kv-events") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_address = replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq = -1
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.replayed = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The example's request (8 bytes, big-endian) from a DEALER socket: a REQ socket takes
        one reply per request, so it would see only the first replayed batch."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_address)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while dealer.poll(2000):
            _, seq_bytes, payload = dealer.recv_multipart()
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            out.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(linger=0)
        return out

    def drain(self, quiet_s: float = 0.5) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:  # missed some (at the start: the ones before we joined)
                for rseq, rpayload in self.replay(self.last_seq + 1):
                    if self.last_seq < rseq < seq:
                        self.batches.append((rseq, self.decoder.decode(rpayload)))
                        self.last_seq = rseq
                        self.replayed += 1
            self.batches.append((seq, self.decoder.decode(payload)))
            self.last_seq = seq

    def events(self) -> list[Any]:
        return [e for _, b in self.batches for e in b.events]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Any:
    from engine.llm import LLM

    pub, replay = free_port(), free_port()
    llm = LLM(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=256, num_kv_blocks=20,
              block_size=BLOCK, dtype="float32",
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://127.0.0.1:{pub}", "bind": True,
                                "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"})
    yield llm, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    llm.engine_core.shutdown()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 5000 + 10 for i in range(n)]


def test_a_vllm_subscriber_decodes_stores_removals_and_replays(engine: Any) -> None:
    llm, pub, replay = engine
    sub = Subscriber(pub, replay)
    try:
        time.sleep(0.3)  # (the SUB socket joins; anything it misses comes back by replay)
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        first = _prompt(1, 40)  # two full blocks, then 8 tokens
        llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
        sub.drain()
        stored = [e for e in sub.events() if isinstance(e, BlockStored)]
        assert stored, sub.events()
        assert stored[0].token_ids == first[:2 * BLOCK]
        assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK
        assert stored[0].block_hashes == block_hashes_for(first, BLOCK)
        assert stored[0].medium == "CPU"

        # 19 usable blocks: prompts of 3 full blocks each evict the first prompt's blocks
        for seed in range(2, 10):
            llm.generate([{"prompt_token_ids": _prompt(seed, 3 * BLOCK + 5)}], greedy, use_tqdm=False)
        sub.drain()
        live: set[Any] = set()
        removed_first = set()
        for event in sub.events():
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK
                assert not live & set(event.block_hashes), "stored twice without a removal"
                live |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= live, "removed a block never stored"
                live -= set(event.block_hashes)
                removed_first |= set(event.block_hashes) & set(stored[0].block_hashes)
            else:
                live.clear()
        assert removed_first == set(stored[0].block_hashes)
        # what the subscriber holds is what the engine's cache can hit
        pool = llm.engine_core.kv_cache_manager.block_pool
        assert live == set(pool.cached_block_hash_to_block)

        seqs = [s for s, _ in sub.batches]
        assert seqs == list(range(len(seqs))), seqs  # from 0, no gaps (with replay at the start)
        assert isinstance(sub.batches[0][1].events[0], AllBlocksCleared)

        # a replay from any kept sequence returns exactly what was published from there
        again = sub.replay(3)
        assert [s for s, _ in again] == seqs[3:]
        decoded = [sub.decoder.decode(p) for _, p in again]
        assert [b.events for b in decoded] == [b.events for _, b in sub.batches[3:]]
    finally:
        sub.close()


def test_reset_prefix_cache_is_all_blocks_cleared(engine: Any) -> None:
    llm, pub, replay = engine
    sub = Subscriber(pub, replay)
    try:
        time.sleep(0.3)
        assert llm.engine_core.reset_prefix_cache()
        sub.drain()
        assert isinstance(sub.events()[-1], AllBlocksCleared)
    finally:
        sub.close()


def test_newer_vllm_types_decode_the_same_batches(engine: Any) -> None:
    """vLLM's current types add lora_name, extra_keys, group_idx, ...: a batch decodes with them."""
    from engine.kv_events.events import KVEventBatch as Current

    _llm, pub, replay = engine
    sub = Subscriber(pub, replay)
    try:
        payloads = sub.replay(0)
        assert payloads
        for _, payload in payloads:
            batch = msgspec.msgpack.Decoder(type=Current).decode(payload)
            assert batch.ts > 0
    finally:
        sub.close()


def test_bad_configs_are_refused_naming_the_key(tiny_model_dir: Callable[[str], Path]) -> None:
    from engine.config import EngineConfig

    bad: Any
    for bad, key in (({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
                     ({"endpoint": "localhost:5557"}, "endpoint"),
                     ({"buffer_steps": 0}, "buffer_steps"),
                     ({"topc": "x"}, "topc")):
        with pytest.raises(ValueError, match=f"kv_events_config.{key}"):
            EngineConfig(model=str(tiny_model_dir("llama")), kv_events_config=bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(model=str(tiny_model_dir("llama")), kv_events_config=cast(Any, "{oops"))
