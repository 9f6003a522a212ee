"""Prefetch depth from measured copy and compute time (``prefetch="auto"``, the default).

The forward graph is compiled before anything ran, so it prefetches one block ahead (two under a CUDA memory
budget: ``compiler/backend.py``). Its first run
on CUDA times every prefetch group's copy on the copy stream and every block's compute on the
compute stream (CUDA events; see ``GraphRuntime``). AOTAutograd compiles the backward lazily, at the
first ``backward()``, so by then the forward has been measured and the backward's depth is chosen
from it: a block's backward computes its recompute (one forward) and about two forwards of gradient
work, so it has ``3 x`` the forward compute to hide the next copies under. The backward loads
``prefetch`` blocks ahead so that ``prefetch x 3 x compute >= copy``, capped at ``LIMIT`` and by half
of the free device memory.

    copy 8.2 ms, forward compute 2.8 ms  ->  backward 8.4 ms per block  ->  prefetch 1
    copy 8.2 ms, forward compute 1.0 ms  ->  backward 3.0 ms per block  ->  prefetch 3
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..units import gib

LIMIT = 4  # blocks ahead at most
BACKWARD_FACTOR = 3  # a block's backward (recompute + gradients) in forwards of that block


def summarize_timing(copy_ms: list[float], compute_ms: list[float], stall_ms: list[float]) -> dict[str, Any]:
    """What ``choose_prefetch`` reads: medians over the groups of one forward run."""
    return {"copy_ms": statistics.median(copy_ms) if copy_ms else 0.0,
            "block_compute_ms": statistics.median(compute_ms) if compute_ms else 0.0,
            "stall_ms": sum(stall_ms), "groups": len(copy_ms)}


def choose_prefetch(timing: dict[str, Any] | None, *, device_type: str, block_bytes: int,
                    free_bytes: int | None) -> tuple[int, str]:
    """(prefetch depth for the backward, why)."""
    if device_type != "cuda":
        return 1, "prefetch auto: 1 (CPU compute device: loads are synchronous copies, depth changes nothing)"
    if not timing or not timing.get("groups"):
        return 1, "prefetch auto: 1 (nothing measured: the backward was compiled before the forward ran)"
    copy, forward = timing["copy_ms"], timing["block_compute_ms"]
    if forward <= 0:  # one group: no block was timed between two waits
        return 1, "prefetch auto: 1 (one prefetch group in the forward: a block's compute was not measured)"
    backward = BACKWARD_FACTOR * forward
    depth = min(LIMIT, max(1, math.ceil(copy / backward)))
    why = (f"prefetch auto: {{depth}} for the backward (measured in the first forward: a block's copy "
           f"{copy:.2f} ms, its forward compute {forward:.2f} ms, so ~{backward:.2f} ms of backward per block")
    if free_bytes is not None and block_bytes > 0:
        fits = max(1, int(free_bytes // 2 // block_bytes) - 1)
        if fits < depth:
            depth = fits
            why += f"; capped by free device memory, {gib(free_bytes)}"
    return depth, why.format(depth=depth) + ")"
