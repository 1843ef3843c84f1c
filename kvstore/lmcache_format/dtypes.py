"""Dtype names and codes as LMCache 0.5.6 writes them, without importing torch.

A dtype is named here by its torch attribute name ("float16", "bfloat16", "float32", ...).
LMCache spells the same dtype two other ways:
- in key strings (`lmcache/utils.py` TORCH_DTYPE_TO_STR_DTYPE): "half", "bfloat16", "float", ...
- in `RemoteMetadata` and the `lm://` headers (`lmcache/v1/protocol.py` DTYPE_TO_INT): an int32
  code. Code 0 means "no dtype" (binary payloads); codes 1 and 2 both mean float16, and LMCache
  writes 2 (its dict literal maps `torch.half` to 1, then the same object `torch.float16` to 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

# A dtype as callers may give it: a torch.dtype, a canonical name, or an alias below.
DTypeLike = Union[str, "torch.dtype"]

# canonical name -> bytes per element
ITEM_SIZES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
}

# canonical name -> LMCache key-string spelling (every dtype a CacheEngineKey accepts)
KEY_DTYPE_STRINGS: dict[str, str] = {
    "float16": "half", "bfloat16": "bfloat16", "float32": "float", "float64": "double",
    "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32", "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "fp8_e4m3fn", "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2fnuz",
}
KEY_STRING_DTYPES: dict[str, str] = {v: k for k, v in KEY_DTYPE_STRINGS.items()}

# canonical name -> the RemoteMetadata code LMCache writes (None: binary payload, no dtype)
DTYPE_CODES: dict[str | None, int] = {
    None: 0, "float16": 2, "bfloat16": 3, "float32": 4, "float64": 5, "uint8": 6,
    "float8_e4m3fn": 7, "float8_e5m2": 8,
}
# RemoteMetadata code -> canonical name (what LMCache's INT_TO_DTYPE reads)
CODE_DTYPES: dict[int, str | None] = {
    0: None, 1: "float16", 2: "float16", 3: "bfloat16", 4: "float32", 5: "float64", 6: "uint8",
    7: "float8_e4m3fn", 8: "float8_e5m2",
}

# other spellings accepted on input: torch's aliases and LMCache's key strings
_ALIASES: dict[str, str] = {
    "half": "float16", "float": "float32", "double": "float64",
    "fp8_e4m3fn": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2": "float8_e5m2", "fp8_e5m2fnuz": "float8_e5m2fnuz",
}


def dtype_name(dtype: DTypeLike) -> str:
    """Canonical name of `dtype` (a torch.dtype or a name); ValueError when unknown."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEM_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r} (known: {', '.join(ITEM_SIZES)})")
    return name


def key_dtype_string(dtype: DTypeLike) -> str:
    """How LMCache spells `dtype` inside a key string ("half" for float16)."""
    return KEY_DTYPE_STRINGS[dtype_name(dtype)]


def dtype_code(dtype: DTypeLike | None) -> int:
    """LMCache's RemoteMetadata code for `dtype` (0 for None); ValueError if LMCache has none."""
    name = None if dtype is None else dtype_name(dtype)
    if name not in DTYPE_CODES:
        known = ", ".join(str(k) for k in DTYPE_CODES)
        raise ValueError(f"dtype {name} has no LMCache RemoteMetadata code (known: {known})")
    return DTYPE_CODES[name]


def code_dtype(code: int) -> str | None:
    """Canonical dtype name for a RemoteMetadata code; ValueError for an unknown code."""
    if code not in CODE_DTYPES:
        raise ValueError(f"unknown LMCache dtype code {code} (known: {sorted(CODE_DTYPES)})")
    return CODE_DTYPES[code]


def item_size(dtype: DTypeLike) -> int:
    return ITEM_SIZES[dtype_name(dtype)]


def torch_dtype(dtype: DTypeLike) -> torch.dtype:
    """The torch.dtype for a name (imports torch)."""
    import torch

    result = getattr(torch, dtype_name(dtype))
    assert isinstance(result, torch.dtype)
    return result
