"""NF4 quantization the way ``BitsAndBytesConfig`` does it: a model's decoder linears in place, one
weight as the loader reads it, and an NF4 weight's tensors placed in the host arena.

``quantize_nf4`` is used by tests, the demo and the benchmark to get a QLoRA base from random-init
weights without a hub: each ``nn.Linear`` under the decoder layers becomes a ``bnb.nn.Linear4bit`` whose
weight is quantized on ``device`` by bitsandbytes' own ``Params4bit`` path (embedding, norms and lm_head
stay as they are). bitsandbytes is imported where it is used: it is an optional dependency.
"""

from __future__ import annotations

import torch
from torch import nn

from ..host_modules import quant_state_tensors, set_quant_state
from ..runtime.arena import HostArena, nbytes

NF4_BLOCKSIZE = 64  # bitsandbytes' (and BitsAndBytesConfig's) default for NF4
NESTED_BLOCKSIZE = 256  # blocksize bitsandbytes uses for the nested (double) quantization of absmax


def linear4bit_like(lin: nn.Linear, *, compute_dtype: torch.dtype, nested: bool = True) -> nn.Module:
    """An empty (``meta``) NF4 ``Linear4bit`` of ``lin``'s shape; the caller sets its weight and bias."""
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                             compute_dtype=compute_dtype, compress_statistics=nested, quant_type="nf4", device="meta")


def quantize_nf4(model: nn.Module, *, layers: str = "model.layers", compute_dtype: torch.dtype = torch.bfloat16,
                 nested: bool = True, device: str | torch.device = "cpu", blocksize: int = 64) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model.<layers>`` by an NF4 ``Linear4bit`` (in place; returns ``model``)."""
    import bitsandbytes as bnb

    root = model.get_submodule(layers)
    for name, child in list(root.named_modules()):
        for attr, lin in list(child.named_children()):
            if type(lin) is not nn.Linear:
                continue
            q = linear4bit_like(lin, compute_dtype=compute_dtype, nested=nested)
            q.weight = bnb.nn.Params4bit(lin.weight.data.detach(), requires_grad=False,
                                         compress_statistics=nested, quant_type="nf4", blocksize=blocksize)
            if lin.bias is not None:
                q.bias = nn.Parameter(lin.bias.data.detach().clone(), requires_grad=False)
            q = q.to(device)
            setattr(child, attr, q)
    return model


def quantize_nf4_weight(weight: torch.Tensor, compute: torch.device) -> tuple[nn.Parameter, int]:
    """bitsandbytes' standard NF4 quantization of ``weight`` on ``compute``, the result moved to the host."""
    import bitsandbytes as bnb

    q = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4",
                          blocksize=NF4_BLOCKSIZE).to(compute)
    device_bytes = 0
    if q.device.type != "cpu":
        device_bytes = nbytes(weight) + nbytes(q)
        q = q.to("cpu")  # a quantized Params4bit moves its quant state along, in place
    return q, device_bytes


def place_nf4(q: torch.Tensor, arena: HostArena) -> None:
    """Move a host ``Params4bit``'s packed weight and the quant-state tensors ``prepare`` keeps into the arena."""
    q.data = arena.place(q.data)
    set_quant_state(q.quant_state, {k: arena.place(t) for k, t in quant_state_tensors(q.quant_state).items()})
