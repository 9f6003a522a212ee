"""The host store: frozen base tensors kept off the compute device, one entry per tensor.

``prepare`` moves every frozen tensor here (a view of one exact-size host arena, page-locked when
the compute device is CUDA) and remembers where it came from, so ``unprepare`` can put it back. The
store also owns the model's residency ledger, the state of the step in flight (``StepState``: one
step at a time) and, for ``stream=False`` graphs, the cache of device copies that stay resident.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from ..errors import PorosConfigError
from ..units import gib
from .arena import HostArena, nbytes
from .ledger import ResidencyLedger

# schedules a store keeps (the most recent): one per graph the backend compiled, which grows only with
# distinct input shapes (Dynamo recompiles at most ``recompile_limit``, 8 by default, per frame) and
# with ``torch._dynamo.reset()``; a dropped schedule stays alive as long as its compiled graph runs
SCHEDULES_KEPT = 32


def cache_key(host: torch.Tensor) -> tuple[Any, ...]:
    """The key of ``host``'s device copy in ``HostStore.resident_cache``: a head chunk's slice is a new
    tensor every run, so address, shape and dtype rather than the tensor."""
    return (host.data_ptr(), tuple(host.shape), host.dtype)


@dataclasses.dataclass(eq=False)
class HostEntry:
    """One frozen tensor in the store."""

    name: str  # qualified name in the model, e.g. model.layers.0.self_attn.q_proj.weight
    host: torch.Tensor  # the host copy every load reads
    origin_device: torch.device  # where it lived before prepare
    blocks: tuple[int, ...]  # the blocks that read it (two for a tied embedding / lm_head)
    store_ref: "weakref.ref[HostStore]" = dataclasses.field(repr=False)  # the store it belongs to (weak: a
    # compiled graph's schedule lists entries, and must not keep an unprepared model's store alive)
    members: tuple[torch.Tensor, ...] = ()  # a decoder layer's block: the host tensors its bytes span

    @property
    def store(self) -> "HostStore | None":
        return self.store_ref()

    @property
    def spans(self) -> bool:
        """A layer's block (a view over other entries' bytes, not counted twice), not a tensor of its own."""
        return bool(self.members)

    @property
    def nbytes(self) -> int:
        return nbytes(self.host)  # the host tensor is a view of the arena


@dataclasses.dataclass(eq=False)
class HostStore:
    """All frozen tensors of one prepared model, and what is known about their blocks."""

    device: torch.device  # compute device
    block_size: int
    prefetch: int | str  # blocks loaded ahead, or "auto" (runtime/depth.py)
    family: Any  # families.Family
    block_names: list[str]  # block index -> name ("embed", "layers.0", "layers.2-3", "head")
    entries: dict[int, HostEntry] = dataclasses.field(default_factory=dict)  # id(host) -> entry
    arena: HostArena | None = None  # the one host allocation every entry's tensor is a view of
    ledger: ResidencyLedger = dataclasses.field(default_factory=ResidencyLedger)
    resident_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)  # stream=False copies
    head_chunks: int = 1  # row chunks the lm_head weight is loaded in
    undo: list[Any] = dataclasses.field(default_factory=list)  # callables that reverse prepare, in order
    followers: list[Any] = dataclasses.field(default_factory=list)  # adapter_hooks.LayerFollower, kept alive here
    # one per graph the backend compiled, the last SCHEDULES_KEPT of them
    schedules: collections.deque[Any] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=SCHEDULES_KEPT))
    steps: "StepState" = dataclasses.field(default_factory=lambda: StepState())  # the step in flight
    split_warned: bool = False  # the backend warned that Dynamo split the step inside the layers
    timing: dict[str, Any] | None = None  # the last measured forward run (prefetch "auto"; runtime/depth.py)
    codegen: str = "eager"  # how compiled regions run: "inductor" | "eager" (prepare's codegen)
    regions: Any = None  # compiler.regions.RegionTable of the decoder layers (None: layers traced inline)
    memory_budget: int | None = None  # bytes the step may use on the device (runtime/budget.py); None: stream all
    budget_request: int | str | None = None  # what was asked for ("24GB", "auto"): a new request plans anew
    budget_source: str | None = None  # how "auto" became memory_budget (runtime/budget.resolve_budget)
    budget_measuring: bool = False  # the first step (fully streamed) is measuring its peak for the plan
    budget_start: int = 0  # bytes allocated when the step in flight started, less its loads' (runtime/budget.py)
    budget_size: int = 0  # input elements of the step being measured
    budget_captures: int = 0  # CUDA graphs captured when the step in flight started (runtime/cuda_graphs.py)
    budget_notes: list[str] = dataclasses.field(default_factory=list)  # the plan's history across re-measurements
    plan: Any = None  # runtime.budget.ResidencyPlan, made after the first step when there is a budget
    kept_hosts: set[int] = dataclasses.field(default_factory=set)  # ids of host tensors the plan keeps resident
    kept_ids: dict[int, bool] = dataclasses.field(default_factory=dict)  # id(device copy) kept -> booked in the ledger
    # turn-around: a training forward's last blocks stay for the backward, which starts with them
    copies_for_backward: dict[tuple[int, ...], list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # host ptrs -> forward copies the backward takes
    stashed_ids: set[int] = dataclasses.field(default_factory=set)  # ids of those copies, booked, not yet evicted
    # and back: a training backward's last blocks stay for the next forward, which starts with them
    copies_for_forward: dict[tuple[int, ...], list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # host ptrs -> backward copies the next forward takes
    forward_stashed_ids: set[int] = dataclasses.field(default_factory=set)  # ids of those copies, booked, not yet evicted
    offload_boundaries: bool = False  # the saved block outputs wait in host memory (options={"offload_boundaries": ...} wins)
    lm_ref: Any = None  # weakref to the prepared *ForCausalLM module (its chunked-loss flag, loss.py)
    offloaded: collections.deque[Any] = dataclasses.field(  # weak refs to the last steps' host copies of them
        default_factory=lambda: collections.deque(maxlen=4096))
    block_major: bool = True  # accumulation steps run block-major (prepare's; options={"block_major": ...} wins)
    accumulation: Any = None  # runtime.accumulate.BlockMajorStep of the optimizer step in flight, if block-major
    block_major_warned: bool = False  # a step ran micro-batch-major instead and said why (once per model)
    region_graphs: Any = None  # runtime.cuda_graphs.RegionGraphs of the region calls (options={"cuda_graphs": True})
    _copy_stream: Any = dataclasses.field(default=None, repr=False)

    def block_bytes(self) -> list[int]:
        """Bytes of base weights each block loads (a tied tensor counts in each block that reads it; a
        layer loaded as one span of the arena counts that span, the alignment gaps between its tensors
        included)."""
        sizes = [0] * len(self.block_names)
        spanned = {id(t) for e in self.entries.values() if e.spans for t in e.members}
        for entry in self.entries.values():
            if id(entry.host) not in spanned:
                for b in entry.blocks:
                    sizes[b] += entry.nbytes
        return sizes

    def tensors(self) -> list[HostEntry]:
        """The entries of the frozen tensors themselves (not the layer blocks spanning them)."""
        return [e for e in self.entries.values() if not e.spans]

    def host_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors())

    def copy_stream(self) -> Any:
        """The CUDA stream every streamed load of this model copies on (created on first use)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def oom_message(self, block: int, nbytes: int, stream: bool) -> str:
        """What to say when loading ``nbytes`` of ``block`` ran out of device memory: the free memory
        measured now, what the base holds of it, and the block size / prefetch that would fit."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        base_now = self.ledger.resident_bytes
        # what a streamed schedule could use for base weights: free memory plus the base bytes held now
        budget = free + cached + base_now
        sizes = self.block_bytes()
        layer = max(sizes[1:-1]) / self.block_size if len(sizes) > 2 else 0
        ends = max(sizes[0], sizes[-1] / self.head_chunks)  # a chunked head holds one chunk at a time
        lines = [f"out of device memory loading {gib(nbytes)} for block {self.block_names[block]!r} "
                 f"(stream={stream}, block_size={self.block_size}, prefetch={self.prefetch}). Measured now: "
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

    def name_of(self, t: torch.Tensor) -> str:
        """The store's name for host tensor ``t`` (its shape when it is not an entry, e.g. a head chunk)."""
        entry = self.entries.get(id(t))
        return entry.name if entry is not None else f"a tensor of shape {tuple(t.shape)}"

    def moved_message(self, names: list[str]) -> str:
        """What to say when base tensors of the store are no longer in host memory (``model.to(device)``
        or ``model.cuda()`` after ``prepare`` moves every parameter, the frozen base included)."""
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"base tensors of this prepared model left the host store ({shown} are not in host memory): "
                "the model was moved (model.to(...) / model.cuda()) after poros_fx.prepare, which copies the whole "
                "frozen base to the device and defeats streaming. prepare already put the adapter and everything "
                "else on the compute device; do not move the model afterwards, or call poros_fx.unprepare(model) "
                "first and prepare it again where it is.")

    def chunked_loss(self) -> bool:
        """Whether the model computes its training loss in vocabulary chunks now (``loss.py``)."""
        lm = self.lm_ref() if self.lm_ref is not None else None
        return bool(lm is not None and lm.__dict__.get("_poros_chunked_loss"))

    def pinned(self) -> bool:
        return self.arena is not None and self.arena.pinned

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the store holds (the arena's exact size; 0 for a CPU compute device)."""
        return self.arena.pinned_bytes if self.arena is not None else 0

    def drop_copies_for_forward(self, key: tuple[int, ...] | None = None) -> None:
        """Give back the copies a backward left for the next forward (``key``: only those of the group at these
        host addresses): a step that measures for the memory budget starts without them, a forward that did
        not take them leaves them here, a backward replaces an earlier one's."""
        for k in list(self.copies_for_forward) if key is None else [key]:
            for t in self.copies_for_forward.pop(k, ()):
                if id(t) in self.forward_stashed_ids:
                    self.forward_stashed_ids.discard(id(t))
                    self.ledger.on_evict(nbytes(t))

    def copies_for_forward_bytes(self, unless: Callable[[torch.Tensor], bool] | None = None) -> int:
        """Device bytes of the copies a backward left for the next forward (those for which ``unless`` is false)."""
        return sum(nbytes(t) for tensors in self.copies_for_forward.values() for t in tensors
                   if unless is None or not unless(t))

    def forget_plan(self) -> None:
        """Drop the memory budget's plan and the device copies it kept (a new budget plans anew)."""
        for key, tensor in list(self.resident_cache.items()):
            booked = self.kept_ids.pop(id(tensor), None)
            if booked is not None:
                del self.resident_cache[key]
                if booked:
                    self.ledger.on_evict(nbytes(tensor))
        self.kept_ids.clear()
        self.kept_hosts = set()
        self.plan, self.budget_measuring = None, False

    def on_eager(self, op: str, loaded: torch.Tensor | None) -> None:
        """``op`` (``poros::load`` / ``poros::gather``) ran as the op's own implementation, not through a
        graph's runtime: a prepared model called without ``torch.compile``, or code Dynamo ran eagerly (a
        graph break, ``torch.compiler.disable``, the recompile limit). A forward run that way with grad enabled
        is refused (``PorosConfigError``): autograd would keep what it loads on the device until the backward,
        unstreamed. Under ``torch.no_grad()`` (evaluation, generation), and for a read outside any module's
        forward (peft inspecting a layer's weight while it attaches an adapter), the loaded tensor is booked
        in the ledger until it is freed."""
        if not self.steps.running and torch.is_grad_enabled() and _in_module_call():
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
            self.ledger.on_eager_load(size)
            weakref.finalize(loaded, self.ledger.on_evict, size)


def _in_module_call() -> bool:
    """Whether an ``nn.Module`` call (a forward) is on the Python stack: a base tensor read there feeds the
    forward's autograd graph; one read by setup code outside any forward does not."""
    call = torch.nn.Module._call_impl.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is call:
            return True
        frame = frame.f_back
    return False


@dataclasses.dataclass(eq=False)
class StepState:
    """One prepared model runs one graph at a time. ``GraphRuntime`` (runtime/executor.py) calls ``begin``
    and ``end`` around every run of a compiled graph of the model, and a graph that starts while another
    graph of the model is running (a second thread on one model) is refused: the runtime's copy stream,
    prefetch groups and ledger are the model's, not the thread's.

    Runs one after the other may interleave freely: a second forward before the first one's backward
    (two losses with one backward, a graph piece Dynamo runs once per layer after a graph break) is
    exact, because everything a forward hands its backward (boundary activations, RNG states) is that
    call's own output, saved by autograd with it, and each run's loads end with the run.
    """

    running: int = 0  # graphs of this model running now
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def begin(self) -> None:
        with self._lock:  # two threads must not both see 0 and both start
            if self.running:
                raise PorosConfigError("a compiled graph of this prepared model started while another one was still "
                                       "running (two threads using one model?): one prepared model runs one step at "
                                       "a time; give each thread its own model, or serialize the steps")
            self.running += 1

    def end(self) -> None:
        with self._lock:
            self.running -= 1
