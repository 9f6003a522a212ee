"""Random init for ``from_config``: each tensor generated on its own from a seed and its name.

normal(0, ``initializer_range``) for linear and embedding weights, ones for norm weights, zeros for
biases, on the compute device in chunks (a 72B's embedding is 2.5 GB in bf16), so the same seed on the
same device type gives the same weights whatever the number of layers.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from .checkpoint import Alloc, Fetch
from ..handles import text_config
from .meta_model import COMPUTE_DTYPE, is_nf4_experts, is_nf4_weight, nf4_logical_shape, split_name

if TYPE_CHECKING:
    import transformers


def init_std(config: "transformers.PretrainedConfig") -> float:
    """The config's ``initializer_range`` (0.02 when it has none)."""
    text = text_config(config)
    return float(getattr(text, "initializer_range", None) or 0.02)


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed per tensor, so each tensor's values depend only on (seed, name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "little") >> 1


RANDOM_CHUNK_ELEMENTS = 16 * 2**20  # fp32 values generated per call: 64 MB on the device at most


def random_fetcher(model: nn.Module, name: str, meta: torch.Tensor, seed: int, std: float,
                    compute: torch.device) -> Fetch:
    """What makes tensor ``name`` (shaped as ``meta``, or an NF4 weight's logical shape) from ``seed``."""
    owner_name, attr = split_name(name)
    owner = model.get_submodule(owner_name)
    shape = nf4_logical_shape(owner) if is_nf4_weight(owner, attr) else tuple(meta.shape)
    if attr == "bias":
        kind = "zeros"
    elif "norm" in type(owner).__name__.lower():
        kind = "ones"
    else:
        kind = "normal"
    padding_idx = getattr(owner, "padding_idx", None) if isinstance(owner, nn.Embedding) else None

    # a decoder linear is quantized on the compute device; everything else goes to the host store as it is
    # made, so only the chunk being generated is on the device (a 72B's embedding is 2.5 GB in bf16)
    target = compute if is_nf4_weight(owner, attr) or is_nf4_experts(owner, attr) else torch.device("cpu")

    def fetch(alloc: Alloc) -> torch.Tensor:
        w = alloc(shape, COMPUTE_DTYPE) if target.type == "cpu" else torch.empty(shape, dtype=COMPUTE_DTYPE,
                                                                                  device=target)
        if kind == "zeros":
            return w.zero_()
        if kind == "ones":
            return w.fill_(1)
        g = torch.Generator(device=compute).manual_seed(tensor_seed(seed, name))
        rows = w.view(-1, shape[-1]) if w.dim() else w.view(1, 1)
        step = max(1, RANDOM_CHUNK_ELEMENTS // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            part = torch.randn((min(step, rows.shape[0] - start), rows.shape[1]), generator=g, dtype=torch.float32,
                               device=compute)
            rows[start:start + part.shape[0]].copy_(part * std)  # copy_ rounds to bf16 as .to() does
        if padding_idx is not None:
            w[padding_idx].zero_()
        return w

    return fetch
