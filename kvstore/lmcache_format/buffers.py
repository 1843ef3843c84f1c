"""Zero-copy views between KV tensors (torch or numpy, CPU, C-contiguous) and pyarrow Buffers.

A payload is the tensor's raw bytes; LMCache stores the same bytes. bfloat16 has no numpy dtype,
so numpy sees it as uint16 words (fp8 as uint8). torch and numpy are imported only here, inside
the functions, so `kvstore` imports without torch.

Lifetime: a Buffer made from a tensor holds a reference to it, and a tensor made from a Buffer
holds a reference to the Buffer, so either side may be dropped first. Buffers over pyarrow or
bytes memory are read-only: do not write to tensors made from them (copy first).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from kvstore.lmcache_format.dtypes import DTypeLike, dtype_name, item_size

if TYPE_CHECKING:
    import numpy as np
    import torch

# canonical dtype -> numpy dtype of the same width (words for dtypes numpy lacks)
NUMPY_DTYPES: dict[str, str] = {
    "float16": "float16", "bfloat16": "uint16", "float32": "float32", "float64": "float64",
    "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32", "int64": "int64",
    "bool": "bool", "float8_e4m3fn": "uint8", "float8_e4m3fnuz": "uint8", "float8_e5m2": "uint8",
    "float8_e5m2fnuz": "uint8",
}


def tensor_to_buffer(t: torch.Tensor) -> pa.Buffer:
    """A Buffer over `t`'s memory, no copy (`buf.address == t.data_ptr()`); keeps `t` alive."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_to_buffer needs a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"tensor_to_buffer needs a contiguous tensor, got strides {t.stride()}")
    return pa.foreign_buffer(t.data_ptr(), t.numel() * t.element_size(), base=t)


def buffer_to_tensor(buf: Any, dtype: DTypeLike, shape: Sequence[int], offset: int = 0) -> torch.Tensor:
    """A tensor over `buf` (pyarrow.Buffer, bytes, memoryview, ...) from byte `offset`, no copy;
    the buffer must hold exactly the tensor's bytes after `offset`."""
    import torch

    from kvstore.lmcache_format.dtypes import torch_dtype

    view = memoryview(buf).cast("B")
    count = math.prod(shape)
    expected = count * item_size(dtype)
    if view.nbytes - offset != expected:
        raise ValueError(f"{tuple(shape)} {dtype_name(dtype)} needs {expected} bytes, "
                         f"buffer has {view.nbytes - offset} after offset {offset}")
    if count == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype))
    with warnings.catch_warnings():  # read-only memory is expected here; see the module doc
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(view, dtype=torch_dtype(dtype), count=count, offset=offset)
    return flat.view(tuple(shape))


def numpy_to_buffer(a: np.ndarray) -> pa.Buffer:
    """A Buffer over a C-contiguous array's memory, no copy; keeps `a` alive."""
    if not a.flags.c_contiguous:
        raise ValueError("numpy_to_buffer needs a C-contiguous array")
    return pa.py_buffer(a)


def buffer_to_numpy(buf: Any, dtype: DTypeLike, shape: Sequence[int], offset: int = 0) -> np.ndarray:
    """A read-only array over `buf`, no copy; bfloat16 comes back as uint16 words, fp8 as uint8."""
    import numpy as np

    np_dtype = np.dtype(NUMPY_DTYPES[dtype_name(dtype)])
    view = memoryview(buf).cast("B")
    expected = math.prod(shape) * np_dtype.itemsize
    if view.nbytes - offset != expected:
        raise ValueError(f"{tuple(shape)} {dtype_name(dtype)} needs {expected} bytes, "
                         f"buffer has {view.nbytes - offset} after offset {offset}")
    return np.frombuffer(view, dtype=np_dtype, count=math.prod(shape), offset=offset).reshape(tuple(shape))
