"""Which nodes of a region's joint graph (forward and backward in one, before the partitioner) are
reached from which inputs: what the recompute taggers (``sequence_chunks``, ``dequantized``) need to tell
the forward's nodes, and those computed from the frozen base alone, from the rest."""

from __future__ import annotations

import torch.fx as fx


def is_tangent(node: fx.Node) -> bool:
    """A placeholder of the joint graph that takes an output's gradient (AOTAutograd names them so)."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def reached_from(joint: fx.GraphModule, roots: set[fx.Node]) -> set[fx.Node]:
    """``roots`` (placeholders of ``joint``) and every node computed from one of them."""
    reached = set(roots)
    for node in joint.graph.nodes:
        if node.op != "placeholder" and any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    return reached
