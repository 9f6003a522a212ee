"""The host store: everything poros-fx keeps about one prepared model, composed of its concerns.

``HostStore`` holds the host tensors (``host_tensors.HostTensors``: the arena, its entries, the block
layout), what of them is on the device now (``residency.Residency``: the ledger, the copies that stay,
the turn-around stashes, the block-major step, the CUDA graphs, the step in flight) and the memory
budget with its plan (``budget.BudgetState``), plus prepare's options, the undo list that reverses
prepare, and the schedules of the graphs the backend compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import weakref
from typing import Any

import torch
from torch.nn.utils import parametrize

from ..errors import PorosConfigError
from ..units import gib
from .arena import nbytes
from .budget import BudgetState
from .host_tensors import HostTensors
from .offload import OffloadArena
from .residency import Residency

# schedules a store keeps (the most recent): one per graph the backend compiled, which grows only with
# distinct input shapes (Dynamo recompiles at most ``recompile_limit``, 8 by default, per frame) and
# with ``torch._dynamo.reset()``; a dropped schedule stays alive as long as its compiled graph runs
SCHEDULES_KEPT = 32


@dataclasses.dataclass(eq=False)
class HostStore:
    """One prepared model: its host tensors, their residency on the device, its memory budget, prepare's
    options, what reverses prepare, and the schedules of its compiled graphs."""

    device: torch.device  # compute device
    prefetch: int | str  # blocks loaded ahead, or "auto" (runtime/depth.py)
    family: Any  # families.Family
    host: HostTensors  # the arena, its entries and their blocks
    residency: Residency = dataclasses.field(default_factory=Residency)  # what of the base is on the device
    budget: BudgetState = dataclasses.field(default_factory=BudgetState)  # the memory budget and its plan
    undo: list[Any] = dataclasses.field(default_factory=list)  # callables that reverse prepare, in order
    followers: list[Any] = dataclasses.field(default_factory=list)  # adapter_hooks.LayerFollower, kept alive here
    # one per graph the backend compiled, the last SCHEDULES_KEPT of them
    schedules: collections.deque[Any] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=SCHEDULES_KEPT))
    split_warned: bool = False  # the backend warned that Dynamo split the step inside the layers
    timing: dict[str, Any] | None = None  # the last measured forward run (prefetch "auto"; runtime/depth.py)
    codegen: str = "eager"  # how compiled regions run: "inductor" | "eager" (prepare's codegen)
    regions: Any = None  # compiler.regions.RegionTable of the decoder layers (None: layers traced inline)
    offload_boundaries: bool = False  # the saved block outputs wait in host memory (options={"offload_boundaries": ...} wins)
    offloaded: collections.deque[Any] = dataclasses.field(  # weak refs to the last steps' host copies of them
        default_factory=lambda: collections.deque(maxlen=4096))
    offload_arena: OffloadArena = dataclasses.field(default_factory=OffloadArena)  # their page-locked host memory (CUDA)
    lm_ref: Any = None  # weakref to the prepared *ForCausalLM module (its chunked-loss flag, loss.py)
    sequence_chunks: int = 1  # token chunks of each decoder layer's MLP and projections in its region (compiler/regions/sequence_chunks.py)
    block_major: bool = True  # accumulation steps run block-major (prepare's; options={"block_major": ...} wins)

    # The training loop and the benchmark rows read these through the store itself.
    def block_bytes(self) -> list[int]:
        """``host.block_bytes()``: bytes of base weights each block loads."""
        return self.host.block_bytes()

    @property
    def head_chunks(self) -> int:
        """``host.head_chunks``: row chunks the lm_head weight is loaded in."""
        return self.host.head_chunks

    @property
    def resident_cache(self) -> dict[Any, torch.Tensor]:
        """``residency.resident_cache``: the device copies that stay."""
        return self.residency.resident_cache

    @property
    def region_graphs(self) -> Any:
        """``residency.region_graphs``: the region calls' CUDA graphs (``None``: none)."""
        return self.residency.region_graphs

    @region_graphs.setter
    def region_graphs(self, graphs: Any) -> None:
        self.residency.region_graphs = graphs

    @property
    def memory_budget(self) -> int | None:
        """``budget.memory_budget``: bytes the step may use on the device (``None``: stream all)."""
        return self.budget.memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int | None) -> None:
        self.budget.memory_budget = value

    def copy_stream(self) -> Any:
        """The CUDA stream every streamed load of this model copies on (created on first use)."""
        return self.residency.copy_stream(self.device)

    def oom_message(self, block: int, nbytes: int, stream: bool) -> str:
        """What to say when loading ``nbytes`` of ``block`` ran out of device memory: the free memory
        measured now, what the base holds of it, and the block size / prefetch that would fit."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        base_now = self.residency.ledger.resident_bytes
        # what a streamed schedule could use for base weights: free memory plus the base bytes held now
        budget = free + cached + base_now
        sizes = self.host.block_bytes()
        layer = max(sizes[1:-1]) / self.host.block_size if len(sizes) > 2 else 0
        ends = max(sizes[0], sizes[-1] / self.host.head_chunks)  # a chunked head holds one chunk at a time
        lines = [f"out of device memory loading {gib(nbytes)} for block {self.host.block_names[block]!r} "
                 f"(stream={stream}, block_size={self.host.block_size}, prefetch={self.prefetch}). Measured now: "
                 f"{gib(free)} free on the device of {gib(total, 1)}, {gib(cached)} cached by "
                 f"torch's allocator, {gib(base_now)} of base weights resident."]
        fits = [(bs, p) for bs in (4, 2, 1) for p in (2, 1, 0)
                if (1 + p) * max(bs * layer, ends) <= budget]
        if not stream:
            lines.append("stream=False keeps the whole base resident; stream it (the default) to hold one block.")
        if fits:
            bs, p = fits[0]
            lines.append(f"A schedule that would fit the {gib(budget)} the base can use: block_size={bs}, "
                         f"prefetch={p} ({gib((1 + p) * max(bs * layer, ends))} of base weights at once); "
                         "activations and dequantized weights need room on top, so leave some.")
        else:
            lines.append(f"Even block_size=1, prefetch=0 needs {gib(max(layer, ends))} of base weights at once, "
                         f"more than the {gib(budget)} the base can use: shorten the sequence, lower the "
                         "batch size, or free device memory held elsewhere in the process.")
        return " ".join(lines)

    def chunked_loss(self) -> bool:
        """Whether the model computes its training loss in vocabulary chunks now (``loss.py``)."""
        lm = self.lm_ref() if self.lm_ref is not None else None
        return bool(lm is not None and lm.__dict__.get("_poros_chunked_loss"))

    def forget_plan(self) -> None:
        """Drop the memory budget's plan and the device copies it kept (a new budget plans anew)."""
        residency = self.residency
        for key, tensor in list(residency.resident_cache.items()):
            booked = residency.kept_ids.pop(id(tensor), None)
            if booked is not None:
                del residency.resident_cache[key]
                if booked:
                    residency.ledger.on_evict(nbytes(tensor))
        residency.kept_ids.clear()
        self.budget.kept_hosts = set()
        self.budget.plan, self.budget.measuring = None, False

    def on_eager(self, op: str, loaded: torch.Tensor | None) -> None:
        """``op`` (``poros::load`` / ``poros::gather``) ran as the op's own implementation, not through a
        graph's runtime: a prepared model called without ``torch.compile``, or code Dynamo ran eagerly (a
        graph break, ``torch.compiler.disable``, the recompile limit). A forward run that way with grad enabled
        is refused (``PorosConfigError``): autograd would keep what it loads on the device until the backward,
        unstreamed. Under ``torch.no_grad()`` (evaluation, generation), and for a read outside any module's
        forward (peft inspecting a layer's weight while it attaches an adapter), the loaded tensor is booked
        in the ledger until it is freed."""
        if not self.residency.steps.running and torch.is_grad_enabled() and _in_module_call():
            why = ("the prepared model was called without torch.compile(model, backend='poros')" if not self.schedules
                   else "Dynamo ran part of the step eagerly (a graph break, torch.compiler.disable, or its recompile "
                   "limit: TORCH_LOGS=graph_breaks,recompiles says which), or the prepared model itself was called "
                   "instead of its torch.compile wrapper")
            raise PorosConfigError(
                f"{op} ran outside a poros graph with grad enabled: {why}. A training forward must stream the base: "
                "call torch.compile(model, backend='poros') and train through that, or use poros_fx.hf.PorosTrainer, "
                "poros_fx.PorosSFTTrainer (TRL) or @poros_fx.step; a plain transformers/TRL Trainer on a prepared "
                "model loads the base eagerly. Under torch.no_grad() (evaluation, generation) eager calls are fine.")
        if loaded is not None:
            size = nbytes(loaded)
            self.residency.ledger.on_eager_load(size)
            weakref.finalize(loaded, self.residency.ledger.on_evict, size)


def _in_module_call() -> bool:
    """Whether an ``nn.Module`` call (a forward) is on the Python stack: a base tensor read there feeds the
    forward's autograd graph; one read by setup code outside any forward does not. A parametrized weight's
    read (``torch.nn.utils.parametrize``: NF4 experts) calls its parametrization modules: those calls, and
    the calls inside them, are the read, not a forward."""
    call = torch.nn.Module._call_impl.__code__
    frame = sys._getframe(1)
    forwards = 0
    while frame is not None:
        if frame.f_code is call:
            if isinstance(frame.f_locals.get("self"), parametrize.ParametrizationList):
                forwards = 0
            else:
                forwards += 1
        frame = frame.f_back
    return forwards > 0
