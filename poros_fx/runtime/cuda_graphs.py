"""CUDA graphs of region calls: a step's region kernels launched by one replay each, not one by one from Python.

A streamed 7B step launches ~6,000 kernels from Python and the GPU waits for them (docs/benchmarks.md).
With ``options={"cuda_graphs": True}`` each call of a compiled region (a decoder layer's forward, its
recompute, its backward) is captured once into a ``torch.cuda.CUDAGraph`` and replayed afterwards: the
same kernels on the same inputs, so the same bits, for one launch.

**Sites and chains.** A *site* is one region call of one compiled graph (the node that calls it). The
region calls of one run of an outer graph (a step's forward, or its backward) form a *chain*, keyed by
the run's input sizes and the host values its first region call reads (the CPU scalar that picks the
attention kernel); every graph of a chain is captured in the run that records it, in call order, into
one memory pool the model's chains share. A chain runs uncaptured ``WARMUP_RUNS`` times (Inductor
loads and autotunes its kernels on a first call; capturing that would fail), is recorded on the next
run (each call captured, then replayed for its real outputs) and replayed from then on::

    run 1 (warmup):  forward region layers.0 .. layers.N uncaptured
    run 2 (record):  capture layers.0, replay it; capture layers.1, replay it; ...
    run 3, 4, ...:   copy the inputs that moved into the graphs' own buffers; replay layers.0, layers.1, ...

**Memory.** A graph writes where its capture allocated. Replays hand out tensors over those bytes that
the allocator does not know about, so two rules keep them from being overwritten while in use: (1) a
pool allocation is made only while recording, when nothing replayed is alive; (2) at the end of every
outer run the tensors it returns that lie in the pool (a forward's saved boundary activations, a
backward's adapter gradients) are copied out (``end``), so the pool is dead between runs and any chain
may replay next. Within a run the calls free their tensors where the recording run did (the outer graph
is straight-line code, run boxed), so a replay finds its bytes as its capture left them.

**Inputs.** Each tensor input of a captured call is read in place (*direct*: an adapter parameter, a block
kept resident, a streamed block's load, which lands in a fixed slot (``runtime/load_slots.py``), an earlier
replay's output: the same address every run) or copied into the graph's own buffer before the replay
(*copy*: a mask, the embedding's output: a new tensor every run). A CPU tensor (a host scalar the region
branches on) keys the graph by its values. A replay whose key was never recorded, or whose direct input
moved, runs uncaptured instead (counted in ``stats()["cuda_graphs"]["fallbacks"]``): the same kernels, so
still exact, only slower. A chain whose direct input moved is recorded again on its next run, up to
``RERECORDS`` times (``rerecorded``): a memory budget's plan that changed moves the blocks it keeps, and
the step after one that measured for the budget takes the load slots in another order than the steps
after it (it starts without the blocks the backward before it would have left on the device).

Not captured: block-major accumulation steps (``runtime/accumulate.py`` runs several micro-batches'
calls interleaved) and boundary offloading (``passes/offload.py``: the copy stream reads a saved tensor
after the run). The pool is not counted by ``torch.cuda.max_memory_allocated`` while graphs replay;
``pool_bytes`` is what it holds.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from typing import Any, Callable

import torch

from .load_slots import LoadSlots

logger = logging.getLogger("poros_fx")

WARMUP_RUNS = 1  # uncaptured runs of a chain before it is recorded
RERECORDS = 2  # times a chain is recorded again after a replay found an input it reads in place elsewhere
MAX_CHAINS = 16  # chains recorded per model (sizes x host values x graphs); runs of any other run uncaptured
HOST_VALUES = 16  # a CPU tensor input up to this many elements keys a graph by its values; a larger one is not captured

DIRECT, COPY, HOST, OTHER = "direct", "copy", "host", "other"


class CaptureRefused(Exception):
    """A call whose inputs a graph cannot take (a large CPU tensor)."""


@dataclasses.dataclass
class InputSlot:
    """How a captured call takes one input."""

    kind: str  # DIRECT, COPY, HOST or OTHER (not a tensor: passed as it is)
    ptr: int = 0  # DIRECT: the address the graph reads
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    buffer: torch.Tensor | None = None  # COPY: a tensor over the graph's own input buffer (not owning it)


@dataclasses.dataclass
class OutputSlot:
    """Where a captured call's output lies: in the pool (``tensor`` views it, not owning it) or in the
    storage of input ``source`` (a view of a direct input)."""

    source: int  # -1: the pool
    tensor: torch.Tensor | None = None
    offset: int = 0
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


@dataclasses.dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[InputSlot]
    outputs: list[OutputSlot]
    pool_storages: frozenset[int]  # data pointers of the pool storages its outputs lie in


@dataclasses.dataclass
class Chain:
    runs: int = 0  # runs seen (warmup, then the recording one)
    broken: str | None = None  # why it runs uncaptured for good (a capture failed)
    moved: bool = False  # a replay found an input the graphs read in place at another address
    rerecords: int = 0  # times it was recorded again for that
    graphs: dict[Any, Captured] = dataclasses.field(default_factory=dict)  # (site, host values) -> graph


@dataclasses.dataclass
class Counters:
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0  # region calls of a recorded chain run uncaptured
    uncaptured: int = 0  # region calls of a chain warming up, broken or beyond MAX_CHAINS
    copied_bytes: int = 0  # input bytes copied into graphs' buffers before replays
    escaped: int = 0  # pool tensors an outer run returned, copied out
    rerecorded: int = 0  # chains recorded again because inputs read in place had moved


@dataclasses.dataclass
class Run:
    """One outer graph run in flight."""

    key: Any  # the outer graph and its inputs' sizes
    is_resident: Callable[[torch.Tensor], bool]  # a tensor the runtime keeps at one address (a kept block)
    chain: Chain | None = None
    mode: str = ""  # "uncaptured", "record" or "replay", decided at the first region call
    pool_storages: set[int] = dataclasses.field(default_factory=set)


class CudaGraphs:
    """What ``RegionGraphs`` asks of CUDA: capture a call into a graph of one pool, replay it, the pool's size.
    (A stand-in with the same three methods lets the CPU tests drive ``RegionGraphs``' bookkeeping.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # captures run on a side stream, as torch.cuda.graph's do
        self.graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the live graphs, reset by the finalizer
        # the graphs go while CUDA and the kernels they launch are still loaded: when this is freed, or at
        # interpreter exit (a finalizer runs before teardown), never in teardown's own order
        weakref.finalize(self, _reset_graphs, self.graphs, self.index)

    def capture(self, make_inputs: Callable[[], list], fn: Callable[[list], list]) -> tuple[Any, list, list]:
        """A graph of ``fn(make_inputs())`` (allocated in the pool), with the inputs and outputs it was captured
        with; the random generator is left as it was (a capture draws nothing)."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        rng = torch.cuda.get_rng_state(self.index)
        self.stream.wait_stream(current)
        # no garbage collection inside a capture: one that frees a dead model's page-locked arena unregisters
        # host memory, which invalidates the capture (and leaves the generator in capture mode); the H200
        # parity tests failed so, once in a few runs, after an earlier model of the same test became garbage
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's workspace for this stream comes from the pool
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    inputs = make_inputs()
                    outputs = fn(list(inputs))
                finally:
                    graph.capture_end()
                torch._C._cuda_clearCublasWorkspaces()
        finally:
            if collecting:
                gc.enable()
            current.wait_stream(self.stream)
            torch.cuda.set_rng_state(rng, self.index)
        self.graphs.add(graph)
        return graph, inputs, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def pool_bytes(self) -> int:
        pool = tuple(self.pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", ())) == pool and s.get("device") == self.index)


def _reset_graphs(graphs: "weakref.WeakSet[Any]", device_index: int) -> None:
    """Free the CUDA graphs still alive in ``graphs`` (and what they hold of the pool) now."""
    live = list(graphs)
    if live and torch.cuda.is_initialized():
        torch.cuda.synchronize(device_index)
        for graph in live:
            graph.reset()
    graphs.clear()


class RegionGraphs:
    """The CUDA graphs of one prepared model's region calls, in one memory pool (``backend``: ``CudaGraphs``)."""

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        self.device = device
        self.backend = backend if backend is not None else CudaGraphs(device)
        self.chains: dict[Any, Chain] = {}
        self.counters = Counters()
        self.run: Run | None = None
        self.warned: set[str] = set()
        self.load_slots = LoadSlots()  # where streamed layer blocks land, so replays read them in place
        self._pool_bytes = (0, 0)  # (captures when measured, bytes)

    # -- the outer run ------------------------------------------------------------------------------------

    def around(self, key: Any, is_resident: Callable[[torch.Tensor], bool], run: Callable[[], Any]) -> Any:
        """``run()`` (an outer graph's run, keyed by ``key``) with its region calls captured and replayed;
        its outputs that lie in the pool come back as copies (``end``)."""
        self.begin(key, is_resident)
        try:
            out = run()
        except BaseException:
            self.abandon()
            raise
        return self.end(out)

    def begin(self, key: Any, is_resident: Callable[[torch.Tensor], bool]) -> None:
        self.run = Run(key, is_resident)

    def end(self, outputs: Any) -> Any:
        """``outputs`` with every tensor that lies in the pool replaced by a copy (aliases kept together)."""
        run, self.run = self.run, None
        if run is None or not run.pool_storages or not isinstance(outputs, (list, tuple)):
            return outputs
        copies: dict[int, Any] = {}
        out = list(outputs)
        for i, o in enumerate(out):
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in run.pool_storages:
                continue
            copy = copies.get(ptr)
            if copy is None:
                copy = copies[ptr] = storage.clone()
                self.counters.escaped += 1
            out[i] = _on(copy, o.storage_offset(), o.shape, o.stride(), o.dtype)
        return type(outputs)(out) if isinstance(outputs, tuple) else out

    def abandon(self) -> None:
        """The outer run raised: nothing of it is replayed into."""
        self.run = None

    # -- a region call --------------------------------------------------------------------------------------

    def call(self, site: str, fn: Callable[[list], list], inputs: list) -> list:
        run = self.run
        if run is None:  # not inside a run the runtime captures (block-major accumulation)
            return fn(inputs)
        if not run.mode:
            self._start(run, inputs)
        if run.mode == "uncaptured":
            self.counters.uncaptured += 1
            return fn(inputs)
        try:
            key = (site, _host_values(inputs, self.device))
        except CaptureRefused as e:
            self.warn_once("refused", f"region call {site} runs uncaptured: {e} (said once)")
            self.counters.fallbacks += 1
            return fn(inputs)
        if run.mode == "record":
            return self._record(run, key, fn, inputs)
        captured = run.chain.graphs.get(key)
        if captured is None or not self._fits(captured, inputs):
            if captured is not None and _moved(captured, inputs):
                run.chain.moved = True  # recorded again on its next run (``_start``)
            self.warn_once("fallback", f"region call {site} runs uncaptured: its inputs are not where its graph was "
                                   "recorded (a new host value, or a tensor that moved); said once, counted in "
                                   "stats()['cuda_graphs']['fallbacks']")
            self.counters.fallbacks += 1
            return fn(inputs)
        return self._replay(run, captured, inputs)

    def _start(self, run: Run, inputs: list) -> None:
        """Pick the run's chain at its first region call, and whether it warms up, records or replays."""
        try:
            key = (run.key, _host_values(inputs, self.device))
        except CaptureRefused:
            run.mode = "uncaptured"
            return
        chain = self.chains.get(key)
        if chain is None:
            if len(self.chains) >= MAX_CHAINS:
                self.warn_once("chains", f"more than {MAX_CHAINS} input shapes: new ones run without CUDA graphs")
                run.mode = "uncaptured"
                return
            chain = self.chains[key] = Chain()
        run.chain = chain
        if chain.broken is not None:
            run.mode = "uncaptured"
        elif chain.graphs and chain.moved and chain.rerecords < RERECORDS:
            # what it reads in place lies elsewhere now and stays there (a memory budget's plan changed, the
            # load slots are taken in another order after a step that measured for the budget): record anew
            chain.graphs.clear()
            chain.moved = False
            chain.rerecords += 1
            self.counters.rerecorded += 1
            run.mode = "record"
        elif chain.graphs:
            run.mode = "replay"
        else:
            chain.runs += 1
            run.mode = "record" if chain.runs > WARMUP_RUNS else "uncaptured"

    def _record(self, run: Run, key: Any, fn: Callable[[list], list], inputs: list) -> list:
        slots = [self._slot(run, t) for t in inputs]

        def make_inputs() -> list:  # inside the capture: the graph's own buffers come from its pool
            return [_unfilled(t) if slot.kind == COPY else t for t, slot in zip(inputs, slots)]

        try:
            graph, call_inputs, outputs = self.backend.capture(make_inputs, fn)
        except Exception as e:  # a kernel that cannot be captured: this chain runs uncaptured from now on
            self._break(run, f"{type(e).__name__}: {e}")
            self.counters.uncaptured += 1
            return fn(inputs)
        for t, slot, buffer in zip(inputs, slots, call_inputs):
            if slot.kind == COPY:
                slot.buffer = _alias(buffer)
                _fill(buffer, t)
        self.backend.replay(graph)
        self.counters.captures += 1
        try:
            captured = self._describe(graph, inputs, slots, outputs)
        except CaptureRefused as e:  # its outputs are real (the replay made them), later runs go uncaptured
            self._break(run, str(e))
            return outputs
        run.chain.graphs[key] = captured
        run.pool_storages |= captured.pool_storages
        return outputs

    def _break(self, run: Run, reason: str) -> None:
        run.chain.broken = reason
        run.chain.graphs.clear()
        run.mode = "uncaptured"
        self.warn_once("broken", f"a region call could not be captured in a CUDA graph; runs of this shape go without "
                             f"graphs ({reason})")

    def _slot(self, run: Run, t: Any) -> InputSlot:
        if not isinstance(t, torch.Tensor):
            return InputSlot(OTHER)
        if t.device != self.device:
            return InputSlot(HOST)
        shape, stride = tuple(t.shape), tuple(t.stride())
        if ((t.requires_grad and t.is_leaf) or t.untyped_storage().data_ptr() in run.pool_storages
                or run.is_resident(t)):
            return InputSlot(DIRECT, t.data_ptr(), shape, stride, t.dtype)
        return InputSlot(COPY, 0, shape, stride, t.dtype)

    def _describe(self, graph: Any, inputs: list, slots: list[InputSlot], outputs: list) -> Captured:
        # an output may be (a view of) an input the graph reads in place: rebuilt over that input at each replay
        passed = {t.untyped_storage().data_ptr(): j for j, (t, s) in enumerate(zip(inputs, slots))
                  if s.kind in (DIRECT, HOST)}
        described, pool = [], set()
        for o in outputs:
            if not isinstance(o, torch.Tensor):
                described.append(OutputSlot(-2))
                continue
            ptr = o.untyped_storage().data_ptr()
            place = dict(offset=o.storage_offset(), shape=tuple(o.shape), stride=tuple(o.stride()), dtype=o.dtype)
            if ptr in passed:
                described.append(OutputSlot(passed[ptr], **place))
                continue
            if o.device != self.device:
                raise CaptureRefused(f"the region makes a tensor on {o.device} (a replay would not remake it)")
            pool.add(ptr)
            described.append(OutputSlot(-1, _alias(o), **place))
        return Captured(graph, slots, described, frozenset(pool))

    def _fits(self, captured: Captured, inputs: list) -> bool:
        if len(inputs) != len(captured.inputs):
            return False
        for t, slot in zip(inputs, captured.inputs):
            if slot.kind == DIRECT:
                if (t.data_ptr() != slot.ptr or t.shape != slot.shape or t.stride() != slot.stride
                        or t.dtype != slot.dtype):
                    return False
            elif slot.kind == COPY:  # copy_ would broadcast or convert what does not match: never let it
                if t.shape != slot.shape or t.stride() != slot.stride or t.dtype != slot.dtype:
                    return False
        return True

    def _replay(self, run: Run, captured: Captured, inputs: list) -> list:
        copied = 0
        for t, slot in zip(inputs, captured.inputs):
            if slot.kind == COPY:
                _fill(slot.buffer, t)
                copied += t.nbytes
        passed = {s.source: inputs[s.source].untyped_storage() for s in captured.outputs if s.source >= 0}
        inputs.clear()  # boxed: the caller's list is released, as an uncaptured call releases it
        self.backend.replay(captured.graph)
        self.counters.replays += 1
        self.counters.copied_bytes += copied
        run.pool_storages |= captured.pool_storages
        out: list[Any] = []
        for slot in captured.outputs:
            if slot.source == -1:
                out.append(slot.tensor)
            elif slot.source == -2:
                out.append(None)
            else:
                out.append(_on(passed[slot.source], slot.offset, slot.shape, slot.stride, slot.dtype))
        return out

    def pool_bytes(self) -> int:
        """Device bytes the pool holds (its reserved segments; they change only while recording), 0 before
        anything was captured."""
        if not self.counters.captures:
            return 0
        if self._pool_bytes[0] != self.counters.captures:
            self._pool_bytes = (self.counters.captures, self.backend.pool_bytes())
        return self._pool_bytes[1]

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.counters)
        out.update(chains=len(self.chains), recorded=sum(1 for c in self.chains.values() if c.graphs),
                   broken=[c.broken for c in self.chains.values() if c.broken], pool_bytes=self.pool_bytes(),
                   load_slots=self.load_slots.as_dict())
        return out

    def warn_once(self, kind: str, message: str) -> None:
        """Log ``message`` the first time something of ``kind`` happens (a fallback, a broken chain, a
        block-major run the runtime does not hand to the graphs)."""
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning("poros: %s", message)


def _moved(captured: Captured, inputs: list) -> bool:
    """Whether an input ``captured`` reads in place is at another address now (same shape and dtype)."""
    return any(slot.kind == DIRECT and t.data_ptr() != slot.ptr and t.shape == slot.shape and t.dtype == slot.dtype
               for t, slot in zip(inputs, captured.inputs))


def _unfilled(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor laid out as ``t``. Not ``torch.empty``: under deterministic algorithms it
    fills new memory with NaN, and inside a capture that fill would be part of the graph, replayed after
    the input was copied in."""
    return _on(torch.UntypedStorage(_span(t) * t.element_size(), device=t.device), 0, t.shape, t.stride(), t.dtype)


def _fill(buffer: torch.Tensor, t: torch.Tensor) -> None:
    """``t``'s values into ``buffer``, laid out alike. Where elements share memory (an expanded mask or
    position tensor: a stride of 0) ``copy_`` refuses to write element by element, so the storage span
    they lie in is copied instead: the same values at the same places."""
    if not torch._debug_has_internal_overlap(buffer):
        buffer.copy_(t)
        return
    span = _span(t)
    _on(buffer.untyped_storage(), buffer.storage_offset(), (span,), (1,), t.dtype).copy_(t.as_strided((span,), (1,)))


def _span(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first element to its last."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s bytes that does not own them (they stay the pool's once ``t`` is freed)."""
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                            t.untyped_storage().nbytes())
    return _on(storage, t.storage_offset(), t.shape, t.stride(), t.dtype)


def _on(storage: Any, offset: int, shape: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``storage`` at ``offset`` (elements) with ``shape`` and ``stride``."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def _host_values(inputs: list, device: torch.device) -> tuple:
    """The values of the tensors among ``inputs`` that are not on ``device`` (CPU scalars: what a captured
    graph decided on the host)."""
    values = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.device != device:
            if t.numel() > HOST_VALUES:
                raise CaptureRefused(f"a CPU tensor input of {t.numel()} elements")
            values.append((t.dtype, tuple(t.shape), tuple(t.reshape(-1).tolist())))
    return tuple(values)


def graph_site(runner: Callable[..., list], graphs: "weakref.ReferenceType[RegionGraphs]", site: str) -> Callable[..., list]:
    """``runner`` (a region's forward or backward, ``compiler/regions/ops.runners``) with its calls captured
    and replayed by ``graphs`` as ``site``."""

    def call(inputs: list, *rest: Any) -> list:
        found = graphs()
        if found is None:
            return runner(inputs, *rest)
        return found.call(site, lambda ins: runner(ins, *rest), inputs)

    call.__name__ = call.__qualname__ = f"graphed_{runner.__name__}"
    return call
