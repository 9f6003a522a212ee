"""Refuse, before the first step runs, a CUDA step whose length is estimated not to fit the device.

A step's length is known to ``torch.compile``, ``@poros_fx.step`` and the trainers only when the
backend compiles it. There ``check_step_fits`` estimates what the streamed step holds on the device
(``estimate.step_memory``, as ``poros-fx check`` does) at the traced tokens and with the options in
effect, and compares it with the memory the step may use: the memory budget, else the device's memory
under the process's cap (``torch.cuda.set_per_process_memory_fraction``). Where the estimate is over,
it raises with the long-sequence options under which it fits, or the longest length that fits with all
of them (``estimate.long_sequence_advice``). Those options are prepare's (the step is already traced
with them), so the run is refused rather than switched. ``poros-fx train`` and ``FineTuner`` fit the
length before compiling (``training/loop.py``) and turn the options on themselves.

The estimate counts one micro-batch in flight (block-major accumulation holds more), so it refuses
only steps that do not fit with one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import PorosConfigError
from ..units import format_bytes
from .estimate import StepMemory, long_context_plan, long_sequence_advice, step_memory

PARAMETRIZED = ".parametrizations."  # in the names of a parametrized weight's stored tensors (io/nf4_experts.py)

# the estimate's terms are products of sizes; it was within 1% of the measured peak at 7B and 32K-128K
# tokens (docs/bench/long_context/cap24/). A step refused here is over the memory by the estimate alone.


def traced_tokens(placeholders: Sequence[str], example_inputs: Sequence[Any]) -> tuple[int, int] | None:
    """``(batch, length)`` of the step's token ids: the 2-D input Dynamo named after ``input_ids`` (else
    ``labels``), by the names of its graph's ``placeholders``; ``None`` without one."""
    named = dict(zip(placeholders, example_inputs))
    for key in ("input_ids", "labels"):
        for name, t in named.items():
            if key in name and isinstance(t, torch.Tensor) and t.dim() == 2:
                return tuple(size_hint(s) for s in t.shape)  # type: ignore[return-value]
    return None


def size_hint(size: Any) -> int:
    """A size's value in this trace (a symbolic size's hint)."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def device_memory(device: torch.device, budget: int | None) -> tuple[int, str]:
    """What a step may hold on ``device``: ``budget``, else its memory under the process's cap."""
    if budget is not None:
        return budget, f"the memory budget ({format_bytes(budget)})"
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    if fraction < 1.0:
        return int(total * fraction), f"the process's cap ({format_bytes(int(total * fraction))})"
    return total, f"the device's memory ({format_bytes(total)})"


def _sizes(store: Any, lm: Any) -> tuple[int, int, int | None, bool]:
    """The prepared model's base window, adapter bytes, loss vocabulary chunks (``None``: the head cannot
    be chunked) and whether the chunked loss is on."""
    sizes = store.block_bytes()
    ahead = 1 if store.prefetch == "auto" else store.prefetch
    window = (1 + ahead) * max([*sizes[:-1], -(-sizes[-1] // store.head_chunks)])
    adapter = sum(p.numel() * p.element_size() for p in lm.parameters() if p.requires_grad)
    loss_chunks = len(lm.__dict__.get("_poros_loss_chunks") or ()) or None
    return window, adapter, loss_chunks, bool(lm.__dict__.get("_poros_chunked_loss"))


def step_estimate(store: Any, lm: Any, tokens: tuple[int, int], *, offload_boundaries: bool) -> StepMemory:
    """The streamed step's device memory for ``tokens`` (batch, length) of the prepared causal LM ``lm``
    (its host store ``store``), with its options."""
    window, adapter, loss_chunks, chunked = _sizes(store, lm)
    return step_memory(lm.config, window, seq=tokens[1], batch=tokens[0], in_flight=1, adapter_bytes=adapter,
                       loss_chunks=loss_chunks if chunked else None, offload_boundaries=offload_boundaries,
                       sequence_chunks=store.sequence_chunks, nf4_experts=_nf4_experts(store))


def _nf4_experts(store: Any) -> bool:
    """Whether the base holds parametrized (NF4) experts: their stored tensors are the host store's."""
    return any(PARAMETRIZED in entry.name for entry in store.host.tensors())


def check_step_fits(store: Any, lm: Any, tokens: tuple[int, int], memory: int, memory_note: str, *,
                    offload_boundaries: bool) -> None:
    """Raise ``PorosConfigError`` where ``step_estimate`` is over ``memory``."""
    need = step_estimate(store, lm, tokens, offload_boundaries=offload_boundaries).total
    if need <= memory:
        return
    batch, length = tokens
    window, adapter, loss_chunks, chunked = _sizes(store, lm)
    given = {"chunked_loss": chunked, "offload_boundaries": offload_boundaries,
             "sequence_chunks": store.sequence_chunks}
    plan = long_context_plan(lm.config, window, seq=length, batch=batch, adapter_bytes=adapter,
                             device_memory=memory, loss_chunks=loss_chunks, nf4_experts=_nf4_experts(store))
    raise PorosConfigError(
        f"this step ({batch} x {length} tokens) is estimated to need {format_bytes(need)} on the device, more than "
        f"{memory_note}: {long_sequence_advice(plan, given)}. The options are poros_fx.prepare's (or "
        "poros_fx.from_config's / load_pretrained's); `poros-fx check MODEL --seq-len N --device-memory SIZE` "
        "prints the estimate")
