"""The graph runtime: the functions the residency pass puts into the forward and backward graphs.

``GraphRuntime.load_group`` copies one prefetch group (a block's base tensors) to the device: one
device buffer, one copy per contiguous range of host memory (the store's arena keeps a block's
tensors side by side, so a block is one copy, not one per tensor: a 7B step made 2,252 copy calls
and allocations before, 68 now, and the step is bound by the CPU launching work); the group's layout
in that buffer (``GroupPlan``) is worked out on its first load and reused. ``load`` hands out
one tensor of that group (a view of the buffer) and books it in the ledger; ``wait`` makes the compute
stream wait for the group's copy just before the tensor's first reader; ``evict`` books it out at its
last use (the buffer goes when the graph drops the group's last tensor). With ``stream=False`` a
load copies its tensor alone and keeps it resident in the store's cache, and no evicts are
scheduled: the same graphs, with the base resident.

On CUDA the copies run on the store's copy stream. The prefetch pass issues a block's loads one
group ahead of the block that reads them, so they overlap the compute in between:

    compute stream:  ... block k-1 | ready |     block k      | wait(k+1) | block k+1 ...
    copy stream:                      wait ready -> copy k+1 -> done
                                                            (compute waits for done)

A load's device buffer is allocated on the compute stream, so the allocator may hand out memory that
compute-stream work already enqueued still reads or writes; the copy stream therefore first waits for
the compute stream to reach the load (``ready``), and never writes a buffer a live activation uses.
Nothing of the base is ever copied device to host.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from typing import Any, Callable

import torch

from ..errors import PorosConfigError, PorosOOMError
from .arena import ALIGN, nbytes
from . import budget, draws
from .depth import summarize_timing
from .load_slots import LoadSlots
from .lockstep import Lockstep
from .residency import cache_key
from .store import HostStore

RUN_GAP = 256 * 2**10  # host bytes a copy may span that no load reads, rather than start another copy


def host_runs(hosts: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int, list[int]]]:
    """``hosts`` as contiguous host ranges: (a tensor of the range's storage, first byte, end byte,
    indices of the hosts in it), in address order. Ranges of one storage less than ``RUN_GAP`` apart
    merge; a non-contiguous host is a range of its own (copied as a tensor, not as bytes)."""
    runs: list[tuple[torch.Tensor, int, int, list[int]]] = []
    for i in sorted(range(len(hosts)), key=lambda i: hosts[i].data_ptr()):
        h = hosts[i]
        start, end = h.data_ptr(), h.data_ptr() + nbytes(h)
        last = runs[-1] if runs else None
        if (last is not None and h.is_contiguous() and last[0].is_contiguous() and start - last[2] <= RUN_GAP
                and h.untyped_storage().data_ptr() == last[0].untyped_storage().data_ptr()):
            runs[-1] = (last[0], last[1], max(last[2], end), [*last[3], i])
        else:
            runs.append((h, start, end, [i]))
    return runs


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """How one prefetch group's host tensors land in its device buffer: worked out on the group's
    first load and reused by every later one (the hosts are the store's, fixed for a graph's life),
    so a load costs the copies and one ``as_strided`` per tensor, not the layout's Python again."""

    size: int  # bytes of the device buffer's used part (a multiple of 16, so every dtype views it)
    ranges: tuple[tuple[torch.Tensor, int], ...]  # (a host range as bytes, its offset in the buffer)
    views: tuple[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]] | None, ...]  # per host
    strided: tuple[tuple[int, torch.Tensor], ...]  # (host index, host): copied as a tensor of its own
    dtypes: tuple[torch.dtype, ...]
    copied_bytes: int


def plan_group(hosts: list[torch.Tensor]) -> GroupPlan:
    """The buffer layout of ``hosts``: each host range (``host_runs``) at an offset with the same
    remainder mod ``ALIGN`` as its host address, so every tensor keeps its host alignment (the arena's 512 B)."""
    ranges, strided, size = [], [], 0
    views: list[Any] = [None] * len(hosts)
    for first, start, end, members in host_runs(hosts):
        if not first.is_contiguous():
            strided.append((members[0], first.detach()))
            continue
        offset = -(-size // ALIGN) * ALIGN + start % ALIGN
        storage = first.untyped_storage()
        ranges.append((torch.empty(0, dtype=torch.uint8).set_(storage, start - storage.data_ptr(), (end - start,)),
                       offset))
        for i in members:
            h = hosts[i]
            views[i] = (offset + h.data_ptr() - start, h.dtype, tuple(h.shape), tuple(h.stride()))
        size = offset + end - start
    dtypes = tuple({v[1] for v in views if v is not None})
    copied = sum(src.numel() for src, _ in ranges) + sum(nbytes(h) for _, h in strided)
    return GroupPlan(-(-size // 16) * 16, tuple(ranges), tuple(views), tuple(strided), dtypes, copied)


class GraphRuntime:
    def __init__(self, store: HostStore | None, stream: bool, phase: str, measure: bool = False,
                 reused_by_backward: frozenset[int] = frozenset(), schedule: Any = None, training: bool = False,
                 reused_by_forward: frozenset[int] = frozenset()) -> None:
        # weak: Dynamo's cache holds the compiled graph, which must not keep an unprepared or freed model's
        # store (its whole pinned base) alive
        self._store_ref = weakref.ref(store) if store is not None else None
        self.stream = stream
        self.phase = phase
        self.schedule = schedule  # compiler.schedule.Schedule of the graph (its forward and backward share it)
        # a training graph that streams: an optimizer step's micro-batches may run it together
        # (runtime/accumulate.py), unless options={"block_major": False}
        wanted = schedule.options.block_major if schedule is not None else None
        self.training = training  # a training graph (its forward has a backward)
        self._data_positions: tuple[int, ...] | None = None  # arguments that are the run's own inputs
        self.block_major = (stream and training and store is not None
                            and (store.block_major if wanted is None else wanted))
        self.graph_module: Any = None  # the graph ``wrap`` runs (lockstep plans read it)
        self.num_outputs = 0
        self._lockstep: dict[Any, Any] = {}  # (phase, per-micro-batch inputs) -> lockstep plan
        # forward blocks whose copies stay for the backward, which starts with them (turn-around)
        self.reused_by_backward = reused_by_backward
        # backward blocks whose copies stay for the next forward, which starts with them (the other way round)
        self.reused_by_forward = reused_by_forward
        self._left: tuple[set[int], frozenset[int]] | None = None  # (the plan's kept hosts, _left_for_forward())
        self.overlap = stream and store is not None and store.device.type == "cuda"
        # time the first run's copies and blocks with CUDA events (prefetch "auto", runtime/depth.py)
        self.measure = measure and self.overlap
        self._copy_times: list[tuple[Any, Any]] = []  # (start, done) on the copy stream, per group
        self._wait_times: list[tuple[Any, Any]] = []  # (before, after) each group's wait, compute stream
        self._blocks_loaded: set[int] = set()
        self._group: list[torch.Tensor] = []  # loads issued since the group's ready event
        self._pending: dict[int, Any] = {}  # id(device copy) -> the copy stream's done event
        self._waited: Any = None  # the done event the compute stream waited for last
        self._plans: dict[tuple[int, ...], GroupPlan] = {}  # host addresses of a group -> its layout
        self._draws: Any = None  # (a forward's draws in its symbols, how a run binds them, the last binding's)
        # region calls go through CUDA graphs (options={"cuda_graphs": True}, runtime/cuda_graphs.py)
        self.cuda_graphs = bool(schedule is not None and schedule.options.cuda_graphs)
        self._graph_key = object()  # this graph, in the keys of its runs' graphs

    @property
    def store(self) -> HostStore | None:
        if self._store_ref is None:
            return None
        store = self._store_ref()
        if store is None:
            raise PorosConfigError("a compiled graph of a prepared model ran after the model was unprepared or freed; "
                                   "compile the model again (torch.compile(model, backend='poros'))")
        return store

    def load_group(self, hosts: list[torch.Tensor], device: torch.device, block: int) -> list[torch.Tensor]:
        """Device copies of ``hosts`` (one prefetch group), as views of one new device buffer laid out
        by the group's ``GroupPlan``; or the copies the other phase left on the device (turn-around: a
        backward takes its forward's last blocks, a forward the last blocks of the backward before it)."""
        store = self.store
        kept = self.stream and bool(store.budget.kept_hosts) and all(id(h) in store.budget.kept_hosts for h in hosts)
        if kept:  # a block the memory budget keeps resident (runtime/budget.py): copied once, then reused
            cached = [store.residency.resident_cache.get(cache_key(h)) for h in hosts]
            if all(t is not None for t in cached):
                return cached
        key = tuple(h.data_ptr() for h in hosts)
        stash = store.residency.copies_for_backward if self.phase == "backward" else store.residency.copies_for_forward
        out = stash.pop(key, None) if stash and not kept else None
        if out is None:
            out = self._copy_group(hosts, device, block, key, self._slots_for(block, kept))
        if kept:
            for h, t in zip(hosts, out):
                store.residency.resident_cache[cache_key(h)] = t
                store.residency.kept_ids[id(t)] = False
        elif block in self.reused_by_backward or (self.phase == "backward" and block in self._left_for_forward()):
            self._leave_turnaround(key, block, out)
        return out

    def _leave_turnaround(self, key: tuple[int, ...], block: int, out: list[torch.Tensor]) -> None:
        """Keep ``out`` (block ``block``'s copies) for the other phase when it starts with this block."""
        store = self.store
        if self.phase == "forward" and block in self.reused_by_backward:
            self._release(store.residency.copies_for_backward.pop(key, ()))  # an earlier forward's, never taken
            store.residency.copies_for_backward[key] = out
            store.residency.stashed_ids.update(id(t) for t in out)
        elif self.phase == "backward" and block in self._left_for_forward() and not store.budget.measuring:
            store.residency.drop_copies_for_forward(key)  # an earlier backward's, never taken
            store.residency.copies_for_forward[key] = out
            store.residency.forward_stashed_ids.update(id(t) for t in out)

    def _left_for_forward(self) -> frozenset[int]:
        """The blocks this backward leaves for the next forward: the first ``len(reused_by_forward)`` layer
        blocks the memory budget does not keep. A kept block stays anyway, so the next streamed one takes its
        place: the forward's first window then holds as many blocks as without a plan, and starts with one
        copy fewer. Made again when the plan changes (``kept_hosts`` is then a new set)."""
        store = self.store
        if self._left is not None and self._left[0] is store.budget.kept_hosts:
            return self._left[1]
        count = len(self.reused_by_forward)
        kept = set(store.budget.plan.resident_blocks) if store.budget.kept_hosts and store.budget.plan is not None else set()
        streamed = [b for b in range(1, len(store.host.block_names) - 1) if store.host.block_names[b] not in kept]
        left = frozenset(streamed[:count])
        self._left = (store.budget.kept_hosts, left)
        return left

    def _slots_for(self, block: int, kept: bool) -> LoadSlots | None:
        """The model's load slots (``runtime/load_slots.py``) when a load of ``block`` lands in one: a streamed
        layer block of a graph whose region calls CUDA graphs replay, so they read it where it lies."""
        if not self.cuda_graphs or kept or not self.stream:
            return None
        graphs = self.store.residency.region_graphs
        if graphs is None or not self.store.host.block_names[block].startswith("layers"):
            return None  # the head and the embedding are not read by region calls
        return graphs.load_slots

    def _copy_group(self, hosts: list[torch.Tensor], device: torch.device, block: int,
                    key: tuple[int, ...], slots: LoadSlots | None = None) -> list[torch.Tensor]:
        plan = self._plans.get(key)  # key: the hosts' addresses
        if plan is None:
            moved = [self.store.host.name_of(h) for h in hosts if h.device.type != "cpu"]
            if moved:
                raise PorosConfigError(self.store.host.moved_message(moved))
            plan = self._plans[key] = plan_group(hosts)
        size = plan.size + ALIGN
        buffer = slots.take(size, lambda n: self._allocate((n,), (1,), torch.uint8, device, block)) if slots else None
        if buffer is None:
            buffer = self._allocate((size,), (1,), torch.uint8, device, block)
        shift = -buffer.data_ptr() % ALIGN  # CUDA allocations start on 512 B already; CPU ones on 64
        typed = {dtype: buffer[shift:shift + plan.size].view(dtype) for dtype in plan.dtypes}
        out: list[Any] = [None if v is None else typed[v[1]].as_strided(v[2], v[3], (shift + v[0]) // v[1].itemsize)
                          for v in plan.views]
        copies = [(buffer[shift + offset:shift + offset + src.numel()], src) for src, offset in plan.ranges]
        for i, host in plan.strided:
            out[i] = self._allocate(host.shape, host.stride(), host.dtype, device, block)
            copies.append((out[i], host))
        if self.overlap:
            copy_stream = self.store.copy_stream()
            copy_stream.wait_event(torch.cuda.current_stream(device).record_event())
            copy_start = self._timing_event(copy_stream)
            with torch.cuda.stream(copy_stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
            done = self._timing_event(copy_stream) if self.measure else copy_stream.record_event()
            if self.measure:
                self._copy_times.append((copy_start, done))
            self._pending.update((id(t), done) for t in out)
        else:
            for dst, src in copies:
                dst.copy_(src)
        self.store.residency.ledger.on_copy(len(copies), plan.copied_bytes)
        return out

    def load(self, host: torch.Tensor, device: torch.device, block: int, last_in_group: bool = True,
             group: list[torch.Tensor] | None = None, index: int = 0) -> torch.Tensor:
        """The device copy of ``host``: tensor ``index`` of ``group`` (``load_group``'s result), or,
        without a group, a copy of its own (``stream=False``: made once and kept resident)."""
        if group is not None:
            out = group[index]
            if self.phase == "backward" and id(out) in self.store.residency.stashed_ids:
                self.store.residency.stashed_ids.discard(id(out))  # booked by the forward; the backward evicts it
                self._blocks_loaded.add(block)
                return out
            if self.phase == "forward" and id(out) in self.store.residency.forward_stashed_ids:
                self.store.residency.forward_stashed_ids.discard(id(out))  # booked by the backward; the forward evicts it
                self._blocks_loaded.add(block)
                return out
            booked = self.store.residency.kept_ids.get(id(out))
            if booked is None or not booked:  # a kept tensor is on the device once, and booked once
                self.store.residency.ledger.on_load(nbytes(out))
                if booked is False:
                    self.store.residency.kept_ids[id(out)] = True
            self._blocks_loaded.add(block)
            return out
        if not self.stream:
            key = cache_key(host)
            cached = self.store.residency.resident_cache.get(key)
            if cached is None:
                cached = self._allocate(host.shape, host.stride(), host.dtype, device, block)
                cached.copy_(host.detach())
                self.store.residency.resident_cache[key] = cached
                self.store.residency.ledger.on_load(nbytes(cached))
                self.store.residency.ledger.on_copy(1, nbytes(cached))
            return cached
        out = self._allocate(host.shape, host.stride(), host.dtype, device, block)
        if self.overlap:
            copy_stream = self.store.copy_stream()
            if not self._group:
                copy_stream.wait_event(torch.cuda.current_stream(device).record_event())
            with torch.cuda.stream(copy_stream):
                out.copy_(host.detach(), non_blocking=True)
            self._group.append(out)
            if last_in_group:
                done = copy_stream.record_event()
                self._pending.update((id(t), done) for t in self._group)
                self._group = []
        else:
            out.copy_(host.detach())
        self.store.residency.ledger.on_load(nbytes(out))
        self.store.residency.ledger.on_copy(1, nbytes(out))
        self._blocks_loaded.add(block)
        return out

    def wait(self, loaded: torch.Tensor) -> torch.Tensor:
        """``loaded``, once its copy has landed (the compute stream waits for the copy's group)."""
        done = self._pending.pop(id(loaded), None)
        if done is not None and done is not self._waited:
            compute = torch.cuda.current_stream(loaded.device)
            before = self._timing_event(compute)
            compute.wait_event(done)
            if self.measure:
                self._wait_times.append((before, self._timing_event(compute)))
            self._waited = done
        return loaded

    def offload(self, saved: torch.Tensor) -> torch.Tensor:
        """A host copy of ``saved``, a boundary activation the backward reads (``passes/offload.py``): on
        CUDA a page-locked tensor filled by the copy stream once the compute stream has made ``saved``
        (the device memory is not reused before the copy read it); on the CPU a separate tensor."""
        store = self.store
        if saved.device.type == "cuda":
            host = torch.empty_strided(saved.shape, saved.stride(), dtype=saved.dtype, pin_memory=True)
            copy_stream = store.copy_stream()
            copy_stream.wait_event(torch.cuda.current_stream(saved.device).record_event())
            with torch.cuda.stream(copy_stream):
                host.copy_(saved, non_blocking=True)
            saved.record_stream(copy_stream)
        else:
            host = saved.clone()
        store.residency.ledger.offloads += 1
        store.residency.ledger.offloaded_bytes += nbytes(saved)
        store.offloaded.append(weakref.ref(host))  # the step's host copies (tests tamper with them)
        return host

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (an ``offload``'s copy) back on ``device``; on CUDA copied on the copy stream (after the
        offload's own copy: same stream) and waited for by ``wait`` before its first reader."""
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if device.type == "cuda":
            copy_stream = self.store.copy_stream()
            copy_stream.wait_event(torch.cuda.current_stream(device).record_event())
            with torch.cuda.stream(copy_stream):
                out.copy_(host, non_blocking=True)
            self._pending[id(out)] = copy_stream.record_event()
        else:
            out.copy_(host)
        return out

    def _timing_event(self, stream: Any) -> Any:
        """A timing event recorded on ``stream`` while measuring, else ``None``."""
        if not self.measure:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _finish_measuring(self) -> None:
        """After the first measured run: block copy and compute times into ``store.timing``."""
        torch.cuda.synchronize(self.store.device)
        copy_ms = [a.elapsed_time(b) for a, b in self._copy_times]
        # a block computes from the end of its group's wait to the start of the next group's wait
        compute_ms = [after.elapsed_time(nxt) for (_, after), (nxt, _) in zip(self._wait_times, self._wait_times[1:])]
        stall_ms = [a.elapsed_time(b) for a, b in self._wait_times]
        self.store.timing = summarize_timing(copy_ms, compute_ms, stall_ms)
        self.measure = False
        self._copy_times, self._wait_times = [], []

    def evict(self, loaded: torch.Tensor) -> None:
        if self.phase == "forward" and id(loaded) in self.store.residency.stashed_ids:
            return  # a turn-around copy: the backward takes it over (and evicts it)
        if self.phase == "backward" and id(loaded) in self.store.residency.forward_stashed_ids:
            return  # one the next forward takes over
        if id(loaded) not in self.store.residency.kept_ids:  # kept resident by the memory budget: stays
            self.store.residency.ledger.on_evict(nbytes(loaded))

    def _allocate(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device, block: int) -> torch.Tensor:
        try:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        except torch.OutOfMemoryError as e:
            size = math.prod(shape) * dtype.itemsize
            raise PorosOOMError(self.store.oom_message(block, size, self.stream)) from e

    def wrap(self, compiled: Any) -> Callable[[list[Any]], Any]:
        """A boxed callable that runs ``compiled`` (the graph module after the passes) and books the run
        in the ledger; inside a block-major step (``runtime/accumulate.py``) the step decides how."""
        self.graph_module = compiled
        self.num_outputs = len(next(iter(compiled.graph.find_nodes(op="output"))).args[0])

        def run(args: list[Any]) -> Any:
            if self.schedule is None or f"{self.phase}_first_run" in self.schedule.phase_seconds:
                return dispatch(args)
            started = time.perf_counter()  # the first run's host time: what it does once (lazy compiles, measuring)
            try:
                return dispatch(args)
            finally:
                self.schedule.phase_seconds[f"{self.phase}_first_run"] = time.perf_counter() - started

        def dispatch(args: list[Any]) -> Any:
            if self.store is None:
                return self._run(lambda: compiled(args))
            step = self.store.residency.accumulation
            if step is not None and self.block_major:
                if self.cuda_graphs and self.store.residency.region_graphs is not None and self.schedule.graphs_asked:
                    self.store.residency.region_graphs.warn_once(
                        "block_major", "block-major accumulation steps run their region calls without CUDA graphs "
                        "(several micro-batches' calls interleave); options={'block_major': False} replays them")
                return step.call(self, compiled, args)
            graphs = self.store.residency.region_graphs if self.cuda_graphs else None
            if graphs is None:
                return self.execute(lambda: compiled(args), size=self.input_elements(args))
            size = self.input_elements(args)
            return graphs.around((self._graph_key, self.input_shapes(args)), self.is_resident,
                                 lambda: self.execute(lambda: compiled(args), size=size))

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def execute(self, graph_run: Callable[[], Any], runs: int = 1, size: int = 0) -> Any:
        """``graph_run()`` (this graph for one micro-batch, or ``runs`` of them together, whose inputs
        hold ``size`` elements each: ``input_elements``) with the store's bookkeeping around it: one graph
        at a time, the memory budget's measurements and plan (training steps only), the turn-around
        copies no backward took."""
        store = self.store
        steps = store.residency.steps
        steps.begin()  # one graph of a model at a time (runtime/store.py)
        if self.stream and self.phase == "forward" and self.training:
            if budget.measures_next(store, size * runs):  # a measuring step starts with nothing of the last one
                store.residency.drop_copies_for_forward()
            budget.start_measuring(store, size * runs)
        try:
            out = self._run(graph_run, runs)
        finally:
            steps.end()
        if self.stream and self.phase == "forward":
            store.residency.drop_copies_for_forward()  # what this forward did not take (a block the budget keeps now)
        if self.stream and self.phase == "backward":
            self._drop_copies_for_backward()
            budget.measure_and_plan(store)  # after the first step: which blocks stay resident
        return out

    def input_shapes(self, args: list[Any]) -> tuple[Any, ...]:
        """Sizes, strides and dtypes of a run's own inputs (``input_elements``' positions): what the sizes of
        its region calls follow from (runtime/cuda_graphs.py keys a run's graphs by them)."""
        if self._data_positions is None:
            self.input_elements(args)
        return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a := args[i], torch.Tensor) else None
                     for i in self._data_positions)

    def is_resident(self, t: torch.Tensor) -> bool:
        """``t`` is a base tensor kept on the device at one address (a block the budget keeps, a streamed block
        in a load slot, or a ``stream=False`` copy), which a CUDA graph may read in place."""
        store = self.store
        if id(t) in store.residency.kept_ids or (store.residency.region_graphs is not None and store.residency.region_graphs.load_slots.holds(t)):
            return True
        return not self.stream and any(v is t for v in store.residency.resident_cache.values())

    def input_elements(self, args: list[Any]) -> int:
        """Elements of a run's own inputs (token ids, labels, masks: not the model's parameters or base
        tensors), which grow with the sequence length: a memory budget's plan holds for steps no larger
        than the one it was measured on."""
        if self._data_positions is None:
            entries = self.store.host.entries
            self._data_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                                         and not a.requires_grad and id(a) not in entries)
        return sum(args[i].numel() for i in self._data_positions if isinstance(args[i], torch.Tensor))

    # -- block-major accumulation (runtime/accumulate.py) --------------------------------------------------

    def lockstep_refusal(self) -> str | None:
        """Why this graph cannot run for several micro-batches together, or ``None``."""
        for n in self.graph_module.graph.nodes:
            if n.op != "call_function":
                continue
            target = n.target
            if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                return f"the {self.phase} graph mutates an input ({n.name}: {target})"
            try:
                found = draws.node_draws(n)
                for draw in found or ():
                    if isinstance(draw, draws.Unreplayable):
                        raise ValueError(draw.reason)
            except ValueError as e:
                return f"the {self.phase} graph draws random numbers poros cannot replay ({e})"
            if found and self.phase == "backward":
                return f"the backward graph draws fresh random numbers ({n.name})"
        return None

    def lockstep_plan(self, per_micro_batch: frozenset[int]) -> tuple[Any, tuple[torch.device, ...]]:
        """The forward graph's lockstep plan for these per-micro-batch inputs, and the devices whose
        generators it draws from (the CPU's always)."""
        key = ("forward", per_micro_batch)
        if key not in self._lockstep:
            gm = self.graph_module
            plan = Lockstep(gm, per_micro_batch, is_evict=self._is_evict, draws=lambda n: draws.node_draws(n) is not None)
            self._dump_lockstep(plan)
            found = self._step_draws()
            devices = {torch.device("cpu")} | {d.device for d in found}
            if self.store.device.type == "cuda":
                devices.add(torch.device("cuda", self.store.device.index))
            ordered = tuple(sorted(devices, key=lambda d: (d.type != "cpu", d.index or 0)))
            self._lockstep[key] = (plan, ordered)
        return self._lockstep[key]

    def _step_draws(self) -> list[Any]:
        if self._draws is None:
            self._draws = (draws.step_draws(self.graph_module), draws.graph_symbols(self.graph_module), {})
        return self._draws[0]

    def size_inputs(self) -> frozenset[int]:
        """Positions of the graph's int inputs that are sizes of its tensor inputs (a graph compiled
        for every sequence length takes the length as an int too)."""
        placeholders = [p.meta.get("val") for p in self.graph_module.graph.find_nodes(op="placeholder")]
        tensor_sizes = {draws.size_of(d) for v in placeholders if isinstance(v, torch.Tensor) for d in v.shape}
        return frozenset(i for i, v in enumerate(placeholders)
                         if isinstance(v, torch.SymInt) and draws.size_of(v) in tensor_sizes)

    def draws_at(self, args: list[Any]) -> list[Any]:
        """One micro-batch's draws of this forward graph at the sizes of a run on ``args``."""
        found = self._step_draws()
        _, symbols, known = self._draws
        values = symbols(args)
        key = tuple(sorted((str(s), v) for s, v in values.items()))
        if key not in known:
            known.clear()  # sizes change from step to step; keep the last
            known[key] = [d.at(values) for d in found] if values else found
        return known[key]

    def backward_plan(self, per_micro_batch: frozenset[int]) -> Any:
        """The backward graph's lockstep plan, its outputs (parameter gradients) summed."""
        key = ("backward", per_micro_batch)
        if key not in self._lockstep:
            self._lockstep[key] = Lockstep(self.graph_module, per_micro_batch, is_evict=self._is_evict,
                                           draws=lambda n: False, reduce=True)
            self._dump_lockstep(self._lockstep[key])
        return self._lockstep[key]

    def _dump_lockstep(self, plan: Lockstep) -> None:
        dumper = getattr(self.schedule, "dumper", None)  # compiler.dump.Dumper when this graph dumps
        if dumper is not None:
            dumper.lockstep(plan, self.phase)

    def _is_evict(self, node: Any) -> bool:
        target = node.target
        return getattr(target, "__func__", None) is GraphRuntime.evict and target.__self__ is self

    def _drop_copies_for_backward(self) -> None:
        """Turn-around copies no backward took (another graph's, or an abandoned forward's): gone."""
        for tensors in self.store.residency.copies_for_backward.values():
            self._release(tensors)
        self.store.residency.copies_for_backward.clear()

    def _release(self, tensors: Any) -> None:
        for t in tensors:
            if id(t) in self.store.residency.stashed_ids:
                self.store.residency.stashed_ids.discard(id(t))
                self.store.residency.ledger.on_evict(nbytes(t))

    def _run(self, graph_run: Callable[[], Any], runs: int = 1) -> Any:
        """``graph_run()``, booked in the ledger as ``runs`` runs of the graph."""
        self._blocks_loaded = set()
        out = graph_run()
        if self._group or self._pending:
            raise AssertionError(f"{self.phase} graph ended with loads it never waited for")
        self._waited = None
        if self.measure:
            self._finish_measuring()
        if self.store is not None:
            ledger = self.store.residency.ledger
            if self.phase == "forward":
                ledger.forward_runs += runs
            else:
                ledger.backward_runs += runs
                # a block whose activations were saved (options save_activations) is loaded, not rerun
                saved = getattr(self.schedule, "activation_blocks", frozenset())
                ledger.recomputed_blocks += len(self._blocks_loaded - saved) * runs
        return out
