"""How a model's layers share KV blocks: one group unless the model is hybrid and frees its
windowed layers' blocks; a hybrid model's groups hold equally many layers (vLLM's rule)."""

from __future__ import annotations

import pytest

from engine.core.kv_layout import make_layout, single_group

W = 512


def gemma3_windows(num_layers: int, pattern: int = 6) -> list[int | None]:
    return [None if (i + 1) % pattern == 0 else W for i in range(num_layers)]


def test_gemma3_270m_is_six_groups_of_three_layers() -> None:
    layout = make_layout(gemma3_windows(18), free_windowed=True)
    assert layout.layers_per_block == 3 and layout.num_groups == 6 and layout.is_hybrid
    assert layout.windows == (W, W, W, W, W, None)
    assert layout.groups[5].layers == (5, 11, 17)
    assert layout.groups[0].layers == (0, 1, 2) and layout.groups[1].layers == (3, 4, 6)
    assert layout.groups[4].layers == (14, 15, 16)
    # every (group, slot) pair is one layer's: no two layers share a page slice
    pairs = set(zip(layout.layer_group, layout.layer_slot, strict=True))
    assert len(pairs) == 18 and max(layout.layer_slot) == 2
    for g, group in enumerate(layout.groups):
        assert all(layout.layer_group[i] == g for i in group.layers)


def test_an_uneven_kind_leaves_its_last_group_short() -> None:
    layout = make_layout(gemma3_windows(26), free_windowed=True)  # Gemma 3 1B: 4 global, 22 local
    assert layout.layers_per_block == 4
    sizes = [(len(g.layers), g.window) for g in layout.groups]
    assert sizes == [(4, W)] * 5 + [(2, W), (4, None)]


def test_gemma2_alternating_layers_are_two_groups() -> None:
    layout = make_layout([W if i % 2 == 0 else None for i in range(26)], free_windowed=True)
    assert layout.layers_per_block == 13 and layout.windows == (W, None)


def test_one_group_when_nothing_is_freed_or_every_layer_is_alike() -> None:
    assert make_layout(gemma3_windows(18), free_windowed=False) == single_group(18)
    assert make_layout([None] * 4, free_windowed=True) == single_group(4)
    layout = make_layout([24, 16, 24], free_windowed=True)  # every layer windowed: the largest
    assert layout.windows == (24,) and layout.layers_per_block == 3
    with pytest.raises(ValueError, match="at least one layer"):
        make_layout([], free_windowed=True)


def test_blocks_for_one_request_counts_windows_and_one_step() -> None:
    layout = make_layout(gemma3_windows(18), free_windowed=True)
    # 4096 tokens of 16: the full group all 256 blocks; a windowed one its 511 keys plus 64 new
    # tokens: ceil(574 / 16) + 1 = 37 each
    assert layout.blocks_for_one_request(4096, 16, 64) == 256 + 5 * 37
    assert layout.blocks_for_one_request(100, 16, 64) == 6 * 7  # shorter than a window: all
    assert single_group(18).blocks_for_one_request(4096, 16, 64) == 256
