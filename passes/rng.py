"""RNG: record where each random op's generator state is saved and restored, and refuse anything else.

The partitioner (run with ``graphsafe_rng_functionalization=False``, see ``poros_fx.compiler.backend``)
wraps every random op that sits in a recompute region: the forward runs it through
``run_and_save_rng_state`` and hands the state to the backward, which reruns it under
``run_with_rng_state``, so a recomputed dropout draws exactly the mask the forward drew, on CPU and
CUDA, and the forward consumes the global generator exactly as eager does. This pass names those
slots in the schedule (block, op) and raises ``PorosExactnessError`` if the backward holds a random
op that would draw fresh numbers, or if a graph-safe RNG wrapper (a private generator, which does
not follow eager's stream) slipped in.

Forward, before/after (the pass only reads; it labels slot 0 as block 1)::

    run_and_save_rng_state = run_and_save_rng_state(aten.native_dropout.default, view, 0.1, True)
    getitem = run_and_save_rng_state[0]          # the state -> forward output -> backward input
    getitem_1 = run_and_save_rng_state[1]        # the dropout result

Backward::

    run_with_rng_state = run_with_rng_state(rng_state_output_0, aten.native_dropout.default, view, 0.1, True)
"""

from __future__ import annotations

import torch.fx as fx
from torch._prims.rng_prims import graphsafe_run_with_rng_state, run_and_save_rng_state, run_with_rng_state

from poros_fx.errors import PorosExactnessError
from poros_fx.runtime.draws import is_random
from poros_fx.compiler.schedule import RngSlot, Schedule

from .block_partition import BLOCK, FORWARD

PHASE = "poros_phase"


def _block_from_users(node: fx.Node) -> int:
    for user in node.users:
        if BLOCK in user.meta:
            return user.meta[BLOCK]
        for grand in user.users:
            if BLOCK in grand.meta:
                return grand.meta[BLOCK]
    return -1


def rng(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    phase = gm.meta[PHASE]
    wrappers = [n for n in gm.graph.nodes if n.op == "call_function"]
    if any(n.target is graphsafe_run_with_rng_state for n in wrappers):
        raise PorosExactnessError("the partitioner used graph-safe RNG (a private generator per op), which does not "
                                  "reproduce eager's dropout masks; poros-fx must partition with "
                                  "graphsafe_rng_functionalization=False")
    if phase == "forward":
        for n in wrappers:
            if n.target is run_and_save_rng_state:
                n.meta[BLOCK] = _block_from_users(n)
                schedule.rng_slots.append(RngSlot(index=len(schedule.rng_slots), block=n.meta[BLOCK],
                                                  op=str(n.args[0]), forward_node=n.name))
        return gm
    # the partitioner adds one backward placeholder per saved state, in the forward's slot order
    states = [p for p in gm.graph.find_nodes(op="placeholder") if p.name.startswith("rng_state_output")]
    for n in wrappers:
        if n.target is run_with_rng_state:
            n.meta[BLOCK] = _block_from_users(n)
            slot = states.index(n.args[0])
            if slot < len(schedule.rng_slots):
                schedule.rng_slots[slot].backward_node = n.name
    # a backward op with the tag (e.g. an SDPA backward) replays the philox seed its forward saved;
    # what must not happen is a *recomputed forward* random op running unwrapped
    fresh = [n.name for n in wrappers if is_random(n.target) and n.meta.get(FORWARD)]
    if fresh:
        raise PorosExactnessError(f"the backward graph reruns random op(s) {fresh} without the forward's RNG state; "
                                  "their masks would differ from the forward's. This configuration cannot be exact.")
    return gm
