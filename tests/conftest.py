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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
