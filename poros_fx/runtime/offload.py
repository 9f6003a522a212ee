"""Boundary offload: the block outputs a backward reads wait in host memory (``passes/offload.py``).

``offload`` copies a saved boundary activation to the host (page-locked, on the copy stream, on CUDA)
and ``reload`` copies it back before the backward reads it; the reload's copy joins the pending copies
that ``DeviceCopies.wait`` makes the compute stream wait for.

On CUDA the host copies are slices of one page-locked buffer (``OffloadArena``), reused step after
step: once every slice handed out since the last reuse has been let go (the backward read them, or
the graph's outputs were dropped), the next offload starts again at its beginning. The buffer is
page-locked at its exact size (``arena.PageLockedBuffer``: torch's pinned caching allocator would round
it up to a power of two, 40.5 GiB to 64 at 72B and 32768 tokens). ``reserve`` sizes it before a step
runs: the backend reserves what one run of a compiled forward offloads (``compiler/host_fit.py``), so
the first step takes no other host memory and a host that cannot page-lock it fails before the step.
A round that outgrows it (several graphs or micro-batches in flight) takes the rest from torch's
pinned caching allocator, and the next round gets a buffer of the new size. All copies into and out
of it run on the one copy stream, in order, so a new round's device-to-host copy cannot overtake the
last round's host-to-device reload of the same bytes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .arena import PageLockedBuffer, aligned, nbytes


class OffloadArena:
    """One page-locked host buffer the offloaded boundaries of a round of steps are slices of."""

    def __init__(self) -> None:
        self.buffer: PageLockedBuffer | None = None
        self.used = 0  # bytes handed out in this round
        self.round_bytes = 0  # what this round asked for, in the buffer or not
        self.most_bytes = 0  # the most one round asked for (or was reserved)
        self.allocations = 0  # buffers allocated
        self.overflow_bytes = 0  # bytes of the current round taken from torch's caching allocator
        self._live: list[weakref.ref] = []

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least ``nbytes`` now (between rounds: nothing handed out is alive)."""
        self.most_bytes = max(self.most_bytes, nbytes)
        if self._round_over():
            self._new_round()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised page-locked host tensor of ``like``'s sizes, strides and dtype."""
        if self._round_over():
            self._new_round()
        size = aligned(nbytes(like))
        self.round_bytes += size
        self.most_bytes = max(self.most_bytes, self.round_bytes)
        span = max((s - 1) * st for s, st in zip(like.shape, like.stride())) + 1 if like.numel() else 0
        if self.buffer is None or self.used + size > self.capacity:
            self.overflow_bytes += size
            host = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, pin_memory=True)
        else:
            raw = self.buffer.tensor[self.used:self.used + size]
            self.used += size
            host = raw.view(like.dtype)[:span].as_strided(like.shape, like.stride())
        self._live.append(weakref.ref(host))  # the round ends when all of them are let go
        return host

    def _round_over(self) -> bool:
        """Every slice handed out since the last reuse has been let go."""
        return not any(ref() is not None for ref in self._live)

    def _new_round(self) -> None:
        self._live.clear()
        self.used = self.round_bytes = self.overflow_bytes = 0
        if self.most_bytes and self.capacity < self.most_bytes:
            if self.buffer is not None:
                torch.cuda.synchronize()  # a copy of the last round may still read it on the copy stream
            self.buffer = None  # the old one goes back before the larger one is page-locked
            # and so do the last round's overflow copies, which torch's pinned caching allocator would keep
            # page-locked beside the new buffer (at 72B and 32768 tokens, 40 GiB twice)
            empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # where this torch has it
            if empty_host_cache is not None:
                empty_host_cache()
            self.buffer = PageLockedBuffer(self.most_bytes, "the boundary offload (offload_boundaries)")
            self.allocations += 1

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.tensor.numel()


class BoundaryOffload:
    """The offload and reload calls of a graph whose saved block outputs wait in host memory."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)
    _pending: dict[int, Any]  # DeviceCopies' copies not yet waited for

    def offload(self, saved: torch.Tensor) -> torch.Tensor:
        """A host copy of ``saved``, a boundary activation the backward reads (``passes/offload.py``): on
        CUDA a page-locked tensor filled by the copy stream once the compute stream has made ``saved``
        (the device memory is not reused before the copy read it), a slice of the store's ``OffloadArena``;
        on the CPU a separate tensor."""
        store = self.store
        if saved.device.type == "cuda":
            host = store.offload_arena.take(saved)
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
