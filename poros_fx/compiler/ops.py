"""Custom ops: ``poros::load`` and ``poros::gather`` make host-resident weights traceable;
``poros::matmul_4bit`` is bitsandbytes' 4-bit matmul as one op (below).

``poros::load(host, device)`` is the one op through which every frozen base tensor reaches the
computation. It is *pure* (its output never aliases its input), so Dynamo, AOTAutograd and the
min-cut partitioner treat it like any other functional op: it can be tagged for recompute, it is
never saved for the backward, and its fake impl puts the result on the target device so fake-tensor
propagation sees device tensors only. After partitioning, the residency pass replaces each call by
the runtime's own load (ledger, cache, copy stream), so this eager impl only runs outside compiled
graphs (for example when user code reads ``module.weight`` of a prepared model, or Dynamo ran part of a
step eagerly); it books its copy in the model's ledger and warns once when that happens with grad
enabled (``HostStore.on_eager``). ``poros::gather`` runs as itself inside the graphs too (its rows are
an activation, not a base tensor held on the device), so only a call outside them is reported.
"""

from __future__ import annotations

from typing import Any

import torch

from ..handles import ENTRY_ATTR


@torch.library.custom_op("poros::load", mutates_args=())
def load(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of a host-store tensor (always a new tensor, never a view of ``host``)."""
    out = host.to(device, copy=True)
    store = _store_of(host)
    if store is not None:
        store.on_eager("poros::load", out)
    return out


def _store_of(host: torch.Tensor) -> Any:
    """The host store ``host`` belongs to (a head chunk is a slice of its entry's tensor), or ``None``."""
    entry = getattr(host, ENTRY_ATTR, None)
    if entry is None and host._base is not None:
        entry = getattr(host._base, ENTRY_ATTR, None)
    return None if entry is None else entry.store


@load.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


LOAD = torch.ops.poros.load.default


@torch.library.custom_op("poros::gather", mutates_args=())
def gather(host: torch.Tensor, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``indices`` of the host-store table ``host`` on ``device``: an embedding lookup that copies
    only the rows a batch reads (a 72B's table is 2.5 GB; 512 rows of it are 8 MB). The values are
    the table's own bytes, as ``F.embedding`` on a device copy of the table gives them."""
    rows = host.index_select(0, indices.reshape(-1).to("cpu"))
    store = _store_of(host)
    if store is not None:
        store.on_eager("poros::gather", None)
    return rows.view(*indices.shape, host.shape[1]).to(device)


@gather.register_fake
def _(host: torch.Tensor, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.new_empty((*indices.shape, host.shape[1]), device=device)


GATHER = torch.ops.poros.gather.default


# -- bitsandbytes 4-bit matmul as one opaque op -------------------------------------------------------
#
# A prepared ``Linear4bit`` calls ``poros::matmul_4bit`` instead of ``bnb.matmul_4bit``. The result is
# the same kernels in the same order — the forward is the very ``bitsandbytes::gemm_4bit`` call that
# bitsandbytes 0.50's ``MatMul4Bit.forward`` makes, the backward ``MatMul4Bit.backward``'s
# ``matmul(grad, dequantize_4bit(B).to(grad.dtype))`` — but Dynamo sees one op per linear instead of
# tracing bitsandbytes' Python (``matmul_4bit``, the ``autograd.Function``, its backward's nested
# dequantize) for every linear of every layer: on the CPU an 8-layer NF4 Qwen2 traces in 5.0–5.6 s instead
# of 7.5–10.6 s. After partitioning, ``passes/lower_matmul_4bit.py`` replaces each call by the bitsandbytes ops
# its implementation calls (so the compiled step pays no dispatch of its own); the implementation below
# runs when a prepared model is called outside torch.compile. ``matmul_4bit_applies`` says when the op
# applies; otherwise the prepared forward calls ``bnb.matmul_4bit``.


def matmul_4bit_applies(nested: bool, blocksize2: int | None) -> bool:
    """Whether ``poros::matmul_4bit`` computes what ``bnb.matmul_4bit`` would for a weight with this
    quant state: bitsandbytes has the ``gemm_4bit`` op (0.50 and later; 0.49's ``MatMul4Bit``
    dequantizes and calls ``linear`` instead) and a nested state has bnb's one supported absmax
    blocksize (256). The caller also needs a frozen bias (bnb's bias gradient is not mirrored)."""
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    return hasattr(torch.ops.bitsandbytes, "gemm_4bit") and (not nested or blocksize2 == 256)


def _quant_state(shape: list[int], absmax: torch.Tensor, blocksize: int, quant_type: str, dtype: torch.dtype,
                 absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: torch.Tensor | None,
                 blocksize2: int, dtype2: torch.dtype) -> Any:
    from bitsandbytes.functional import QuantState

    state2 = None if absmax2 is None else QuantState(absmax=absmax2, code=code2, blocksize=blocksize2, dtype=dtype2)
    return QuantState(absmax=absmax, shape=torch.Size(shape), blocksize=blocksize, quant_type=quant_type, dtype=dtype,
                      offset=offset, state2=state2)


def gemm_4bit_call(x: Any, packed: Any, shape: Any, absmax: Any, blocksize: int, quant_type: str, absmax2: Any,
                   code2: Any, offset: Any, bias: Any) -> tuple[tuple, dict]:
    """The arguments of ``MatMul4Bit.forward``'s one ``bitsandbytes::gemm_4bit`` call (a nested state
    passes its own absmax as ``absmax`` and the 8-bit one as ``absmax_8bit``); tensors or graph nodes."""
    if absmax2 is None:
        return (x, packed, shape, absmax, blocksize, quant_type), {"bias": bias}
    return ((x, packed, shape, absmax2, blocksize, quant_type),
            {"bias": bias, "absmax_8bit": absmax, "absmax_code": code2, "absmax_offset": offset})


def _gemm_4bit(*inputs: Any) -> torch.Tensor:
    """That call (under fake tensors, bitsandbytes' fake: same shape, dtype, checks)."""
    args, kwargs = gemm_4bit_call(*inputs)
    return torch.ops.bitsandbytes.gemm_4bit.default(*args, **kwargs)


@torch.library.custom_op("poros::matmul_4bit", mutates_args=())
def matmul_4bit(x: torch.Tensor, packed: torch.Tensor, shape: list[int], absmax: torch.Tensor, blocksize: int,
                quant_type: str, dtype: torch.dtype, absmax2: torch.Tensor | None, code2: torch.Tensor | None,
                offset: torch.Tensor | None, blocksize2: int, dtype2: torch.dtype,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for the 4-bit ``W`` given by ``packed`` (``[(N*K+1)//2, 1]``) and its quant
    state (nested: ``absmax`` is the 8-bit absmax, ``absmax2``/``code2``/``offset`` its own state;
    ``dtype``, ``blocksize2`` and ``dtype2`` are read by the backward only)."""
    return _gemm_4bit(x, packed, shape, absmax, blocksize, quant_type, absmax2, code2, offset, bias)


@matmul_4bit.register_fake
def _(x, packed, shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset, blocksize2, dtype2, bias):
    return _gemm_4bit(x, packed, shape, absmax, blocksize, quant_type, absmax2, code2, offset, bias)


@torch.library.custom_op("poros::matmul_4bit_grad", mutates_args=())
def matmul_4bit_grad(grad: torch.Tensor, packed: torch.Tensor, shape: list[int], absmax: torch.Tensor, blocksize: int,
                     quant_type: str, dtype: torch.dtype, absmax2: torch.Tensor | None, code2: torch.Tensor | None,
                     offset: torch.Tensor | None, blocksize2: int, dtype2: torch.dtype) -> torch.Tensor:
    """The input gradient of ``matmul_4bit``: bitsandbytes' ``MatMul4Bit.backward``,
    ``matmul(grad, dequantize_4bit(B, state).to(grad.dtype))``."""
    from bitsandbytes.functional import dequantize_4bit

    state = _quant_state(shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset, blocksize2, dtype2)
    return torch.matmul(grad, dequantize_4bit(packed, state).to(grad.dtype))


@matmul_4bit_grad.register_fake
def _(grad, packed, shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset, blocksize2, dtype2):
    return grad.new_empty((*grad.shape[:-1], shape[1]))


def _matmul_4bit_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, packed, shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset, blocksize2, dtype2, bias = inputs
    ctx.save_for_backward(packed, absmax, absmax2, code2, offset)
    ctx.state = (shape, blocksize, quant_type, dtype, blocksize2, dtype2)


def _matmul_4bit_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    packed, absmax, absmax2, code2, offset = ctx.saved_tensors
    shape, blocksize, quant_type, dtype, blocksize2, dtype2 = ctx.state
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = MATMUL_4BIT_GRAD(grad, packed, shape, absmax, blocksize, quant_type, dtype, absmax2, code2, offset,
                                  blocksize2, dtype2)
    return (grad_x,) + (None,) * 12


matmul_4bit.register_autograd(_matmul_4bit_backward, setup_context=_matmul_4bit_setup)

MATMUL_4BIT = torch.ops.poros.matmul_4bit.default
MATMUL_4BIT_GRAD = torch.ops.poros.matmul_4bit_grad.default


def _wanted_gradients(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: Any, stride: Any,
                      padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                      output_mask: list[bool]) -> list[torch.Tensor]:
    """``aten.convolution_backward``'s gradients that ``output_mask`` asks for, in its order (on fake
    tensors too: the aten op's own meta)."""
    out = torch.ops.aten.convolution_backward.default(grad, input, weight, bias_sizes, stride, padding, dilation,
                                                      transposed, output_padding, groups, output_mask)
    return [g for g, wanted in zip(out, output_mask) if wanted]


@torch.library.custom_op("poros::convolution_backward", mutates_args=())
def convolution_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: list[int] | None,
                         stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
                         output_padding: list[int], groups: int, output_mask: list[bool]) -> list[torch.Tensor]:
    """``_wanted_gradients`` as one call Inductor runs as it is (its own lowering of the op fixes the
    input's strides, and with them every size; see ``passes/opaque_convolution_backward.py``)."""
    return _wanted_gradients(grad, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                             groups, output_mask)


convolution_backward.register_fake(_wanted_gradients)

CONVOLUTION_BACKWARD = torch.ops.poros.convolution_backward.default


def _copy_after(x: torch.Tensor, results: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``x`` (on fake tensors too); ``results`` are read by nobody, only waited for."""
    return x.clone()


@torch.library.custom_op("poros::after", mutates_args=())
def after(x: torch.Tensor, results: list[torch.Tensor]) -> torch.Tensor:
    """``x``, copied once ``results`` exist: an order Inductor's scheduler keeps between two token chunks
    of a region (``passes/order_sequence_chunks.py``)."""
    return _copy_after(x, results)


after.register_fake(_copy_after)

AFTER = torch.ops.poros.after.default
