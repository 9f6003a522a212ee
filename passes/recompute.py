"""Recompute: tag every forward node of a block ``MUST_RECOMPUTE`` in its own checkpoint region.

The min-cut partitioner then saves only what crosses a region boundary (one hidden state per block,
plus small values such as rotary tables) and reruns each block's interior, its ``poros::load`` calls
included, just before that block's gradients. A loaded weight is never saved: ``MUST_RECOMPUTE``
nodes are banned from the saved set, so the backward reloads the block instead of receiving the
forward's device copy. With ``stream=False`` nothing is tagged and the default partition saves. A
head loaded in row chunks keeps only its loads tagged (see below): its logits are saved, not rerun; so
does a layer block whose activations are saved (``options={"save_activations": N}``, the last N): its
base is reloaded for the backward, its region's saved tensors are kept, nothing of it is rerun.

Before (joint graph, ``meta`` shown in brackets)::

    load = poros.load(primals_3, cpu)            [poros_block=1]
    mm = aten.mm(view, t)                        [poros_block=1]
    add_3 = aten.add(add_1, view_5)              [poros_block=1]   # layer 0's output
    load_7 = poros.load(primals_12, cpu)         [poros_block=2]

After::

    load = poros.load(primals_3, cpu)            [poros_block=1, recompute=MUST_RECOMPUTE, ac_graph_id=2]
    mm = aten.mm(view, t)                        [..., MUST_RECOMPUTE, ac_graph_id=2]
    add_3 = aten.add(add_1, view_5)              [..., MUST_RECOMPUTE, ac_graph_id=2]  # the partitioner saves it:
    load_7 = poros.load(primals_12, cpu)         [..., MUST_RECOMPUTE, ac_graph_id=3]  # a later region reads it
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from poros_fx.compiler.ops import LOAD
from poros_fx.compiler.schedule import Schedule
from poros_fx.loss import CHUNK, SAVE

from .block_partition import BLOCK, FORWARD
from .prefetch import chunk_of

from .residency import aliases

BOUNDARY = "poros_boundary"  # meta of the clone that carries a block's output to later blocks


def recompute(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    if not schedule.stream:
        return gm
    loads = [n for n in gm.graph.nodes if n.target is LOAD and n.meta.get(FORWARD)]
    # A chunked head: its backward reads each weight chunk once more (dlogits_c @ W_c), after the loss
    # backward has read all the logits. Recomputing the logits would need every chunk loaded at once, so
    # only the chunk loads (their host slices and views) are recomputed; the min-cut saves the logits.
    chunked_loss = {n.meta[BLOCK] for n in gm.graph.nodes if n.meta.get(FORWARD) and _loss_tag(n) is not None}
    loads_only = {ld.meta[BLOCK] for ld in loads if chunk_of(ld) is not None} - chunked_loss
    # options save_activations: the last N layer blocks are not rerun either; only their loads are, so
    # the backward reloads their base (a loaded weight is never saved) and takes their activations
    schedule.activation_blocks = _activation_blocks(schedule)
    loads_only |= schedule.activation_blocks
    reloaded = {a for ld in loads if ld.meta[BLOCK] in loads_only for a in (*aliases(ld), *ld.all_input_nodes)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get(FORWARD):
            if n.meta[BLOCK] in loads_only and n not in reloaded:
                continue
            save = _loss_tag(n) == SAVE
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = n.meta[BLOCK] + 1
    _save_block_outputs(gm)
    return gm


def _activation_blocks(schedule: Schedule) -> frozenset[int]:
    """The layer blocks whose activations the backward keeps: the last ``save_activations`` of them (the
    backward's first, so their activations are the first freed)."""
    count = schedule.options.save_activations
    layers = [b.index for b in schedule.blocks if b.name not in ("embed", "head", "no-layers")]
    return frozenset(layers[len(layers) - count:]) if count else frozenset()


def _loss_tag(n: fx.Node) -> object:
    """The chunked loss's annotation of ``n`` (``loss.py``), or ``None``."""
    return (n.meta.get("custom") or {}).get(CHUNK)


def _save_block_outputs(gm: fx.GraphModule) -> None:
    """A block's output that is one output of a multi-output op (a layer region's ``region[0]``) goes to
    later blocks through a ``clone`` marked ``MUST_SAVE`` (a view would not do: the partitioner never
    bans a view from recomputation; the copy is one hidden state per layer). It never saves a ``getitem``:
    the op is recomputed in the backward anyway, so it would take the output from there, and every
    block's recompute would then need the block before it recomputed first, back to the embedding —
    the whole forward rerun at the start of the backward with every block's weights loaded at once.
    The backward's own readers of that output (the final norm's gradient reads its input) take the copy
    too: then no backward node reads a region's rerun output, and the rerun computes only what the
    region's backward reads (``compiler/regions/split.py``).

        getitem = region[0]                     [block 1, MUST_RECOMPUTE]
        region_1 = poros.region([getitem, ...]) [block 2]
    becomes
        getitem = region[0]                     [block 1, MUST_RECOMPUTE]
        clone = aten.clone(getitem)             [block 1, MUST_SAVE]
        region_1 = poros.region([clone, ...])   [block 2]
    """
    for n in list(gm.graph.nodes):
        if not (n.target is operator.getitem and n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
            continue
        later = [u for u in n.users if u.meta.get(BLOCK) != n.meta[BLOCK]]
        if not later:
            continue
        # the backward's readers of a block output take the saved copy too (a norm's gradient reads its
        # input), so none needs the block rerun for its output (the rerun computes its saved tensors alone)
        later += [u for u in n.users if not u.meta.get(FORWARD) and u not in later]
        with gm.graph.inserting_after(n):
            saved = gm.graph.call_function(torch.ops.aten.clone.default, (n,))
        saved.meta = {**n.meta, "recompute": CheckpointPolicy.MUST_SAVE, BOUNDARY: True}
        for user in later:
            user.replace_input_with(n, saved)
