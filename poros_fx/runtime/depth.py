"""Prefetch depth from measured copy and compute time (``prefetch="auto"``, the default).

The forward graph is compiled before anything ran, so it prefetches one block ahead (two under a CUDA
memory budget, whose kept blocks sit between streamed ones: ``budget.py``). Its first run on CUDA times
every prefetch group's copy on the copy stream and every block's compute on the compute stream (CUDA
events; see ``GraphRuntime``). AOTAutograd compiles the backward lazily, at the
first ``backward()``, so by then the forward has been measured and the backward's depth is chosen
from it: a block's backward computes its recompute (one forward) and about two forwards of gradient
work, so it has ``3 x`` the forward compute to hide the next copies under. The backward loads
``prefetch`` blocks ahead so that ``prefetch x 3 x compute >= copy``, capped at ``LIMIT`` and by half
of the free device memory; under a memory budget it is at least 2, as the forward's.

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
                    free_bytes: int | None, budgeted: bool = False) -> tuple[int, str]:
    """(prefetch depth for the backward, why). ``budgeted``: a memory budget keeps blocks between streamed
    ones (``budget.py``), and a load one block ahead of a kept block waits for it to start: at least 2."""
    if device_type != "cuda":
        return 1, "prefetch auto: 1 (CPU compute device: loads are synchronous copies, depth changes nothing)"
    least = 2 if budgeted else 1
    if not timing or not timing.get("groups"):
        return least, f"prefetch auto: {least} (nothing measured: the backward was compiled before the forward ran)"
    copy, forward = timing["copy_ms"], timing["block_compute_ms"]
    if forward <= 0:  # one group: no block was timed between two waits
        return least, f"prefetch auto: {least} (one prefetch group in the forward: a block's compute was not measured)"
    backward = BACKWARD_FACTOR * forward
    # the first run's block times include its one-off host work (kernel loading, graph capture: 72B measured
    # 10.7 ms for a 2.3 ms forward), so this errs shallow; a budget's kept blocks need two regardless
    depth = min(LIMIT, max(least, math.ceil(copy / backward)))
    why = (f"prefetch auto: {{depth}} for the backward (measured in the first forward: a block's copy "
           f"{copy:.2f} ms, its forward compute {forward:.2f} ms, so ~{backward:.2f} ms of backward per block"
           + ("; at least 2 under a memory budget" if budgeted else ""))
    if free_bytes is not None and block_bytes > 0:
        fits = max(1, int(free_bytes // 2 // block_bytes) - 1)
        if fits < depth:
            depth = fits
            why += f"; capped by free device memory, {gib(free_bytes)}"
    return depth, why.format(depth=depth) + ")"
