"""Quantize a model's decoder linears to bitsandbytes NF4 in place, the way ``BitsAndBytesConfig`` does.

Used by tests, the demo and the benchmark to get a QLoRA base from random-init weights without a hub:
each ``nn.Linear`` under the decoder layers becomes a ``bnb.nn.Linear4bit`` whose weight is quantized
on ``device`` by bitsandbytes' own ``Params4bit`` path (embedding, norms and lm_head stay as they are).
"""

from __future__ import annotations

import torch
from torch import nn


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
