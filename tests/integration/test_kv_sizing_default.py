"""The CPU's default KV cache in a real engine, and what `pdserve up` tells its workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache_sizing import CPU_KVCACHE_SPACE_ENV, cpu_available_bytes, kv_cache_bytes_per_block


def test_an_engine_with_the_default_takes_its_share(monkeypatch: pytest.MonkeyPatch,
                                                    tiny_model_dir: Callable[[str], Path]) -> None:
    from engine.engine_core import EngineCore

    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    # the cap (2 requests of 256 tokens) is far below this host's share
    core = EngineCore(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256,
                                   max_num_seqs=2, dtype="float32"))
    try:
        assert core.num_blocks == 2 * 16 + 1
    finally:
        core.shutdown()
    # a share so small that it is below the cap: half of a ten-thousandth of free memory, in blocks
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256, max_num_seqs=64,
                          dtype="float32", cpu_kv_cache_share=0.5, kv_cache_sharers=10**4)
    core = EngineCore(config)
    try:
        model = core.runner.model
        per_block = kv_cache_bytes_per_block(model.num_layers, model.num_kv_heads, model.head_dim, 16,
                                             torch.float32)
        want = cpu_available_bytes() * 0.5 / 10**4 // per_block
        assert abs(core.num_blocks - want) <= max(2, want * 0.05)
    finally:
        core.shutdown()
    with pytest.raises(ValueError, match=r"kv_cache_sharers=10000000 holds [01] KV blocks"):
        EngineCore(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256,
                                dtype="float32", kv_cache_sharers=10**7))


@pytest.mark.parametrize("argv, want", [
    ([], 2), (["--prefill", "2", "--decode", "3"], 5), (["--colocated", "--decode", "2"], 2),
    (["--autoscale", "--max-prefill", "3", "--max-decode", "4"], 7),
])
def test_up_divides_the_share_among_the_workers_it_may_run(argv: list[str], want: int) -> None:
    from services.cli import build_parser
    from services.up.specs import kv_cache_sharers, worker_args

    args = build_parser().parse_args(["up", *argv])
    assert kv_cache_sharers(args) == want
    worker = worker_args(args, "/m", "grpc://127.0.0.1:1")
    assert worker[worker.index("--kv-cache-sharers") + 1] == str(want)
    sized = build_parser().parse_args(["up", *argv, "--kv-cache-gib", "2"])
    assert "--kv-cache-sharers" not in worker_args(sized, "/m", "grpc://127.0.0.1:1")
