"""The graph runtime: the object whose methods the residency pass puts into the forward and backward graphs.

``GraphRuntime`` is one compiled graph's runtime. It composes the concerns of a run, each in its own
module: the device copies of the base (``copies.DeviceCopies``: loads, waits, evicts), the turn-around
copies between the phases (``turnaround.Turnaround``), the timing of the first run's copies
(``copy_timing.CopyTiming``), the boundary offload (``offload.BoundaryOffload``) and the lockstep plans
of block-major accumulation (``graph_lockstep.GraphLockstep``). This module holds the dispatch of a run
(``wrap``, ``execute``): one graph of a model at a time, the memory budget's hooks (``budget.py``)
around training runs, the region calls' CUDA graphs (``cuda_graphs.py``) and block-major steps
(``accumulate.py``), and the run's booking in the ledger.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch

from ..errors import PorosConfigError
from . import budget
from .copies import DeviceCopies
from .graph_lockstep import GraphLockstep
from .offload import BoundaryOffload
from .store import HostStore


class GraphRuntime(DeviceCopies, BoundaryOffload, GraphLockstep):
    """One compiled graph's runtime: its store (weakly), its phase, whether it streams and trains, its
    schedule, the graph it runs, and the state of each concern it composes (see the module docstring)."""

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
        self._init_lockstep()
        self._init_turnaround(reused_by_backward, reused_by_forward)
        overlap = stream and store is not None and store.device.type == "cuda"
        self._init_copies(overlap)
        self._init_timing(measure and overlap)
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
        steps.begin()  # one graph of a model at a time (runtime/residency.py)
        if self.stream and self.phase == "forward" and self.training:
            budget.before_training_forward(store, size * runs)
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
