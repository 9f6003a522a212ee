"""The graph runtime: the functions the residency pass puts into the forward and backward graphs.

``GraphRuntime.load`` makes the device copy of a host-store tensor and books it in the ledger;
``evict`` books it out at its last use (the graph drops its last reference right after, so the
memory really goes). With ``stream=False`` a load keeps its copy resident in the store's cache and
no evicts are scheduled: the same graphs, with the base resident.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .store import HostStore


class GraphRuntime:
    def __init__(self, store: HostStore | None, stream: bool, phase: str) -> None:
        self.store = store
        self.stream = stream
        self.phase = phase
        self._blocks_loaded: set[int] = set()

    def load(self, host: torch.Tensor, device: torch.device, block: int) -> torch.Tensor:
        if not self.stream:
            cached = self.store.resident_cache.get(id(host))
            if cached is None:
                cached = _copy(host, device)
                self.store.resident_cache[id(host)] = cached
                self.store.ledger.on_load(cached.untyped_storage().nbytes())
            return cached
        out = _copy(host, device)
        self.store.ledger.on_load(out.untyped_storage().nbytes())
        self._blocks_loaded.add(block)
        return out

    def evict(self, loaded: torch.Tensor) -> None:
        self.store.ledger.on_evict(loaded.untyped_storage().nbytes())

    def wrap(self, compiled: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """A boxed callable that runs ``compiled`` and books the run in the ledger."""

        def run(args: list[Any]) -> Any:
            self._blocks_loaded = set()
            out = compiled(args)
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


def _copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    out.copy_(host.detach())
    return out
