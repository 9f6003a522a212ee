"""Sizes in and out: the one place that parses a size string and formats a byte count.

Binary units (GiB = 2**30) are what the host store and the device report; decimal gigabytes
(GB = 10**9) are what the benchmark tables and a ``memory_budget`` such as ``"24GB"`` use. Each
formatter below has one style; pick the one a message already uses rather than writing another.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .errors import PorosConfigError

KIB, MIB, GIB = 2**10, 2**20, 2**30
GB = 10**9

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: Any, what: str = "memory_budget") -> int | None:
    """Bytes (an int), a size string (``"24GB"``, ``"500MiB"``), or ``None``; ``what`` names the setting
    in the error (``memory_budget``, the CLI's ``--max-shard-size``)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?)b?\s*", value.lower())
        if m and m.group(2) in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise PorosConfigError(f"{what} must be a positive number of bytes or a size such as '24GB' or '500MiB', "
                           f"got {value!r}")


def format_bytes(n: int | float) -> str:
    """A byte count readable at every size: ``1.50 GiB``, ``259.7 MiB``, ``12.3 KiB``, ``512 bytes`` (a tiny
    test model's blocks are a few KiB, which ``0.0 MiB`` hid)."""
    n = float(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    if abs(n) >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{int(n)} bytes"


def gib(n: int | float, digits: int = 2) -> str:
    """``12.34 GiB`` (device and host memory in messages: free memory, shared-memory folders, arenas)."""
    return f"{n / GIB:.{digits}f} GiB"


def gib_or_mib(n: int | float) -> str:
    """``1.25 GiB`` from 128 MiB up, ``0.10 MiB`` below (host RAM a load needs: tiny test models too)."""
    return f"{n / GIB:.2f} GiB" if n >= 2**27 else f"{n / MIB:.2f} MiB"


def decimal_bytes(n: int) -> str:
    """``24.00 GB``, ``512.00 MB``, ``3.00 kB``, ``12 bytes`` (a ``memory_budget`` is given in these)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def table_gb(n: Any) -> str:
    """A table cell in decimal GB, ``12.345`` (``-``: not measured)."""
    return "-" if n is None else f"{n / GB:.3f}"


def table_gib(n: Any, digits: int = 2) -> str:
    """A table cell in GiB, ``12.34`` (``-``: not measured)."""
    return "-" if n is None else f"{n / GIB:.{digits}f}"


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (``torch.bfloat16`` -> 2)."""
    return torch.empty((), dtype=dtype).element_size()
