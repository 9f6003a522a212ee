"""Device copies of the base: the loads, waits and evicts the residency pass puts into a graph.

``DeviceCopies.load_group`` copies one prefetch group (a block's base tensors) to the device: one
device buffer, one copy per contiguous range of host memory (the store's arena keeps a block's
tensors side by side, so a block is one copy, not one per tensor: a 7B step makes 68 copy calls and
allocations, where a copy per tensor made 2,252, and the step is bound by the CPU launching work); the
group's layout in that buffer (``GroupPlan``) is worked out on its first load and reused. ``load``
hands out one tensor of that group (a view of the buffer) and books it in the ledger; ``wait`` makes
the compute stream wait for the group's copy just before the tensor's first reader; ``book_evict``
books it out of the ledger at its last use (the buffer goes when the graph drops the group's last
tensor). With ``stream=False`` a load copies its tensor alone and keeps it resident in the store's
``Residency.resident_cache``, and no evicts are scheduled: the same graphs, with the base resident.

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
from typing import Any

import torch

from ..errors import PorosConfigError, PorosOOMError
from .arena import ALIGN, nbytes
from .copy_timing import CopyTiming
from .load_slots import LoadSlots
from .residency import cache_key
from .turnaround import Turnaround

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


class DeviceCopies(Turnaround, CopyTiming):
    """The copies of one graph's runs: the copies issued since the group's ready event, the copy stream's
    done events not yet waited for, the last one waited for, each group's ``GroupPlan`` and the blocks
    the run loaded."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)
    stream: bool  # the graph streams the base (False: stream=False, the base stays resident)
    phase: str
    cuda_graphs: bool  # region calls replay CUDA graphs

    def _init_copies(self, overlap: bool) -> None:
        self.overlap = overlap  # copies run on the copy stream, overlapping the compute
        self._blocks_loaded: set[int] = set()
        self._group: list[torch.Tensor] = []  # loads issued since the group's ready event
        self._pending: dict[int, Any] = {}  # id(device copy) -> the copy stream's done event
        self._waited: Any = None  # the done event the compute stream waited for last
        self._plans: dict[tuple[int, ...], GroupPlan] = {}  # host addresses of a group -> its layout

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
        out = self._turnaround_copies(key) if not kept else None
        if out is None:
            out = self._copy_group(hosts, device, block, key, self._slots_for(block, kept))
        if kept:
            for h, t in zip(hosts, out):
                store.residency.resident_cache[cache_key(h)] = t
                store.residency.kept_ids[id(t)] = False
        elif block in self.reused_by_backward or (self.phase == "backward" and block in self._left_for_forward()):
            self._leave_turnaround(key, block, out)
        return out

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
            if self._take_stashed(out):  # a turn-around copy, booked by the other phase
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

    def book_evict(self, loaded: torch.Tensor) -> None:
        """Book ``loaded`` out of the ledger at its last use. The device memory goes when the graph drops its
        last reference to the group's buffer; a turn-around copy and a block the memory budget keeps stay."""
        if self._stays_for_other_phase(loaded):
            return
        if id(loaded) not in self.store.residency.kept_ids:  # kept resident by the memory budget: stays
            self.store.residency.ledger.on_evict(nbytes(loaded))

    def _allocate(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device, block: int) -> torch.Tensor:
        try:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        except torch.OutOfMemoryError as e:
            size = math.prod(shape) * dtype.itemsize
            raise PorosOOMError(self.store.oom_message(block, size, self.stream)) from e
