"""Host memory: what a load will keep in the host store, the arena's exact size, and the check that
refuses a load before a byte is read when available RAM cannot hold it (the host's memory is read by
``runtime/host_ram.py``).
"""

from __future__ import annotations

import warnings
from typing import Callable

from torch import nn

from ..runtime.arena import aligned
from ..runtime.host_ram import host_ram_available
from ..units import gib_or_mib
from .checkpoint import LoaderError
from .meta_model import is_nf4_weight, numel, param_groups, split_name
from .quantize import NF4_BLOCKSIZE
from .sizes import nf4_bytes


def store_bytes(model: nn.Module) -> int:
    """What ``prepare`` will put in the host store for this (meta) model: every parameter once."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            total += nf4_bytes(numel(p), NF4_BLOCKSIZE) if is_nf4_weight(module, attr) else numel(p) * p.element_size()
    return total


def arena_capacity(model: nn.Module) -> int:
    """The host arena's exact size for this (meta) model: what ``prepare`` will keep of every parameter,
    each tensor aligned as the arena places it (NF4: packed weight, absmax, and nested: offset, the
    nested absmax and its code)."""
    total = 0
    for names, meta in param_groups(model):
        owner_name, attr = split_name(names[0])
        owner = model.get_submodule(owner_name)
        if attr in owner._buffers:
            continue
        if is_nf4_weight(owner, attr):
            total += nf4_bytes(numel(meta), NF4_BLOCKSIZE, align=aligned)
        else:
            total += aligned(numel(meta) * meta.element_size())
    return total


def check_ram(source: str, host_bytes: int, in_flight: int, available_ram: int | Callable[[], int | None] | None,
               quantization: str) -> None:
    """Refuse before reading anything when the base cannot fit in available host RAM (``available_ram``:
    bytes, a callable returning them, or ``None``: read them here)."""
    if callable(available_ram):
        available = available_ram()
    elif available_ram is None:
        available = host_ram_available()
    else:
        available = int(available_ram)
    if available is None:
        warnings.warn("could not read the available host RAM (no psutil, no /proc/meminfo); loading without "
                      "checking that the base fits", stacklevel=3)
        return
    needed = host_bytes + in_flight
    if needed <= available:
        return
    hint = " Use quantization='nf4' to shrink the decoder linears about 3.5x, free memory" \
        if quantization == "bf16" else " Free memory"
    raise LoaderError(f"not enough host RAM to load {source}: the {quantization} base needs about {gib_or_mib(needed)} "
                      f"({gib_or_mib(host_bytes)} in the host store + {gib_or_mib(in_flight)} in flight while loading) and "
                      f"only {gib_or_mib(available)} is available.{hint}, or use a machine with more RAM.")
