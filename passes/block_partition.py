"""Block partition: give every node of the joint graph the block it belongs to (``meta["poros_block"]``).

Forward nodes are placed by the decoder layer in their ``nn_module_stack``; nodes outside any layer
belong to ``embed`` when they run before the first layer and to ``head`` after the last one. A
graph piece whose module paths name no layer (Dynamo split the step at a graph break inside a decoder
layer) is placed by the layers whose base tensors it loads (``_layers_from_loads``); one that loads
none of a layer's is one block, ``no-layers``. Backward
nodes are placed by ``fwd_nn_module_stack`` the same way; those without it (getitems, gradient
accumulation) take the block of their first input that has one, else of the preceding backward node.

Before (joint graph, two layers, block_size=1)::

    embedding = aten.embedding(load, primals_57)                      # model.embed_tokens
    mm = aten.mm(view, t)                                             # model.layers.0.self_attn.q_proj
    mm_7 = aten.mm(view_9, t_7)                                       # model.layers.1.self_attn.q_proj
    mm_14 = aten.mm(view_20, t_14)                                    # lm_head

After: the same nodes, with ``meta["poros_block"]`` = 0 (embed), 1 (layers.0), 2 (layers.1), 3 (head),
``schedule.blocks`` listing the four blocks with the base bytes each one loads, and
``schedule.block_graph`` the DAG of the blocks and the forward values that cross between them
(``compiler/block_graph.py``: embed -> layers.0 -> layers.1 -> head for the hidden states, embed ->
each layer for the rotary tables).
"""

from __future__ import annotations

import operator
import re

import torch.fx as fx

from poros_fx.compiler import block_graph
from poros_fx.compiler.ops import LOAD
from poros_fx.compiler.schedule import Block, Schedule

BLOCK = "poros_block"
FORWARD = "poros_forward"


def forward_nodes(graph: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """Nodes the forward outputs depend on (the joint output's first ``num_fwd_outputs`` values)."""
    output = next(iter(graph.find_nodes(op="output")))
    roots = list(output.args[0][:num_fwd_outputs])
    seen: set[fx.Node] = set()
    while roots:
        n = roots.pop()
        if isinstance(n, fx.Node) and n not in seen:
            seen.add(n)
            roots.extend(n.all_input_nodes)
    return seen


def _layer_of(stack: dict | None, pattern: re.Pattern) -> int | None:
    if not stack:
        return None
    for fqn, _cls in reversed(list(stack.values())):
        m = pattern.search(str(fqn))
        if m:
            return int(m.group(1))
    return None


def block_partition(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    pattern = re.compile(rf"(?:^|\.){re.escape(schedule.layer_attr)}\.(\d+)(?:\.|$| )")
    graph = gm.graph
    fwd = forward_nodes(graph, schedule.num_fwd_outputs)
    # an output of a forward op that only the backward reads (a region's saved tensors) is forward too
    fwd |= {n for n in graph.nodes if n.target is operator.getitem and n.args[0] in fwd}
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    layer_of = {n: _layer_of(n.meta.get("nn_module_stack"), pattern) for n in nodes if n in fwd}
    layers = sorted({v for v in layer_of.values() if v is not None})
    if not layers:
        layer_of = _layers_from_loads(nodes, fwd, schedule, pattern)
        layers = sorted({v for v in layer_of.values() if v is not None})
        schedule.layers_from_loads = bool(layers)
    if not layers:
        # a piece of the step with no decoder layer (Dynamo split the step at a graph break): one block
        schedule.blocks = [Block(index=0, name="no-layers")]
        for n in nodes:
            n.meta[BLOCK] = 0
            n.meta[FORWARD] = n in fwd
            schedule.blocks[0].forward_nodes += n in fwd
        schedule.block_graph = block_graph.build(["no-layers"], [])
        return gm
    num_layer_blocks = max(layers) // schedule.block_size + 1
    head = num_layer_blocks + 1
    names = ["embed"] + [_layer_block_name(i, schedule.block_size, max(layers)) for i in range(num_layer_blocks)] + ["head"]
    schedule.blocks = [Block(index=i, name=name) for i, name in enumerate(names)]

    fwd_order = [n for n in nodes if n in fwd]
    last_layer_pos = max(i for i, n in enumerate(fwd_order) if layer_of[n] is not None)
    current = 0  # embed until the first layer node
    for i, n in enumerate(fwd_order):
        if layer_of[n] is not None:
            current = 1 + layer_of[n] // schedule.block_size
        elif i > last_layer_pos:
            current = head
        n.meta[BLOCK] = current
        n.meta[FORWARD] = True
        schedule.blocks[current].forward_nodes += 1

    previous = head
    for n in nodes:
        if n in fwd:
            continue
        layer = _layer_of(n.meta.get("fwd_nn_module_stack"), pattern)
        if layer is not None:
            previous = 1 + layer // schedule.block_size
            n.meta[BLOCK] = previous
        else:  # getitems, detaches, accumulation adds: the block of what they read
            n.meta[BLOCK] = next((i.meta[BLOCK] for i in n.all_input_nodes if BLOCK in i.meta), previous)
        n.meta[FORWARD] = False

    _unshare_loads(graph)
    for n in graph.nodes:
        if n.target is LOAD and n.meta.get(FORWARD):
            name, nbytes = schedule.load_source(n)
            block = schedule.blocks[n.meta[BLOCK]]
            block.weights.append(name)
            block.nbytes += nbytes
    # the blocks and the forward values crossing between them: a chain, or a DAG where state skips blocks
    schedule.block_graph = block_graph.from_joint(gm, names, [b.nbytes for b in schedule.blocks], BLOCK, FORWARD)
    return gm


def _layers_from_loads(nodes: list[fx.Node], fwd: set[fx.Node], schedule: Schedule,
                       pattern: re.Pattern) -> dict[fx.Node, int | None]:
    """Layers for a graph piece whose module paths do not name them (Dynamo split the step at a graph
    break inside a decoder layer: the piece's root is the layer itself, or a frame below the layer list):
    each forward node belongs to the layer whose base tensors were loaded last before it (a layer's
    computation starts by loading them). Nodes before the first load of a layer have none."""
    layer_of: dict[fx.Node, int | None] = {}
    current = None
    for n in nodes:
        if n not in fwd:
            continue
        if n.target is LOAD:
            m = pattern.search(schedule.load_source(n)[0])
            current = int(m.group(1)) if m else current
        layer_of[n] = current
    return layer_of


def _unshare_loads(graph: fx.Graph) -> None:
    """One load per reading block. A tied embedding / lm_head weight is read by two blocks; a CSE pass
    run before this one (Dynamo's, AOT's) could merge their two identical loads into one, and shared,
    the loaded copy would live from the embedding to the head and be saved for the backward. Each block
    gets its own load, placed before its first reader."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    for ld in [n for n in graph.nodes if n.target is LOAD]:
        by_block: dict[int, list[fx.Node]] = {}
        for user in ld.users:
            by_block.setdefault(user.meta.get(BLOCK, ld.meta.get(BLOCK)), []).append(user)
        for block, users in by_block.items():
            if block == ld.meta.get(BLOCK):
                continue
            first = min(users, key=position.__getitem__)
            with graph.inserting_before(first):
                copy = graph.call_function(LOAD, ld.args, ld.kwargs)
            copy.meta = dict(ld.meta)
            copy.meta[BLOCK] = block
            copy.meta[FORWARD] = ld.meta.get(FORWARD, False) and any(u.meta.get(FORWARD) for u in users)
            for user in users:
                user.replace_input_with(ld, copy)


def _layer_block_name(block: int, block_size: int, last_layer: int) -> str:
    start, end = block * block_size, min(block * block_size + block_size - 1, last_layer)
    return f"layers.{start}" if start == end else f"layers.{start}-{end}"
