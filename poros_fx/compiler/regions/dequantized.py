"""A region's backward dequantizes its base weights again instead of keeping what the forward dequantized.

NF4 experts (``io/nf4_experts.py``) are dequantized inside the layer by bitsandbytes ops on the layer's
loaded block. Those ops are custom ops, which the min-cut partitioner never recomputes, so it saved
their results for the backward: every expert's bf16 weights (transposed views of them), 6.4 GB a layer
at gpt-oss-120b's shape, alive from the region's forward (both matrices at once) to its backward, and
again through the backward's rerun of the layer. ``tag_dequantized_recompute`` marks the forward's
bitsandbytes ops and every node computed from the base alone around them (the scales, the views of the
result) ``MUST_RECOMPUTE``, so the region saves nothing of them: its backward dequantizes each matrix
from the block (a region input, free to keep) right before it reads it. The values are the same
bitsandbytes calls on the same bytes, so every codegen computes the same bits as before. What it costs:
a recomputed layer's experts are dequantized three times per micro-batch (forward, the backward's rerun,
the gradients) instead of twice; what it buys: one matrix at a time on the device instead of all of a
layer's, and a layer whose activations are kept (``save_activations``) keeps activations only (Qwen3-30B-A3B
at 512 tokens: 68 MB instead of 1.28 GB a layer; docs/bench/cpu/gptoss_experts.md).

Region forward, before (gpt-oss, ``E`` experts)::

    dequantize_blockwise = bitsandbytes.dequantize_blockwise(view_3, view_4, view_5, 256, f32)
    ...
    dequantize_4bit = bitsandbytes.dequantize_4bit(view_7, view_8, 64, 'nf4', [E, H, 2I], bf16)
    _grouped_mm = aten._grouped_mm(index, dequantize_4bit, cumsum)
    ...
    transpose_6 = aten.transpose(dequantize_4bit, -2, -1)
    return (add_8, ..., transpose_5, transpose_6, ...)    # [E, 2I, H] bf16 saved

After: the same forward, tagged; the backward computes ``dequantize_4bit`` and ``transpose_6`` itself::

    return (add_8, ...)                                   # no weight-sized tensor saved

Dense NF4 linears are not affected: bitsandbytes' ``MatMul4Bit`` saves the packed weight and dequantizes
in its own backward already. Nodes another tag marked (``sequence_chunks``' per-chunk recompute) keep it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .joint import is_tangent, reached_from

NAMESPACE = "bitsandbytes"
# larger than any chunk's checkpoint id: the partitioner saves a recomputed node whose recomputed user has
# a larger id (the boundary between two checkpointed calls); a chunk never reads a weight-only node that way
DEQUANTIZED_GRAPH_ID = 1 << 30


def tag_dequantized_recompute(joint: fx.GraphModule, primals: Sequence[Any]) -> int:
    """Mark the forward's bitsandbytes ops, the nodes they are computed from and the nodes computed from them
    alone ``MUST_RECOMPUTE``; returns how many it marked. ``primals``: the region's traced inputs, in the order
    of the joint graph's inputs before its tangents (their ``requires_grad`` says which take a gradient; the
    graph's placeholders do not keep it). Only nodes that neither a tangent nor an input that takes a
    gradient reaches (what is computed from the frozen base alone) are marked."""
    placeholders = joint.graph.find_nodes(op="placeholder")
    tangents = {n for n in placeholders if is_tangent(n)}
    takes_grad = {p for p, t in zip([n for n in placeholders if n not in tangents], primals)
                  if isinstance(t, torch.Tensor) and t.requires_grad}
    activations = reached_from(joint, tangents | takes_grad)  # what a tangent or an input that takes a gradient reaches
    weight_only = [n for n in joint.graph.nodes if n.op == "call_function" and n not in activations]
    found = {n for n in weight_only if getattr(n.target, "namespace", None) == NAMESPACE}
    # what they are computed from
    pending = list(found)
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg.op == "call_function" and arg not in activations and arg not in found:
                found.add(arg)
                pending.append(arg)
    # what is computed from them alone: views, transposes, casts of the result
    for node in weight_only:
        if node not in found and node.all_input_nodes and all(a in found for a in node.all_input_nodes):
            found.add(node)
    marked = 0
    for node in found:
        if "recompute" in node.meta:
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = DEQUANTIZED_GRAPH_ID
        marked += 1
    return marked
