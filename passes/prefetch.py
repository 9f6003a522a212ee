"""Prefetch: issue each block's loads ``prefetch`` blocks ahead of the block that reads them.

Blocks are taken in the order the graph runs them (embed, layers, head in the forward; head, then
layers in reverse in the backward, where each block's loads feed its recompute). The loads of the
i-th block in that order move to just before the first op of block ``i - prefetch`` (of block ``i``
itself with ``prefetch=0``), so at most ``1 + prefetch`` blocks of base weights are resident.

Before (forward, prefetch=1; loads sit where the module read its weight)::

    load = poros.load(primals_3, cpu)      # layers.0 q_proj
    mm = aten.mm(view, t)                  # layers.0
    ...
    load_7 = poros.load(primals_12, cpu)   # layers.1 q_proj
    mm_7 = aten.mm(view_9, t_7)            # layers.1

After::

    load = poros.load(primals_3, cpu)      # layers.0, issued at layers.0
    load_7 = poros.load(primals_12, cpu)   # layers.1, issued at layers.0 (one block ahead)
    mm = aten.mm(view, t)
    ...
    mm_7 = aten.mm(view_9, t_7)
"""

from __future__ import annotations

import torch.fx as fx

from poros_fx.ops import LOAD
from poros_fx.schedule import Load, Schedule

from .block_partition import BLOCK
from .rng import PHASE


def prefetch(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    phase = gm.meta[PHASE]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    loads = [n for n in nodes if n.target is LOAD]
    if not loads:
        return gm
    first_op: dict[int, fx.Node] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is not LOAD and BLOCK in n.meta:
            first_op.setdefault(n.meta[BLOCK], n)
    # a load must also precede its own first reader, whatever block that reader was put in
    for ld in loads:
        reader = min(ld.users, key=position.__getitem__)
        b = ld.meta[BLOCK]
        if b not in first_op or position[reader] < position[first_op[b]]:
            first_op[b] = reader
    order = sorted({ld.meta[BLOCK] for ld in loads}, key=lambda b: position[first_op[b]])
    for i, block in enumerate(order):
        anchor_block = order[max(0, i - schedule.prefetch)]
        anchor = first_op[anchor_block]
        for ld in (n for n in loads if n.meta[BLOCK] == block):
            anchor.prepend(ld)
            entry = schedule.host_inputs.get(ld.args[0].name)
            schedule.loads.append(Load(phase=phase, block=block, weight=entry.name if entry else ld.args[0].name,
                                       nbytes=entry.nbytes if entry else 0, issued_before_block=anchor_block))
    gm.graph.lint()
    return gm
