"""A graph run for several micro-batches together (block-major accumulation, ``accumulate.py``): whether
it can be, its lockstep plans (``lockstep.py``) and the random draws of its forward at a run's sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from . import draws
from .copies import DeviceCopies
from .lockstep import Lockstep


class GraphLockstep:
    """A graph's lockstep plans, one per phase and set of per-micro-batch inputs, and its forward's draws
    (in its symbols, how a run binds them, the last binding's)."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)
    phase: str
    schedule: Any  # compiler.schedule.Schedule
    graph_module: Any  # the graph ``wrap`` runs

    def _init_lockstep(self) -> None:
        self._lockstep: dict[Any, Any] = {}  # (phase, per-micro-batch inputs) -> lockstep plan
        self._draws: Any = None  # (a forward's draws in its symbols, how a run binds them, the last binding's)

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
        return getattr(target, "__func__", None) is DeviceCopies.book_evict and target.__self__ is self
