"""A memory budget: which blocks stay on the device for the whole run, so fewer bytes cross the link.

With ``memory_budget`` set, the first step runs fully streamed and measures its own peak (on CUDA
``torch.cuda.max_memory_allocated``, everything the step allocates; on the CPU the ledger's base
bytes). That is the streamed minimum: a budget below it raises ``PorosOOMError`` naming it. The rest,
``budget - streamed peak``, is spent on blocks that then stay resident: loaded once, never evicted
and never loaded again, so each one takes ``2 x its bytes`` off every later step. Layer blocks are
equal in size and each saves the same, so the plan keeps them from the last block backwards (the
head first, then the last layers: the backward's first blocks, the ones a turn-around would keep).

Resident blocks are still recomputed in the backward (only their loads are skipped): the graphs and
kernels do not change with the plan, so streamed == ``stream=False`` holds for every budget, and the
plan can change between steps without a recompile. Predicted peak = streamed peak + resident bytes
(each resident block's streamed copy is already inside the streamed peak, so this over-predicts).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ..errors import PorosConfigError, PorosOOMError

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


@dataclasses.dataclass
class ResidencyPlan:
    budget: int  # bytes
    streamed_peak: int  # measured in the first (fully streamed) step
    measured_on: str  # "cuda: max_memory_allocated" | "cpu: base bytes (ledger)"
    resident_blocks: list[str]  # block names that stay on the device
    resident_bytes: int
    streamed_bytes_per_step: int  # base bytes copied per micro-batch with the plan (forward + backward)
    streamed_bytes_per_step_before: int  # ... without it

    @property
    def predicted_peak(self) -> int:
        return self.streamed_peak + self.resident_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "predicted_peak": self.predicted_peak}


def plan(store: Any, budget: int, streamed_peak: int, measured_on: str) -> ResidencyPlan:
    """The blocks of ``store`` that stay resident under ``budget`` (see the module docstring)."""
    if budget < streamed_peak:
        raise PorosOOMError(f"memory_budget {_size(budget)} is below what the fully streamed step needs: its first step "
                            f"peaked at {_size(streamed_peak)} ({measured_on}); the smallest budget that works is "
                            f"{streamed_peak} bytes ({_size(streamed_peak)}), or stream with a smaller block_size / prefetch")
    sizes = store.block_bytes()
    # every block that loads base bytes loads them twice per micro-batch (forward, recompute); a gathering
    # embedding loads none (its rows come from the host store)
    streamed = [i for i, n in enumerate(sizes) if n]
    before = 2 * sum(sizes[i] for i in streamed)
    room, keep = budget - streamed_peak, []
    for i in reversed(streamed):
        if sizes[i] <= room:
            keep.append(i)
            room -= sizes[i]
    kept = sum(sizes[i] for i in keep)
    return ResidencyPlan(budget=budget, streamed_peak=streamed_peak, measured_on=measured_on,
                         resident_blocks=[store.block_names[i] for i in sorted(keep)], resident_bytes=kept,
                         streamed_bytes_per_step=before - 2 * kept, streamed_bytes_per_step_before=before)


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def resident_hosts(store: Any, plan: ResidencyPlan) -> set[int]:
    """ids of the host tensors the plan keeps: every entry read by a resident block (a layer's span and
    its member tensors alike)."""
    keep = {store.block_names.index(name) for name in plan.resident_blocks}
    return {id(e.host) for e in store.entries.values() if e.blocks and set(e.blocks) <= keep}


def start_measuring(store: Any) -> None:
    """Before the first step of a store with a budget: start its peak from zero (CUDA's peak counter is
    the process's; this resets it)."""
    if store.memory_budget is None or store.plan is not None or store.budget_measuring:
        return
    store.budget_measuring = True
    if store.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(store.device)


def measure_and_plan(store: Any) -> None:
    """After the first fully streamed step of a store with a budget: measure its peak and make the plan."""
    if store.memory_budget is None or store.plan is not None or not store.budget_measuring:
        return
    if store.device.type == "cuda":
        peak, how = torch.cuda.max_memory_allocated(store.device), "cuda: max_memory_allocated over the first step"
    else:
        peak, how = store.ledger.peak_resident_base_bytes, "cpu: base bytes on the device (ledger)"
    store.plan = plan(store, store.memory_budget, peak, how)
    store.kept_hosts = resident_hosts(store, store.plan)
