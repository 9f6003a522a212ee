"""Reshape views: a region's aten graph, run as it is (``codegen="eager"``), reshapes where it viewed.

The trace gives every value the strides its fake (meta) kernel computes, and AOTAutograd emits
``aten.view`` where those strides allow one. A real CPU kernel may lay its output out otherwise than
its meta kernel: Qwen3.5's Gated DeltaNet computes ``softplus(a + dt_bias)``, and the CPU's
``softplus_backward`` returns strides ``(96, 1, 24)`` where the meta kernel says ``(96, 4, 1)``; the
``view`` after it then fails at run time. ``aten.reshape`` is that very view wherever the view is
valid and a copy of the same values where it is not, so the graph computes the same bits either way.
Inductor picks its own layouts and is left alone.

Before (a region's backward, eager codegen)::

    softplus_backward = aten.softplus_backward(mul_80, add_6, 1, 20)
    mul_81 = aten.mul.Tensor(softplus_backward, 2.0)
    view_117 = aten.view.default(mul_81, [48, 4])

After::

    view_117 = aten.reshape.default(mul_81, [48, 4])
"""

from __future__ import annotations

import torch
import torch.fx as fx

from poros_fx.compiler.schedule import Schedule

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def reshape_views(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    if schedule.codegen != "eager":
        return gm
    for n in gm.graph.find_nodes(op="call_function", target=_VIEWS[0]):
        n.target = torch.ops.aten.reshape.default
    for n in gm.graph.find_nodes(op="call_function", target=_VIEWS[1]):
        n.target = torch.ops.aten.reshape.default
    return gm
