"""CPU dropout backward: a region's aten graph, run as it is (``codegen="eager"``), takes dropout's
gradient as eager's CPU autograd does.

Traced, ``F.dropout`` is ``aten.native_dropout`` (torch's own decomposition of ``aten.dropout``) and
its gradient ``native_dropout_backward(grad, mask, scale)``: ``grad * mask * scale``, rounded once.
Eager on the CPU never runs that kernel: ``at::dropout`` uses the fused one on accelerators only, and
on the CPU draws ``noise = bernoulli(1 - p)`` in the input's dtype, divides it by ``1 - p`` in that
dtype and returns ``input * noise``; autograd's gradient is ``grad * noise``. The forward values and
the random draws are the same; in bf16 and fp16 the gradients are not (``1 / 0.9`` rounds to
1.109375 in bf16 before it multiplies). So on the CPU each ``native_dropout_backward`` becomes eager's
ops (fp32 gives the same bits either way). On CUDA eager runs ``native_dropout`` itself, and Inductor
computes its own way: both are left alone.

Before (a region's backward, eager codegen, CPU, bf16)::

    native_dropout_backward = aten.native_dropout_backward.default(view_36, getitem_15, 1.1111111111111112)

After::

    _to_copy = aten._to_copy.default(getitem_15, dtype=torch.bfloat16)
    div = aten.div.Tensor(_to_copy, 0.9)
    native_dropout_backward = aten.mul.Tensor(view_36, div)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from poros_fx.compiler.schedule import Schedule

aten = torch.ops.aten


def cpu_dropout_backward(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    if schedule.codegen != "eager":
        return gm
    changed = False
    for n in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout_backward.default)):
        grad, mask, scale = n.args
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
            continue
        with gm.graph.inserting_before(n):
            mask_as_input = gm.graph.call_function(aten._to_copy.default, (mask,), {"dtype": val.dtype})
            noise = gm.graph.call_function(aten.div.Tensor, (mask_as_input, 1.0 / scale))
            product = gm.graph.call_function(aten.mul.Tensor, (grad, noise))
        for node in (mask_as_input, noise, product):
            node.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")})
        fake = mask.meta.get("val")
        if fake is not None:
            with fake.fake_mode:
                mask_as_input.meta["val"] = fake.to(val.dtype)
                noise.meta["val"] = mask_as_input.meta["val"] / (1.0 / scale)
        product.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(product)
        gm.graph.erase_node(n)
        product.name = n.name
        changed = True
    if changed:
        gm.recompile()
    return gm
