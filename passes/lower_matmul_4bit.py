"""Lower ``poros::matmul_4bit`` and ``poros::matmul_4bit_grad`` to the bitsandbytes calls they make.

Dynamo and AOTAutograd trace one opaque op per 4-bit linear (``poros_fx/ops.py``: tracing
bitsandbytes' Python for every linear made an NF4 first step 1.3–1.5x slower to compile). Run as is,
each op would cost host time of its own — a Python custom op around bitsandbytes' Python ops, and in
the backward a ``QuantState`` and bitsandbytes' argument checks: ~30–40 us per call on the CPU
machine, on a step that is bound by the host launching kernels. This pass replaces every call by
the ops its implementation calls, in the same order with the same arguments, so the graph runs the
very kernels the op (and ``bnb.matmul_4bit``) runs, without the op's own dispatch.

Forward (nested quant state), before / after::

    matmul_4bit = poros.matmul_4bit.default(x, w, [96, 64], absmax, 64, 'nf4', torch.float32, absmax2, code2,
                                            offset, 256, torch.float32, b)
    gemm_4bit = bitsandbytes.gemm_4bit.default(x, w, [96, 64], absmax2, 64, 'nf4', bias=b, absmax_8bit=absmax,
                                               absmax_code=code2, absmax_offset=offset)

Backward (``MatMul4Bit.backward``: ``matmul(grad, dequantize_4bit(w, state).to(grad.dtype))``)::

    matmul_4bit_grad = poros.matmul_4bit_grad.default(grad, w, [96, 64], absmax, 64, 'nf4', torch.float32,
                                                      absmax2, code2, offset, 256, torch.float32)
    dequantize_blockwise = bitsandbytes.dequantize_blockwise.default(absmax, absmax2, code2, 256, torch.float32)
    add_ = aten.add_.Tensor(dequantize_blockwise, offset)
    dequantize_4bit = bitsandbytes.dequantize_4bit.default(w, add_, 64, 'nf4', [96, 64], torch.float32)
    matmul = aten.matmul.default(grad, dequantize_4bit)     # a _to_copy first when grad's dtype differs

The new nodes carry the op's block (``meta``), so the passes after this one see them as the op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from poros_fx.compiler.ops import MATMUL_4BIT, MATMUL_4BIT_GRAD, gemm_4bit_call
from poros_fx.compiler.schedule import Schedule

_DROP = ("val", "tensor_meta")  # an intermediate's shape and dtype are not the op's


def _call(graph: fx.Graph, like: fx.Node, target: Any, args: tuple, kwargs: dict | None = None,
          last: bool = False) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    node.meta = {k: v for k, v in like.meta.items() if last or k not in _DROP}
    return node


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _dtype_of(node: Any) -> torch.dtype | None:
    return getattr(_val(node), "dtype", None)


def _lower_forward(graph: fx.Graph, n: fx.Node) -> fx.Node:
    x, packed, shape, absmax, blocksize, quant_type, _dtype, absmax2, code2, offset, _bs2, _dtype2, bias = n.args
    args, kwargs = gemm_4bit_call(x, packed, shape, absmax, blocksize, quant_type, absmax2, code2, offset, bias)
    return _call(graph, n, torch.ops.bitsandbytes.gemm_4bit.default, args, kwargs, last=True)


def _lower_grad(graph: fx.Graph, n: fx.Node) -> fx.Node:
    grad, packed, shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset, blocksize2, dtype2 = n.args
    # bitsandbytes.functional.dequantize_4bit, step by step
    if absmax2 is not None:
        absmax = _call(graph, n, torch.ops.bitsandbytes.dequantize_blockwise.default,
                       (absmax, absmax2, code2, blocksize2, dtype2))
        absmax = _call(graph, n, torch.ops.aten.add_.Tensor, (absmax, offset))
        if dtype2 != torch.float32:
            absmax = _call(graph, n, torch.ops.aten._to_copy.default, (absmax,), {"dtype": torch.float32})
    weight = _call(graph, n, torch.ops.bitsandbytes.dequantize_4bit.default,
                   (packed, absmax, blocksize, quant_type, shape, dtype))
    if _dtype_of(grad) != dtype:  # MatMul4Bit.backward's .to(grad.dtype)
        weight = _call(graph, n, torch.ops.aten._to_copy.default, (weight,), {"dtype": _dtype_of(grad)})
    return _call(graph, n, torch.ops.aten.matmul.default, (grad, weight), last=True)


def _lowerable(n: fx.Node) -> bool:
    """The op's own implementation runs where the graph lacks what lowering reads (a dtype, a shape),
    or where ``dequantize_4bit`` would transpose (a ``[1, n]`` packed weight; the prepared forward
    always passes ``[n, 1]``)."""
    packed = _val(n.args[1])
    if packed is None or packed.dim() != 2 or packed.shape[0] == 1:
        return False
    return n.target is MATMUL_4BIT or _dtype_of(n.args[0]) is not None


def lower_matmul_4bit(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in (MATMUL_4BIT, MATMUL_4BIT_GRAD) or not _lowerable(n):
            continue
        with graph.inserting_before(n):
            out = _lower_forward(graph, n) if n.target is MATMUL_4BIT else _lower_grad(graph, n)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
    return gm
