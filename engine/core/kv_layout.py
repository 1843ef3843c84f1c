"""How a model's layers share the KV cache's blocks (pure Python, no tensors).

A model whose layers all attend the same way (all full, or all with a window) has one KV cache
group: one block id holds `block_size` tokens of every layer, and a request has one block table.

A hybrid model (Gemma 2/3, Qwen2 with `max_window_layers`: some layers full, some with a sliding
window) has several groups, as vLLM's hybrid allocator does, so the windowed layers can give back
the blocks their window has left while the full layers keep theirs. Every group holds the same
number of layers, `layers_per_block` (the fewest layers of one kind; a kind's last group may be
short of it): a block id is a page of `layers_per_block` layer-slices, and all groups share one
pool of such pages. The cache is `layers_per_block` tensors of `[num_blocks, 2, block_size,
kv_heads, head_dim]`; layer `i` lives in tensor `layer_slot[i]`, and its group's block table says
which pages are its own. A request has one block table per group.

Gemma 3 270M (18 layers: 15 with a 512-token window, 3 full) has 6 groups of 3 layers: 5 windowed
and 1 full; a long request holds about `3 * window / block_size` windowed pages beside the full
group's pages for its whole length, instead of 18 layers' worth of every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose KV live in the same pages of a request; `window` None: kept whole."""

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # layer-slices in one page (block id)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: which of the `layers_per_block` tensors holds it

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: the group's blocks are kept for the whole request)."""
        return tuple(g.window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def blocks_for_one_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once: every block in a
        kept group; in a windowed group the window's blocks plus one step's new tokens."""
        full = -(-num_tokens // block_size)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += full
            else:
                total += min(full, -(-(group.window - 1 + max_step_tokens) // block_size) + 1)
        return total


def single_group(num_layers: int, window: int | None = None) -> KVCacheLayout:
    """Every layer in one group (a block holds all layers): the layout of non-hybrid models, and
    of any model whose blocks are never freed."""
    layers = tuple(range(num_layers))
    return KVCacheLayout((KVCacheGroup(layers, window),), num_layers, (0,) * num_layers, layers)


def make_layout(windows: Sequence[int | None], free_windowed: bool) -> KVCacheLayout:
    """The layout for layers with these sliding windows (None: full attention).

    `free_windowed` False (a producer saving the prompt keeps every block): one group, kept.
    Every layer windowed: one group with the largest window. Otherwise one group per
    `layers_per_block` layers of each kind (full, or each distinct window), in layer order."""
    num_layers = len(windows)
    if num_layers == 0:
        raise ValueError("a model needs at least one layer")
    if not free_windowed or all(w is None for w in windows):
        return single_group(num_layers)
    if all(w is not None for w in windows):
        return single_group(num_layers, max(w for w in windows if w is not None))
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    per_block = min(len(layers) for layers in kinds.values())
    groups: list[KVCacheGroup] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for window, layers in kinds.items():
        for start in range(0, len(layers), per_block):
            members = tuple(layers[start:start + per_block])
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(KVCacheGroup(members, window))
    return KVCacheLayout(tuple(groups), per_block, tuple(layer_group), tuple(layer_slot))
