"""Lower regions: point every ``poros.region`` / ``poros.region_backward`` call at its compiled region.

A decoder layer reached the graph as one ``poros::region`` op (``poros_fx/compiler/regions/``).
This pass finds the region each call belongs to, runs ``REGION_PASSES`` (``schedule.region_passes``,
set by the backend from the pipeline) on the region's own graphs the first time (the 4-bit matmul lowering), compiles the region for the schedule's ``codegen`` once
(``"inductor"``: fused kernels; ``"eager"``: its aten graph as is) and makes the node call that code
directly, also where an RNG wrapper calls the op (the streamed forward and its recompute), so
forward, recompute and the ``stream=False`` reference all run one artifact per region. Layers of one
structure share it: compiling costs the same at 4 layers and at 80. Each such node says in
``meta["poros_region"]`` which region and phase it runs, and a forward one in
``meta["poros_region_draws"]`` what the region draws from the random generators (block-major reads it).

Forward (streamed, CUDA), before / after::

    run_and_save_rng_state = run_and_save_rng_state_cuda(poros.region.default, [getitem_2, cos, sin, wait, ...],
                                                         140230, 1, call, '1011...')
    run_and_save_rng_state = run_and_save_rng_state_cuda_region_r0_forward([getitem_2, cos, sin, wait, ...],
                                                                           140230, 1, call, '1011...')

Backward::

    region_backward = poros.region_backward.default([wait_9, ..., getitem_31, getitem_40], 140230, 0)
    region_backward = region_r0_backward([wait_9, ..., getitem_31, getitem_40], 140230, 0)
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch.fx as fx

from poros_fx.compiler.regions import REGION, REGION_BACKWARD, ROLE, compile_for, runners, saved_only_runner, table_of
from poros_fx.compiler.schedule import RegionUse, Schedule
from poros_fx.errors import PorosConfigError
from poros_fx.runtime.draws import REGION_DRAWS, CalledDraws

from .block_partition import BLOCK
from .rng import PHASE

# node.meta of a region call: (the runner, the RNG wrapper calling it or None, the runner's argument slot in it)
RUNNER = "poros_region_runner"


def _op_slot(node: fx.Node) -> int | None:
    """Where the region op sits in ``node``: -1 (it is the target), ``i`` (``args[i]``: an RNG wrapper
    calls it), ``None`` (not a region call)."""
    if node.op != "call_function":
        return None
    if node.target in (REGION, REGION_BACKWARD):
        return -1
    return next((i for i, a in enumerate(node.args[:2]) if a is REGION or a is REGION_BACKWARD), None)


def lower_regions(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    for n in gm.graph.nodes:
        slot = _op_slot(n)
        if slot is None:
            continue
        op = n.target if slot < 0 else n.args[slot]
        op_args = n.args if slot < 0 else n.args[slot + 1:]
        table = table_of(op_args[1])
        values = ()
        if op is REGION:
            inputs, _, layer, call, grads = op_args
            region, values = table.region(layer, call, grads, [_val(x) for x in inputs])
        else:
            region = table.regions[op_args[2]]
        if schedule.codegen not in region.lowered:  # idempotent passes: a second codegen adds its part
            for graph in (region.forward, region.backward):
                if graph is not None:
                    for region_pass in schedule.region_passes:
                        region_pass(graph, schedule)
                    graph.recompile()
            region.lowered.add(schedule.codegen)
        compile_for(region, schedule.codegen)
        if op is REGION and region.signature.bind([_val(x) for x in inputs]) is None:
            raise PorosConfigError(
                f"poros: compiling region {region.name} ({schedule.codegen}) fixed sizes this call does not have "
                f"({region.signature.describe()}); use codegen='eager' for this model, or one sequence length")
        forward, backward = runners(region, schedule.codegen)
        runner = forward if op is REGION else backward
        if op is REGION and gm.meta.get(PHASE) == "backward" and _reads_saved_only(n, region.num_outputs):
            runner = saved_only_runner(region, schedule.codegen) or runner  # a rerun for the backward
        n.meta[RUNNER] = (runner, None if slot < 0 else n.target, slot)
        if slot < 0:
            n.target = runner
        else:  # the wrapper calls the runner (generated code cannot hold a function as an argument)
            n.target, n.args = calling(n.target, slot, runner), (*n.args[:slot], *n.args[slot + 1:])
        n.meta[ROLE] = (region, "forward" if op is REGION else "backward")
        if op is REGION:
            n.meta[REGION_DRAWS] = CalledDraws.bound(region.draws[schedule.codegen], region.signature.symbols, values)
        use = schedule.regions.setdefault(region.name, RegionUse.of(region, schedule.codegen))
        if op is REGION and n.meta.get(BLOCK) is not None:
            use.blocks.add(n.meta[BLOCK])
    return gm


def _reads_saved_only(node: fx.Node, num_outputs: int) -> bool:
    """Whether the graph reads only saved tensors of the region call ``node`` (none of its first
    ``num_outputs`` outputs)."""
    return all(u.target is operator.getitem and u.args[1] >= num_outputs for u in node.users)


def calling(wrapper: Callable, slot: int, runner: Callable) -> Callable:
    """``wrapper`` (an RNG save / restore) with ``runner`` in its argument ``slot``."""

    def call(*args: Any) -> Any:
        return wrapper(*args[:slot], runner, *args[slot:])

    call.__name__ = call.__qualname__ = f"{getattr(wrapper, '__name__', 'rng')}_{runner.__name__}"
    return call


def _val(node: Any) -> Any:
    return node.meta["val"] if isinstance(node, fx.Node) else node
