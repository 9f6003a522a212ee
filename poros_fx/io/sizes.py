"""Base bytes per block from a config alone (no weights): what ``poros-fx check`` reports.

The module tree is built on the ``meta`` device; each frozen tensor is counted in the block that reads
it, at the size the host store will give it: bf16 at 2 bytes an element, and for NF4 decoder linears
what bitsandbytes' nested quantization keeps (packed 4-bit weight, 8-bit absmax per 64 elements, the
fp32 absmax of those per 256, the 256-entry fp32 code, the fp32 offset); NF4 experts the same per expert
matrix, stacked, with one code. A plain embedding's table
counts in no block: its rows are gathered (a tied table counts in the head, which loads it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..families import Family, resolve
from ..host_modules import gathers_rows
from ..prepare import block_names, module_blocks
from ..runtime.arena import aligned
from .nf4_experts import expert_parameters

if TYPE_CHECKING:
    import transformers


def nf4_tensors(numel: int, blocksize: int = 64, nested: bool = True) -> list[int]:
    """Bytes of each tensor bitsandbytes keeps for an NF4 weight of ``numel`` values, in the order
    ``prepare`` places them: the packed weight, then the quant state (absmax; nested: the 8-bit absmax,
    its offset, its own absmax and code)."""
    packed = (numel + 1) // 2
    blocks = math.ceil(numel / blocksize)
    if not nested:
        return [packed, 4 * blocks]
    return [packed, blocks, 4, 4 * math.ceil(blocks / 256), 4 * 256]


def nf4_expert_tensors(experts: int, numel: int) -> list[int]:
    """Bytes of each tensor an NF4 experts weight keeps (``io/nf4_experts.py``: each of ``experts``
    matrices of ``numel`` values quantized nested, their tensors stacked; one code table)."""
    packed, blocks, offset, absmax2, code = nf4_tensors(numel)
    return [experts * packed, experts * blocks, experts * offset, experts * absmax2, code]


def nf4_bytes(numel: int, blocksize: int = 64, nested: bool = True,
              align: Callable[[int], int] = lambda n: n) -> int:
    """Bytes bitsandbytes keeps for an NF4 weight of ``numel`` values; ``align`` rounds each of its
    tensors (the host arena places every tensor on a 512-byte boundary)."""
    return sum(align(n) for n in nf4_tensors(numel, blocksize, nested))


def block_bytes(config: "transformers.PretrainedConfig", quantization: str = "nf4", block_size: int = 1,
                family: Family | None = None, regions: bool = True) -> tuple[list[str], list[int]]:
    """(block names, base bytes each block loads) for a model of ``config``. With ``regions`` (prepare's
    default) a decoder layer loads the arena span that holds its tensors side by side: their bytes and
    the 512-byte alignment gaps between them."""
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
    spans: dict[str, list[int]] = {}  # decoder layer -> its tensors' bytes, in the order prepare places them
    # a tied embedding / lm_head tensor is listed under both modules: each block loads it, so it counts twice
    for mod_name, module in model.named_modules():
        if gathers_rows(module):
            continue  # the embedding's rows are gathered from the host store: no block loads its table
        for pname, p in module.named_parameters(recurse=False):
            block = block_of(mod_name)
            in_layers = mod_name.startswith(fam.layers + ".")
            if quantization == "nf4" and in_layers and type(module) is nn.Linear and pname == "weight":
                tensors = nf4_tensors(p.numel())
            elif quantization == "nf4" and in_layers and pname in expert_parameters(module):
                tensors = nf4_expert_tensors(p.shape[0], p[0].numel())
            else:
                tensors = [p.numel() * 2]
            if regions and in_layers:
                spans.setdefault(".".join(mod_name.split(".")[:fam.layers.count(".") + 2]), []).extend(tensors)
            else:
                sizes[block] += sum(tensors)
    for layer, tensors in spans.items():
        sizes[block_of(layer)] += sum(aligned(n) for n in tensors[:-1]) + tensors[-1]
    return names, sizes
