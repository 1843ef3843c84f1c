"""A model whose every layer has a sliding window frees the blocks its requests' windows have
left (vLLM's sliding-window manager), with output still equal to transformers; a hybrid model
(Gemma 2/3, Qwen2 with max_window_layers: global layers among the local ones) frees its local
layers' blocks and keeps its global layers' (vLLM's hybrid allocator, engine/core/kv_layout.py);
a model without windows keeps every block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.core.kv_layout import KVCacheLayout
from engine.sampling_params import SamplingParams

PROMPT_LEN, MAX_NEW, BLOCK = 40, 120, 16


def _held_blocks_per_step(model_dir: Path, **kwargs: Any
                          ) -> tuple[list[int], list[int], Any, KVCacheLayout]:
    """Greedy output of one request, the blocks it held after each allocation, its prompt and
    the engine's KV cache layout."""
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), num_threads=1, block_size=BLOCK, **kwargs)
    kv = llm.engine_core.kv_cache_manager
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request: Any, *args: Any, **kw: Any) -> Any:
        out = allocate(request, *args, **kw)
        held.append(kv.num_held_blocks(request.request_id))
        return out

    kv.allocate_slots = recording
    prompt = list(range(300, 300 + PROMPT_LEN))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                       use_tqdm=False)[0]
    stats = llm.engine_core.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked
    return list(out.outputs[0].token_ids), held, prompt, llm.engine_core.kv_layout


def test_windowed_model_frees_blocks_behind_the_window(
        tiny_model_dir: Callable[[str], Path], hf_greedy: Callable[..., list[list[int]]]) -> None:
    path = tiny_model_dir("mistral_window")  # every layer: a window of 24 keys
    tokens, held, prompt, layout = _held_blocks_per_step(path)
    assert not layout.is_hybrid
    assert tokens == hf_greedy(path, [prompt], MAX_NEW)[0]
    total = -(-(PROMPT_LEN + MAX_NEW) // BLOCK)  # 10 blocks without freeing
    # at most the window's 24 positions plus the new token: 3 blocks of 16
    assert max(held[1:]) <= 3 < total
    assert held[0] == -(-PROMPT_LEN // BLOCK)  # the prompt's blocks, before its window moved


def test_small_cache_serves_long_windowed_requests_without_preemption(
        tiny_model_dir: Callable[[str], Path], hf_greedy: Callable[..., list[list[int]]]) -> None:
    """Twelve usable blocks: without freeing, four requests of 160 tokens (10 blocks each)
    would preempt one another; with freeing they run side by side."""
    from engine.llm import LLM

    path = tiny_model_dir("mistral_window")
    llm = LLM(model=str(path), num_threads=1, block_size=BLOCK, num_kv_blocks=13,
              max_model_len=512, max_num_batched_tokens=64)
    prompts = [list(range(400 + i, 400 + i + PROMPT_LEN)) for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    assert sum(o.metrics.num_preemptions for o in outs) == 0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2_window"])
def test_hybrid_model_frees_only_its_windowed_layers_blocks(
        arch: str, tiny_model_dir: Callable[[str], Path],
        hf_greedy: Callable[..., list[list[int]]]) -> None:
    """Gemma 2 (local, global), Gemma 3 (local, local, global) and Qwen2 (layer 0 full, layer 1
    windowed by max_window_layers) at a window of 24 keys: each windowed group holds only its
    window's blocks as a long generation passes the window, the full groups every block; in
    layer-slices of KV the request ends holding less than it would without freeing."""
    path = tiny_model_dir(arch)
    tokens, held, prompt, layout = _held_blocks_per_step(path)
    assert tokens == hf_greedy(path, [prompt], MAX_NEW)[0]
    assert layout.is_hybrid
    num_full = sum(1 for g in layout.groups if g.window is None)
    every = -(-(PROMPT_LEN + MAX_NEW - 1) // BLOCK)  # 10: every block of the request
    assert held[0] == layout.num_groups * -(-PROMPT_LEN // BLOCK)  # the prompt, before its window moved
    last = PROMPT_LEN + MAX_NEW - 2  # the last token computed
    window_blocks = [last // BLOCK - (last - g.window + 1) // BLOCK + 1
                     for g in layout.groups if g.window is not None]
    assert held[-1] == num_full * every + sum(window_blocks)  # the last token's window
    bound = sum(-(-g.window // BLOCK) + 1 for g in layout.groups if g.window is not None)
    assert max(held[1:]) <= num_full * every + bound
    num_layers = len(layout.layer_group)
    assert held[-1] * layout.layers_per_block < every * num_layers  # layer-slices held vs kept


def test_models_without_windows_keep_every_block(tiny_model_dir: Callable[[str], Path]) -> None:
    _, held, _, layout = _held_blocks_per_step(tiny_model_dir("mistral"))
    assert not layout.is_hybrid and layout.windows == (None,)
    assert max(held) == -(-(PROMPT_LEN + MAX_NEW - 1) // BLOCK)
