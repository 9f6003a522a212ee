"""Opaque convolution backward: Inductor runs a region's ``aten.convolution_backward`` as one call.

Inductor's lowering of ``convolution_backward`` fixes the strides of the input gradient it lays out
(``guard_int_seq``), which fixes every size they are made of. Qwen3.5's Gated DeltaNet runs a causal
depthwise ``conv1d`` over ``[batch, channels, seq + 3]``, so its region's backward, compiled for
every sequence length, would hold for the length it was first compiled at only (the region then
traces and compiles again for each new length, and the outer graph with it). As
``poros::convolution_backward`` (``compiler/ops.py``) Inductor calls the aten kernel with no guard:
one compile serves every length. The eager codegen runs the aten graph as it is and keeps the op.

Before (a region's backward, Inductor codegen)::

    convolution_backward = aten.convolution_backward.default(mul_5, cat, primals_9, [0], [1], [3], [1],
                                                             False, [0], 50, [True, True, False])
    getitem_3 = convolution_backward[0]
    getitem_4 = convolution_backward[1]

After::

    convolution_backward = poros.convolution_backward.default(mul_5, cat, primals_9, [0], [1], [3], [1],
                                                              False, [0], 50, [True, True, False])
    getitem_3 = convolution_backward[0]
    getitem_4 = convolution_backward[1]        # positions among the gradients asked for
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from poros_fx.compiler.ops import CONVOLUTION_BACKWARD
from poros_fx.compiler.schedule import Schedule

aten = torch.ops.aten


def opaque_convolution_backward(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    if schedule.codegen != "inductor":
        return gm
    nodes = list(gm.graph.find_nodes(op="call_function", target=aten.convolution_backward.default))
    for n in nodes:
        output_mask = list(n.args[10] if len(n.args) > 10 else n.kwargs["output_mask"])
        position = {k: sum(output_mask[:k]) for k in range(3) if output_mask[k]}  # aten's index -> ours
        with gm.graph.inserting_before(n):
            call = gm.graph.call_function(CONVOLUTION_BACKWARD, n.args, n.kwargs)
        call.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")})
        val = n.meta.get("val")
        if val is not None:
            call.meta["val"] = [v for k, v in enumerate(val) if output_mask[k]]
        for user in list(n.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise AssertionError(f"poros: {user.format_node()} reads convolution_backward other than by index")
            user.args = (call, position[user.args[1]])
        gm.graph.erase_node(n)
        call.name = n.name
    if nodes:
        gm.recompile()
    return gm
