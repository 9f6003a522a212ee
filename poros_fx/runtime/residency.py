"""What of a prepared model's base is on the device now, and the state of the step in flight.

``Residency`` holds the residency ledger, the device copies that stay (``stream=False`` copies and the
blocks a memory budget keeps), the turn-around stashes (a forward's last blocks left for its backward,
a backward's last blocks left for the next forward), the block-major step in flight, the CUDA graphs
of the region calls (with their load slots) and the copy stream every streamed load copies on.
``StepState`` lets one graph of a model run at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

from ..errors import PorosConfigError
from .arena import nbytes
from .ledger import ResidencyLedger


def cache_key(host: torch.Tensor) -> tuple[Any, ...]:
    """The key of ``host``'s device copy in ``Residency.resident_cache``: a head chunk's slice is a new
    tensor every run, so address, shape and dtype rather than the tensor."""
    return (host.data_ptr(), tuple(host.shape), host.dtype)


@dataclasses.dataclass(eq=False)
class StepState:
    """How many graphs of one prepared model run now (at most one). ``GraphRuntime`` (runtime/executor.py)
    calls ``begin`` and ``end`` around every run of a compiled graph of the model, and a graph that starts
    while another graph of the model is running (a second thread on one model) is refused: the runtime's
    copy stream, prefetch groups and ledger are the model's, not the thread's.

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


@dataclasses.dataclass(eq=False)
class Residency:
    """The device side of one prepared model's base: the ledger, the copies that stay on the device, the
    turn-around stashes, the block-major step in flight, the region calls' CUDA graphs and the copy stream."""

    ledger: ResidencyLedger = dataclasses.field(default_factory=ResidencyLedger)
    resident_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)  # cache_key -> device copy
    # that stays: every copy of a stream=False graph, and each tensor of a block the memory budget keeps
    kept_ids: dict[int, bool] = dataclasses.field(default_factory=dict)  # id(device copy) the budget keeps -> booked in the ledger
    # turn-around: a training forward's last blocks stay for the backward, which starts with them
    copies_for_backward: dict[tuple[int, ...], list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # host ptrs -> forward copies the backward takes
    stashed_ids: set[int] = dataclasses.field(default_factory=set)  # ids of those copies, booked, not yet evicted
    # and back: a training backward's last blocks stay for the next forward, which starts with them
    copies_for_forward: dict[tuple[int, ...], list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # host ptrs -> backward copies the next forward takes
    forward_stashed_ids: set[int] = dataclasses.field(default_factory=set)  # ids of those copies, booked, not yet evicted
    steps: StepState = dataclasses.field(default_factory=StepState)  # the graphs of the model running now
    accumulation: Any = None  # runtime.accumulate.BlockMajorStep of the optimizer step in flight, if block-major
    block_major_warned: bool = False  # a step ran micro-batch-major instead and said why (once per model)
    region_graphs: Any = None  # runtime.cuda_graphs.RegionGraphs of the region calls (options={"cuda_graphs": True})
    _copy_stream: Any = dataclasses.field(default=None, repr=False)

    def copy_stream(self, device: torch.device) -> Any:
        """The CUDA stream every streamed load of this model copies on (created on first use, on ``device``)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

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
