"""Page-lock the boundary offload's host memory before the first step runs, or refuse the step there.

With ``offload_boundaries`` on CUDA the block outputs a backward reads wait in one page-locked host
buffer (``runtime/offload.py``). What one run of a compiled forward puts there is known once its
passes ran: the ``offload`` nodes' tensors at the traced sizes. ``reserve_offload`` page-locks that much
at once (``OffloadArena.reserve``), so the first step takes no other host memory for it, and a host
that cannot hold it fails here, before the step, with what it needs and has: never in the middle of
the step's forward (at 72B and 32768 tokens: 81 hidden states of 512 MiB, 40.5 GiB, beside a 40 GB
store).

The check compares the bytes still to page-lock with the host's available memory less
``HOST_HEADROOM`` (what the process still allocates while it compiles and runs: Inductor's compile
workers, Python objects, the loss's host scalars). Where it is over, the message names the length
that fits in the same memory (the offloaded bytes grow with the tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..errors import PorosConfigError
from ..runtime.arena import aligned
from ..runtime.host_ram import host_ram_available
from ..units import GIB, gib
from .device_fit import size_hint
from .schedule import Schedule

HOST_HEADROOM = 4 * GIB


def offloaded_bytes(graph: fx.GraphModule, names: list[str]) -> int | None:
    """Page-locked bytes one run of the forward ``graph`` takes for its offloaded tensors (``names``: the
    saved boundaries the offload pass offloaded), each aligned as the buffer hands it out, at the sizes the
    graph was traced with; ``None`` where a size has no value in the trace (the buffer then grows as it
    goes)."""
    offloaded = set(names)
    total = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.args and getattr(node.args[0], "name", None) in offloaded \
                and getattr(node.target, "__name__", "") == "offload":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                numel = 1
                for size in val.shape:
                    if isinstance(size, torch.SymInt) and size.node.hint is None:
                        return None
                    numel *= size_hint(size)
                total += aligned(numel * val.element_size())
    return total


def reserve_offload(graph: fx.GraphModule, schedule: Schedule, store: Any, tokens: tuple[int, int] | None) -> None:
    """Page-lock what the streamed CUDA forward ``graph`` offloads (``offload_boundaries``), refusing with
    ``PorosConfigError`` where the host cannot hold it; ``tokens``: the traced (batch, length), for the
    message."""
    if not (schedule.stream and schedule.offload_boundaries and schedule.device.type == "cuda" and schedule.offloaded):
        return
    need = offloaded_bytes(graph, schedule.offloaded)
    arena = store.offload_arena
    if need is None or need <= arena.capacity:
        return
    more = need - arena.capacity
    available = host_ram_available()
    if available is not None and more > available - HOST_HEADROOM:
        raise PorosConfigError(host_message(need, more, available, len(schedule.offloaded), tokens))
    arena.reserve(need)


def host_message(need: int, more: int, available: int, count: int, tokens: tuple[int, int] | None) -> str:
    """Why a step's offloaded boundaries do not fit the host, and the length that would."""
    room = max(0, available - HOST_HEADROOM + need - more)  # what the buffer could grow to
    step = f" ({tokens[0]} x {tokens[1]} tokens)" if tokens else ""
    fits = ""
    if tokens and room:
        length = tokens[1] * room // need // 1024 * 1024
        fits = f" About {length} tokens per sequence would fit." if length else ""
    return (f"this step{step} offloads {count} block outputs, {gib(need)}, to page-locked host memory "
            f"(offload_boundaries), and the host has {gib(available)} available, {gib(HOST_HEADROOM)} of which the "
            f"process keeps for compiling and running.{fits} Shorten the sequence or the batch, free host memory, or "
            "turn offload_boundaries off to keep them on the device (`poros-fx check MODEL --seq-len N "
            "--device-memory SIZE` estimates the device memory either way)")
