"""Device-independent parts of the CUDA path: graph batch sizes and backend selection."""

from __future__ import annotations

import pytest

from engine.attention.selector import backend_for_device
from engine.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_max() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    for m in range(1, 70):
        sizes = capture_sizes(m)
        assert sizes[-1] == m and sizes == sorted(set(sizes))


def test_cpu_gets_the_pytorch_backend() -> None:
    assert backend_for_device("cpu").name == "torch"


def test_cuda_gets_the_triton_backend() -> None:
    pytest.importorskip("triton")
    assert backend_for_device("cuda").name == "triton"


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="device"):
        backend_for_device("meta")
