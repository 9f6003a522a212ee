"""Prefetch: issue each block's loads ``prefetch`` blocks ahead of the block that reads them.

Blocks are taken in the block DAG's load order (``compiler/block_graph.py``: a topological order, which
for a decoder is embed, layers, head) in the forward and in reverse in the backward (head, then layers
in reverse, where each block's loads feed its recompute). The loads of the
i-th block in that order move to just before the first op of block ``i - prefetch`` (of block ``i``
itself with ``prefetch=0``), so at most ``1 + prefetch`` blocks of base weights are resident. A
chunked head (``prepare``'s ``head_chunks``) reads its weight as row slices, one load each: every
chunk is a group of its own, ordered like a block, so the head is never resident whole.

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

import torch
import torch.fx as fx

from poros_fx.compiler.block_graph import load_order
from poros_fx.compiler.ops import LOAD
from poros_fx.compiler.schedule import Load, Schedule

from .block_partition import BLOCK
from .rng import PHASE


GROUP = "poros_prefetch_group"  # index of the load's group in the order the graph runs them


def chunk_of(load: fx.Node) -> int | None:
    """The first row of the slice a chunked head's load reads (``None`` for a whole tensor)."""
    src = load.args[0]
    if getattr(src, "op", None) == "call_function" and src.target is torch.ops.aten.slice.Tensor:
        return int(src.args[2])
    return None


def prefetch(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    phase = gm.meta[PHASE]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    loads = [n for n in nodes if n.target is LOAD]
    if not loads:
        return gm
    group_of = {ld: (ld.meta[BLOCK], chunk_of(ld)) for ld in loads}
    first_op: dict[tuple[int, int | None], fx.Node] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is not LOAD and BLOCK in n.meta:
            first_op.setdefault((n.meta[BLOCK], None), n)
    # a load must also precede its own first reader, whatever block that reader was put in; a head
    # chunk's group starts at its first reader
    for ld in loads:
        reader = min(ld.users, key=position.__getitem__)
        group = group_of[ld]
        if group not in first_op or position[reader] < position[first_op[group]]:
            first_op[group] = reader
    # the block DAG's load order (topological: a block after every block it reads from), reversed in the
    # backward; a head's row chunks in the order they run
    rank = {b: i for i, b in enumerate(load_order(schedule.block_graph))} if schedule.block_graph is not None else {}
    sign = -1 if phase == "backward" else 1
    order = sorted(set(group_of.values()), key=lambda g: (sign * rank.get(g[0], g[0]), position[first_op[g]]))
    for i, group in enumerate(order):
        anchor_group = order[max(0, i - schedule.prefetch)]
        anchor = first_op[anchor_group]
        if position[anchor] > position[first_op[group]]:  # never after the group's own first reader
            anchor_group, anchor = group, first_op[group]
        for ld in (n for n in loads if group_of[n] == group):
            _move_before(ld, anchor, position)
            ld.meta[GROUP] = i
            name, nbytes = schedule.load_source(ld)
            schedule.loads.append(Load(phase=phase, block=group[0], weight=name, nbytes=nbytes,
                                       issued_before_block=anchor_group[0]))
    gm.graph.lint()
    return gm


def _move_before(load: fx.Node, anchor: fx.Node, position: dict[fx.Node, int]) -> None:
    """Put ``load`` (and the host-side views it reads, for a head chunk) right before ``anchor``."""
    move_host_views_before(load, anchor, position)
    anchor.prepend(load)


def move_host_views_before(load: fx.Node, anchor: fx.Node, position: dict[fx.Node, int]) -> None:
    """Put the host-side views ``load`` reads (a head chunk's row slice) that come after ``anchor``
    right before it, in order."""
    src = load.args[0]
    chain = []
    while getattr(src, "op", None) == "call_function" and position[src] > position[anchor]:
        chain.append(src)
        src = src.args[0]
    for view in reversed(chain):
        anchor.prepend(view)
