"""The host store: frozen base tensors kept off the compute device, one entry per tensor.

``prepare`` moves every frozen tensor here (pinned when the compute device is CUDA, a separate CPU
tensor when it is the CPU) and remembers where it came from, so ``unprepare`` can put it back. The
store also owns the model's residency ledger and, for ``stream=False`` graphs, the cache of device
copies that stay resident.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .ledger import ResidencyLedger


@dataclasses.dataclass(eq=False)
class HostEntry:
    """One frozen tensor in the store."""

    name: str  # qualified name in the model, e.g. model.layers.0.self_attn.q_proj.weight
    host: torch.Tensor  # the host copy every load reads
    origin_device: torch.device  # where it lived before prepare
    blocks: tuple[int, ...]  # the blocks that read it (two for a tied embedding / lm_head)
    store: "HostStore" = dataclasses.field(repr=False)  # the store it belongs to

    @property
    def nbytes(self) -> int:
        return self.host.untyped_storage().nbytes()


@dataclasses.dataclass(eq=False)
class HostStore:
    """All frozen tensors of one prepared model, and what is known about their blocks."""

    device: torch.device  # compute device
    block_size: int
    prefetch: int
    family: Any  # families.Family
    block_names: list[str]  # block index -> name ("embed", "layers.0", "layers.2-3", "head")
    entries: dict[int, HostEntry] = dataclasses.field(default_factory=dict)  # id(host) -> entry
    ledger: ResidencyLedger = dataclasses.field(default_factory=ResidencyLedger)
    resident_cache: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # stream=False copies
    undo: list[Any] = dataclasses.field(default_factory=list)  # callables that reverse prepare, in order
    schedules: list[Any] = dataclasses.field(default_factory=list)  # one per graph the backend compiled

    def block_bytes(self) -> list[int]:
        """Bytes of base weights each block reads (a tied tensor counts in each block that reads it)."""
        sizes = [0] * len(self.block_names)
        for entry in self.entries.values():
            for b in entry.blocks:
                sizes[b] += entry.nbytes
        return sizes

    def host_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def pinned(self) -> bool:
        return bool(self.entries) and all(e.host.is_pinned() for e in self.entries.values())
