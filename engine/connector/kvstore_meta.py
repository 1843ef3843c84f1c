"""Plain messages of the KV store connector: what to load and save in one step (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadSpec:
    """Fill token positions [start, end) of a request from the store's chunk objects."""

    req_id: str
    chunk_keys: list[str]  # CacheEngineKey strings, one per chunk (the layer is appended)
    start: int
    end: int
    token_digests: list[bytes] = field(default_factory=list)  # per chunk: what checksums bind
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    # per KV cache group, where its load starts (>= start: a windowed group's first token in
    # the window of the first token computed here); empty: `start` for every group
    group_starts: list[int] = field(default_factory=list)
    layerwise: bool = False  # loaded inside the step that computes the rest (forward waits per layer)
    # > 0: the producer is still saving (an early hand-off): objects not in the store yet are
    # asked for again (every await_poll_s, or longer) until at most await_s after the first token
    await_s: float = 0.0
    await_poll_s: float = 0.05


@dataclass
class SaveSpec:
    """Save chunks of a request's prompt: (chunk index, first token, end token) each."""

    req_id: str
    chunk_keys: list[str]
    chunks: list[tuple[int, int, int]]
    block_ids: list[list[int]]  # per KV cache group
    token_digests: list[bytes] = field(default_factory=list)  # per chunk (keys.py)


@dataclass
class KVStoreConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # requests whose awaiting loads stop
    hurries: list[str] = field(default_factory=list)  # awaiting loads whose producer is done
