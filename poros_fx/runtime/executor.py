"""The graph runtime: the functions the residency pass puts into the forward and backward graphs.

``GraphRuntime.load`` makes the device copy of a host-store tensor and books it in the ledger;
``wait`` makes the compute stream wait for that copy just before its first reader; ``evict`` books it
out at its last use (the graph drops its last reference right after, so the memory really goes).
With ``stream=False`` a load keeps its copy resident in the store's cache and no evicts are
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

from typing import Any, Callable

import torch

from ..errors import PorosOOMError
from .store import HostStore


class GraphRuntime:
    def __init__(self, store: HostStore | None, stream: bool, phase: str) -> None:
        self.store = store
        self.stream = stream
        self.phase = phase
        self.overlap = stream and store is not None and store.device.type == "cuda"
        self._blocks_loaded: set[int] = set()
        self._group: list[torch.Tensor] = []  # loads issued since the group's ready event
        self._pending: dict[int, Any] = {}  # id(device copy) -> the copy stream's done event
        self._waited: Any = None  # the done event the compute stream waited for last

    def load(self, host: torch.Tensor, device: torch.device, block: int, last_in_group: bool = True) -> torch.Tensor:
        if not self.stream:
            key = (host.data_ptr(), tuple(host.shape), host.dtype)  # a head chunk's slice is new every run
            cached = self.store.resident_cache.get(key)
            if cached is None:
                cached = self._allocate(host, device, block)
                cached.copy_(host.detach())
                self.store.resident_cache[key] = cached
                self.store.ledger.on_load(cached.untyped_storage().nbytes())
            return cached
        out = self._allocate(host, device, block)
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
        self.store.ledger.on_load(out.untyped_storage().nbytes())
        self._blocks_loaded.add(block)
        return out

    def wait(self, loaded: torch.Tensor) -> torch.Tensor:
        """``loaded``, once its copy has landed (the compute stream waits for the copy's group)."""
        done = self._pending.pop(id(loaded), None)
        if done is not None and done is not self._waited:
            torch.cuda.current_stream(loaded.device).wait_event(done)
            self._waited = done
        return loaded

    def evict(self, loaded: torch.Tensor) -> None:
        self.store.ledger.on_evict(loaded.untyped_storage().nbytes())

    def _allocate(self, host: torch.Tensor, device: torch.device, block: int) -> torch.Tensor:
        try:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        except torch.OutOfMemoryError as e:
            raise PorosOOMError(self.store.oom_message(block, host.numel() * host.element_size(), self.stream)) from e

    def wrap(self, compiled: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """A boxed callable that runs ``compiled`` and books the run in the ledger."""

        def run(args: list[Any]) -> Any:
            self._blocks_loaded = set()
            out = compiled(args)
            if self._group or self._pending:
                raise AssertionError(f"{self.phase} graph ended with loads it never waited for")
            self._waited = None
            if self.store is not None:
                ledger = self.store.ledger
                if self.phase == "forward":
                    ledger.forward_runs += 1
                else:
                    ledger.backward_runs += 1
                    ledger.recomputed_blocks += len(self._blocks_loaded)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run
