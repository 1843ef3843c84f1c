"""Byte sizes written as humans do: "8GiB", "512MiB", "1.5GB", "1048576"."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, name: str = "size") -> int:
    """Bytes in `text`; raises ValueError naming `name` when it is not a size."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{name}: {text!r} is not a size (examples: 8GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[unit])
