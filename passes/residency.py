"""Residency: hand loads to the runtime and evict every loaded tensor right after its last use.

Each ``poros.load`` becomes a call of the graph's ``GraphRuntime.load`` (ledger, resident cache for
``stream=False``; the last load of a run of consecutive loads, a prefetch group, says so, and the
runtime records one copy-done event per group). With streaming on, an ``evict`` follows the last
reader of the loaded tensor and of every view of it, and the pass checks the structural promise: no
loaded tensor (or view of one) leaves the forward graph, so the backward can only get base weights by
loading them again. On CUDA, where loads run on the copy stream, a ``wait`` goes right before the
first reader, and every reader takes the tensor from it.

Before (forward graph)::

    load = poros.load(primals_3, cuda)
    t = aten.t(load)
    mm = aten.mm(view, t)
    add = aten.add(mm, ...)

After (CUDA; on the CPU there is no wait and ``t`` reads ``load``)::

    load = runtime.load(primals_3, cuda, 1, True)
    wait = runtime.wait(load)              # compute stream waits for the copy group
    t = aten.t(wait)
    mm = aten.mm(view, t)
    evict = runtime.evict(load)            # load and t are dead from here
    add = aten.add(mm, ...)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from poros_fx.errors import PorosExactnessError
from poros_fx.ops import LOAD
from poros_fx.schedule import Evict, Schedule

from .block_partition import BLOCK
from .prefetch import GROUP
from .rng import PHASE


def aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view derived from it."""
    found, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            target = user.target
            if isinstance(target, torch._ops.OpOverload) and target.is_view and user not in found:
                found.append(user)
                todo.append(user)
    return found


def residency(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    phase = gm.meta[PHASE]
    runtime = schedule.runtime
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    output = next(iter(graph.find_nodes(op="output")))
    loads = [n for n in graph.nodes if n.target is LOAD]
    # the prefetch pass numbered each load's group; the runtime records one copy-done event per group
    last_in_group = {ld: nxt is None or GROUP not in ld.meta or nxt.meta.get(GROUP) != ld.meta[GROUP]
                     for ld, nxt in zip(loads, [*loads[1:], None])}
    for ld in loads:
        host, device = ld.args
        block = ld.meta[BLOCK]
        weight, _ = schedule.load_source(ld)
        ld.target = runtime.load
        ld.args = (host, device, block, last_in_group[ld])
        if not schedule.stream:
            continue
        group = aliases(ld)
        if output in {u for a in group for u in a.users}:
            raise PorosExactnessError(f"{phase} graph hands the loaded base tensor {ld.name} (or a view of it) to its "
                                      "output; the backward would keep a device copy of the base")
        last = max((u for a in group for u in a.users), key=position.__getitem__)
        first = min(ld.users, key=position.__getitem__)
        with graph.inserting_after(last):
            ev = graph.call_function(runtime.evict, (ld,))
        ev.meta[BLOCK] = block
        if runtime.overlap:
            with graph.inserting_before(first):
                wait = graph.call_function(runtime.wait, (ld,))
            wait.meta[BLOCK] = block
            ld.replace_all_uses_with(wait, delete_user_cb=lambda user: user not in (wait, ev))
        schedule.evicts.append(Evict(phase=phase, block=block, weight=weight, after_node=last.name))
    graph.lint()
    gm.recompile()
    return gm
