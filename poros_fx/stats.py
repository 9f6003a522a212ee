"""``poros_fx.stats(model)``: what the residency ledger measured, plus the store's sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .errors import PorosConfigError
from .handles import get_store


def stats(model: nn.Module, *, reset: bool = False) -> dict[str, Any]:
    """Counters of the model's residency ledger since prepare (or the last ``reset=True`` call).

    Keys: ``peak_resident_base_bytes`` (most base bytes on the compute device at once),
    ``resident_base_bytes`` (now: between training steps the blocks a memory budget keeps and the first
    layer blocks the last backward left for the next forward), ``block_bytes`` (list, per block: embed, layer blocks, head),
    ``block_names``, ``bytes_loaded``, ``loads`` (tensors), ``copies`` (host-to-device copy calls: one per
    contiguous host range of a block), ``bytes_copied``, ``evictions``, ``eager_loads`` (of ``loads``: made
    outside the poros graphs by ``poros::load`` itself, neither streamed nor recomputed), ``recomputed_blocks``
    (blocks a backward loaded and reran; a block whose activations were saved is loaded, not counted),
    ``forward_runs``, ``backward_runs`` (per micro-batch), ``block_major_steps`` and ``block_major_micro_batches``
    (accumulation steps that ran block-major, each block loaded once for their micro-batches, and how many
    micro-batches they had; ``runtime/accumulate.py``), ``host_bytes`` (the base's bytes in the host store),
    ``pinned_host_bytes`` (page-locked bytes the store holds: its arena, within 512 bytes per tensor of
    ``host_bytes``; 0 on a CPU compute device), ``head_chunks`` (row chunks the lm_head is loaded in),
    ``pinned``, ``block_size``, ``prefetch``, ``device``, ``codegen`` (prepare's: how regions run unless
    ``options`` say otherwise), ``regions`` (per traced decoder-layer region: its name, the layers
    that run it, and its trace and compile seconds per codegen; empty with ``regions=False``),
    ``memory_budget`` (bytes or ``None``) and ``residency_plan`` (``None`` until the first step of a model
    with a budget; then the blocks kept resident, their bytes, the measured streamed peak, the predicted
    peak and the base bytes copied per micro-batch with and without the plan; ``runtime/budget.py``),
    ``cuda_graphs_choice`` (whether the last compiled step replays its region calls from CUDA graphs, and why:
    ``options.cuda_graphs_choice``), ``budget_source`` (how ``memory_budget="auto"`` became bytes, or why it is
    none), ``cuda_graphs`` (``None`` unless the step uses CUDA graphs; then the region calls captured, replayed,
    run uncaptured while warming up or beyond the chains kept, or fallen back from a recorded graph, the input
    bytes copied into graphs, the pool tensors copied out, the chains recorded again because what they read in
    place had moved (``rerecorded``), the pool's bytes, and ``load_slots``: the fixed
    buffers streamed layer blocks land in so the graphs read them in place, their bytes, the loads into them
    and those that found every slot in use: ``runtime/cuda_graphs.py``, ``runtime/load_slots.py``),
    ``offload_arena`` (``offload_boundaries`` on CUDA: the page-locked buffer's bytes, how many were
    allocated, and the bytes of the current round that did not fit it: ``runtime/offload.py``),
    ``compile`` (host seconds of the one-time work, summed over the graphs compiled so far: ``graphs``,
    ``joint_trace_s`` (AOTAutograd up to the partition),
    ``partition_s``, ``forward_passes_s`` / ``backward_passes_s`` (our passes and each graph's codegen),
    ``forward_first_run_s`` / ``backward_first_run_s`` (each graph's first run), ``region_trace_s`` and
    ``region_compile_s``; Dynamo's own tracing is not in it: ``torch._dynamo.utils.calculate_time_spent()``).
    """
    store = get_store(model)
    if store is None:
        raise PorosConfigError("model is not prepared; call poros_fx.prepare(model) first")
    ledger = store.residency.ledger
    out = dataclasses.asdict(ledger)
    out["resident_base_bytes"] = out.pop("resident_bytes")
    out.update(block_bytes=store.host.block_bytes(), block_names=list(store.host.block_names), host_bytes=store.host.host_bytes(),
               pinned=store.host.pinned(), pinned_host_bytes=store.host.pinned_bytes(),
               head_chunks=store.host.head_chunks, block_size=store.host.block_size, prefetch=store.prefetch,
               device=str(store.device), codegen=store.codegen, memory_budget=store.budget.memory_budget,
               residency_plan=store.budget.plan.as_dict() if store.budget.plan is not None else None,
               regions=[{"name": r.name, "layers": list(r.layers), "trace_s": round(r.trace_seconds, 3),
                         "compile_s": {k: round(v, 3) for k, v in r.compile_seconds.items()}}
                        for r in (store.regions.regions if store.regions is not None else [])],
               cuda_graphs=store.residency.region_graphs.as_dict() if store.residency.region_graphs is not None else None,
               cuda_graphs_choice=store.schedules[-1].graphs_note if store.schedules else None,
               budget_source=store.budget.source,
               offload_arena={"bytes": store.offload_arena.capacity, "allocations": store.offload_arena.allocations,
                              "overflow_bytes": store.offload_arena.overflow_bytes},
               compile=_compile_seconds(store))
    if reset:
        ledger.reset()
    return out


def _compile_seconds(store: Any) -> dict[str, Any]:
    """The schedules' one-time phases summed by name, and the regions' trace and compile seconds."""
    out: dict[str, Any] = {"graphs": len(store.schedules)}
    for schedule in store.schedules:
        for phase, seconds in schedule.phase_seconds.items():
            out[f"{phase}_s"] = out.get(f"{phase}_s", 0.0) + seconds
    regions = store.regions.regions if store.regions is not None else []
    out["region_trace_s"] = sum(r.trace_seconds for r in regions)
    out["region_compile_s"] = sum(sum(r.compile_seconds.values()) for r in regions)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
