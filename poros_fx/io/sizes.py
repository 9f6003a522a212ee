"""Base bytes per block from a config alone (no weights): what ``poros-fx check`` reports.

The module tree is built on the ``meta`` device; each frozen tensor is counted in the block that reads
it, at the size the host store will give it: bf16 at 2 bytes an element, and for NF4 decoder linears
what bitsandbytes' nested quantization keeps (packed 4-bit weight, 8-bit absmax per 64 elements, the
fp32 absmax of those per 256, the 256-entry fp32 code, the fp32 offset). A plain embedding's table
counts in no block: its rows are gathered (a tied table counts in the head, which loads it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..families import Family, resolve
from ..prepare import block_names, gathers_rows, module_blocks

if TYPE_CHECKING:
    import transformers


def nf4_bytes(numel: int, blocksize: int = 64, nested: bool = True,
              align: Callable[[int], int] = lambda n: n) -> int:
    """Bytes bitsandbytes keeps for an NF4 weight of ``numel`` values; ``align`` rounds each of its
    tensors (the host arena places every tensor on a 512-byte boundary)."""
    packed = (numel + 1) // 2
    blocks = math.ceil(numel / blocksize)
    if not nested:
        return align(packed) + align(4 * blocks)
    return align(packed) + align(blocks) + align(4 * math.ceil(blocks / 256)) + align(4 * 256) + align(4)


def block_bytes(config: "transformers.PretrainedConfig", quantization: str = "nf4", block_size: int = 1,
                family: Family | None = None) -> tuple[list[str], list[int]]:
    """(block names, base bytes each block loads) for a model of ``config``."""
    if quantization not in ("nf4", "bf16"):
        raise ValueError(f"quantization must be 'nf4' or 'bf16', got {quantization!r}")
    import transformers

    fam = resolve(getattr(config, "model_type", None), family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layers = model.get_submodule(fam.layers)
    names = block_names(len(layers), block_size)
    block_of = module_blocks(fam, len(layers), block_size)
    sizes = [0] * len(names)
    # a tied embedding / lm_head tensor is listed under both modules: each block loads it, so it counts twice
    for mod_name, module in model.named_modules():
        if gathers_rows(module):
            continue  # the embedding's rows are gathered from the host store: no block loads its table
        for pname, p in module.named_parameters(recurse=False):
            block = block_of(mod_name)
            in_layers = mod_name.startswith(fam.layers + ".")
            if quantization == "nf4" and in_layers and type(module) is nn.Linear and pname == "weight":
                sizes[block] += nf4_bytes(p.numel())
            else:
                sizes[block] += p.numel() * 2
    return names, sizes
