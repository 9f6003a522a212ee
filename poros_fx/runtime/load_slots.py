"""Load slots: device buffers at fixed addresses that a streamed layer block is copied into under CUDA graphs.

A captured region call reads a tensor in place only if it is at the address the graph was recorded with
(``runtime/cuda_graphs.py``). A streamed block's load is a new allocation every run, so each replay first
copied the block into the graph's own buffer, device to device: at 72B under a 24 GB budget 64.6 GB a step
(forward, recompute and backward each copy the 45 streamed blocks), ~35 ms of the compute stream's time
(docs/bench/h200_turnaround_back). With ``options={"cuda_graphs": True}`` a streamed layer block is copied
from the host into a *slot* instead: one of a few buffers the model keeps for its whole life, taken in a
fixed order, so the same load of the same step lands at the same address every step and the graphs read it
where it lies.

**Which slot.** ``take`` hands out the first slot of the size asked for that nothing uses any more: a
load's tensors are views of the slot's tensor, so the slot is free again once its storage has only the
references it had when it was made — every view of the load, and every tensor a replay rebuilt over it,
gone (and a slot's bytes outlive the slots themselves while a view of them does). A step runs the
same code in the same order every time, so it frees and takes slots in the same order and gets the same
addresses; a step that finds them taken differently (a new shape, a plan that changed) makes the graphs
whose inputs moved run uncaptured (``fallbacks``), still exact. When every slot of the size is in use a new
one is made, up to ``MAX_SLOTS``; past that the load is an ordinary allocation.

**Stream order.** A load's copy waits for the compute stream to reach the load (``copies.py``). A slot
is free only when no tensor over it is alive, so every kernel that reads the slot's last block was already
queued on the compute stream before that point: the copy never overwrites bytes a queued kernel still reads.

**Memory.** The slots stay allocated between steps (``torch.cuda.memory_allocated`` counts them): about as
many blocks as a step holds at once (the block computing, the ones loading ahead, the turn-around copies),
which the allocator held during the step before and gave back to its cache after it. Between steps they hold
the next forward's first blocks, which a backward leaves there (``compiler/backend.py``, ``_reused_by_forward``).
The graphs' pool no longer holds a copy of a block (its input buffer). ``runtime/budget.py`` counts the slots
in the step's transient, not in what stays allocated between steps.
"""

from __future__ import annotations

from typing import Callable

import torch

MAX_SLOTS = 8  # slots of one size; a load beyond them is an ordinary allocation (read through a copy by the graphs)


class Slot:
    """One slot: a uint8 tensor that every load into the slot is a view of."""

    def __init__(self, owner: torch.Tensor) -> None:
        self.owner = owner
        self._storage = owner.untyped_storage()  # kept: its reference is counted in the baseline
        self._unused = torch._C._storage_Use_Count(self._storage._cdata)  # references while no load uses it

    def free(self) -> bool:
        # every view of the owner, and every tensor rebuilt over its storage, holds one more reference to
        # the storage (torch's cudagraph trees tell a dead storage by the same count)
        return torch._C._storage_Use_Count(self._storage._cdata) == self._unused


class LoadSlots:
    """The slots of one prepared model, by size in bytes."""

    def __init__(self) -> None:
        self.by_size: dict[int, list[Slot]] = {}
        self.addresses: set[int] = set()  # data pointers of every slot
        self.takes = 0
        self.overflows = 0  # takes that found every slot of their size in use with MAX_SLOTS made

    def take(self, size: int, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
        """A free slot of ``size`` bytes (a uint8 tensor made with ``allocate(size)`` when none is free; the
        caller takes views of it), or ``None`` when ``MAX_SLOTS`` of that size are in use."""
        slots = self.by_size.setdefault(size, [])
        slot = next((s for s in slots if s.free()), None)
        if slot is None:
            if len(slots) >= MAX_SLOTS:
                self.overflows += 1
                return None
            slot = Slot(allocate(size))
            slots.append(slot)
            self.addresses.add(slot.owner.data_ptr())
        self.takes += 1
        return slot.owner

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in a slot (a load the graphs may read in place)."""
        return t.untyped_storage().data_ptr() in self.addresses

    def nbytes(self) -> int:
        return sum(s.owner.numel() for slots in self.by_size.values() for s in slots)

    def as_dict(self) -> dict[str, int]:
        return {"slots": sum(len(s) for s in self.by_size.values()), "bytes": self.nbytes(), "takes": self.takes,
                "overflows": self.overflows}
