"""Project-wide test options: `slow` tests run only when asked, `gpu` tests only with CUDA."""

from __future__ import annotations

import os

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. The variable is read
# when a kernel is defined, so it is set here, before any test module imports kernels.
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

# dtype "auto" is bfloat16 on CPUs with AVX-512 BF16 (this project's CI machines have it), but
# the suite's references are float32: transformers token for token. Engines the tests build, in
# this process and in the workers they start, resolve "auto" to float32 unless a test says
# otherwise (tests/unit/engine/test_auto_dtype.py covers auto's own choice; the bf16 tests name
# their dtype).
os.environ.setdefault("PDSERVE_AUTO_DTYPE", "float32")
# The CPU's default KV cache is half the free memory, divided among a host's engines; the suite
# runs many engines at once (two pytest processes, workers of each), so each gets 1 GiB unless a
# test sizes it (tests/unit/engine/test_kv_cache_sizing.py covers the default rule itself).
os.environ.setdefault("PDSERVE_CPU_KVCACHE_SPACE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


# The longest modules (serial seconds on 2 cores, 2026-11-26) go first, so that `make test`'s
# two processes (pytest-xdist, a module at a time each) do not end on one of them alone. Order
# only: a module missing here just runs in its usual place.
HEAVY_FIRST = (
    "tests/integration/test_engine_vs_transformers.py",  # 85 s
    "tests/integration/services/api/test_e2e_default_model.py",  # 61 s
    "tests/integration/services/faults/test_migration.py",  # 57 s
    "tests/integration/services/up/test_up_supervision.py",  # 55 s
    "tests/integration/services/faults/test_truthful_health.py",  # 42 s
    "tests/integration/loadtest/test_loadtest.py",  # 41 s
    "tests/integration/services/api/test_tool_calling.py",  # 37 s
    "tests/integration/multihost/test_multihost.py",  # 37 s
    "tests/integration/services/autoscaler/test_autoscaler.py",  # 37 s
    "tests/integration/services/api/test_router_fuzz.py",  # 36 s
    "tests/integration/services/api/test_structured_outputs.py",  # 36 s
    "tests/integration/connector/test_disaggregated.py",  # 33 s
    "tests/integration/services/router/test_router_policies.py",  # 31 s
    "tests/integration/services/up/test_up.py",  # 28 s
    "tests/integration/services/faults/test_faults.py",  # 27 s
)


def _heavy_first(items: list[pytest.Item]) -> None:
    """Stable: the HEAVY_FIRST modules' items first, in that order; the rest as collected."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(rank))

    items.sort(key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heavy_first(items)
    run_slow = config.getoption("--runslow") or os.environ.get("PDSERVE_RUN_SLOW") == "1"
    has_cuda = _has_cuda()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow or PDSERVE_RUN_SLOW=1"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device here"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
