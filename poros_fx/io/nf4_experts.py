"""NF4 for the fused 3-D expert parameters of mixture-of-experts layers, one bitsandbytes matrix per expert.

transformers 5 stores a layer's experts as 3-D parameters (``Qwen3MoeExperts.gate_up_proj``:
``[experts, 2 x moe_intermediate, hidden]``), not ``nn.Linear``s, so ``BitsAndBytesConfig`` leaves
them in bf16. ``quantize_experts_nf4`` gives each such parameter a ``torch.nn.utils.parametrize``
parametrization, ``NF4Experts``: registering it quantizes every expert's matrix with bitsandbytes'
own ``quantize_4bit`` (NF4, blocksize 64, nested absmax: what ``Params4bit`` does for one linear), and
reading the parameter dequantizes every expert with bitsandbytes' own ``dequantize_4bit``, in the
compute dtype, as a ``Linear4bit``'s backward dequantizes its weight. The experts' forward is then
transformers' own, on those values::

    experts.gate_up_proj            [E, N, K] bf16 parameter
    ->  experts.parametrizations.gate_up_proj.original0   [E, N*K/2] uint8   (expert e: quantize_4bit(W[e]))
        ... .original1 absmax [E, N*K/64] uint8, .original2 offset [E], .original3 absmax2, .original4 code2
        experts.gate_up_proj  ==  stack(dequantize_4bit(packed[e], state[e]) for e)
                              ==  dequantize_4bit(packed, scales) in one call where no 64-value block straddles
                                  two experts; scales: every expert's absmax by one dequantize_blockwise call,
                                  each expert's padded to whole nested blocks

Under ``prepare`` these tensors are frozen base like any other (streamed with their layer, loaded in
the region, where the dequantization runs). Exact against what: streamed == ``stream=False`` == the
eager loop on the same parametrized model, bit for bit; against bf16 experts it is NF4's rounding,
like any QLoRA base.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .quantize import NESTED_BLOCKSIZE, NF4_BLOCKSIZE

# bitsandbytes' blockwise kernels index elements with a 32-bit int
MAX_KERNEL_ELEMENTS = 2**31 - 1


class NF4Experts(nn.Module):
    """The parametrization: ``right_inverse`` quantizes ``[E, N, K]`` expert by expert into the tensors
    ``forward`` takes (``ORIGINALS``: ``original0`` .. ``original4`` of the parametrization list), and
    ``forward`` dequantizes all of them (``dtype``: the values' dtype, the original parameter's)."""

    ORIGINALS = ("packed", "absmax", "offset", "absmax2", "code2")

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.shape: tuple[int, ...] = ()  # one expert's matrix

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        import bitsandbytes.functional as bnb_functional

        if weight.dim() != 3:
            raise ValueError(f"NF4 experts need a [experts, out, in] parameter, got {tuple(weight.shape)}")
        self.shape = tuple(weight.shape[1:])
        if weight.is_meta:  # the loader's skeleton: the sizes only (bitsandbytes would cache its code table on meta)
            # bitsandbytes' sizes: a last block may be partial, an odd count of values packs into a last byte
            experts, numel = weight.shape[0], weight[0].numel()
            blocks = -(-numel // NF4_BLOCKSIZE)
            return (torch.empty(experts, (numel + 1) // 2, dtype=torch.uint8, device="meta"),
                    torch.empty(experts, blocks, dtype=torch.uint8, device="meta"),
                    torch.empty(experts, dtype=torch.float32, device="meta"),
                    torch.empty(experts, -(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32, device="meta"),
                    torch.empty(256, dtype=torch.float32, device="meta"))
        packed, absmax, offset, absmax2 = [], [], [], []
        code2 = None
        for matrix in weight.detach():
            p, state = bnb_functional.quantize_4bit(matrix.contiguous(), blocksize=NF4_BLOCKSIZE,
                                                    compress_statistics=True, quant_type="nf4")
            packed.append(p.reshape(-1))
            absmax.append(state.absmax)
            offset.append(state.offset.reshape(1))
            absmax2.append(state.state2.absmax)
            code2 = state.state2.code
        return torch.stack(packed), torch.stack(absmax), torch.cat(offset), torch.stack(absmax2), code2

    def forward(self, packed: torch.Tensor, absmax: torch.Tensor, offset: torch.Tensor, absmax2: torch.Tensor,
                code2: torch.Tensor) -> torch.Tensor:
        scales = self._scales(absmax, offset, absmax2, code2)
        parts = [self._dequantize(packed[a:b], scales[a:b]) for a, b in self._groups(packed.shape[0])]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _groups(self, experts: int) -> list[tuple[int, int]]:
        """Ranges of experts dequantized by one bitsandbytes call each: all of them in one, unless a block of
        values would straddle two experts (then one each), or the call would pass bitsandbytes' 32-bit element
        index."""
        numel = math.prod(self.shape)
        if numel % NF4_BLOCKSIZE:
            return [(e, e + 1) for e in range(experts)]
        per_call = max(1, MAX_KERNEL_ELEMENTS // numel)
        return [(a, min(a + per_call, experts)) for a in range(0, experts, per_call)]

    @staticmethod
    def _scales(absmax: torch.Tensor, offset: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor) -> torch.Tensor:
        """Every expert's fp32 block scales ``[E, blocks]``, by one bitsandbytes ``dequantize_blockwise`` call: each
        expert's quantized absmax is padded to whole nested blocks, so that no nested block straddles two experts
        and each value is what that expert's own call gives (``code2[q] x absmax2[block]``), plus its offset."""
        experts, blocks = absmax.shape
        whole = absmax2.shape[1] * NESTED_BLOCKSIZE  # each expert's nested blocks, the last one filled up
        padded = absmax if whole == blocks else torch.nn.functional.pad(absmax, (0, whole - blocks))
        scales = torch.ops.bitsandbytes.dequantize_blockwise(padded.reshape(-1), absmax2.reshape(-1), code2,
                                                            NESTED_BLOCKSIZE, torch.float32)
        return scales.view(experts, whole)[:, :blocks] + offset[:, None]

    def _dequantize(self, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' ``dequantize_4bit`` of a run of experts whose blocks of values do not straddle two of
        them, from their block scales: each element is what it is for its expert alone."""
        return torch.ops.bitsandbytes.dequantize_4bit(packed.reshape(-1, 1), scales.reshape(-1), NF4_BLOCKSIZE, "nf4",
                                                      [packed.shape[0], *self.shape], self.dtype)


def is_experts_module(module: nn.Module) -> bool:
    """A fused experts module: transformers' ``use_experts_implementation`` sets these on each one."""
    return all(key in vars(module) for key in ("has_gate", "is_transposed", "is_concatenated"))


def expert_parameters(module: nn.Module) -> list[str]:
    """The names of a fused experts module's own 3-D parameters (its expert matrices; 2-D biases stay)."""
    if not is_experts_module(module):
        return []
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3]


def quantize_experts_nf4(model: nn.Module, *, layers: str = "model.layers") -> int:
    """Give every fused 3-D expert parameter under ``model.<layers>`` an ``NF4Experts`` parametrization
    (in place; the packed values are frozen); returns how many. A base model's: before attaching an adapter."""
    count = 0
    for module in model.get_submodule(layers).modules():
        for name in expert_parameters(module):
            getattr(module, name).requires_grad_(False)  # the originals take it: packed bytes cannot have gradients
            parametrize.register_parametrization(module, name, NF4Experts(getattr(module, name).dtype), unsafe=True)
            count += 1
    return count


def place_nf4_experts(module: nn.Module, name: str, weight: torch.Tensor, arena: Any) -> int:
    """Quantize ``weight`` (``[E, N, K]``, on the device it was made on) into the NF4 experts
    parametrization ``module.<name>`` already has (built on ``meta`` by the loader), its tensors placed in
    the host ``arena``; returns the bytes they took on that device on the way."""
    parametrization = module.parametrizations[name]
    stored = parametrization[0].right_inverse(weight)
    for i, t in enumerate(stored):
        parametrization._parameters[f"original{i}"] = nn.Parameter(arena.place(t.to("cpu")), requires_grad=False)
    return sum(t.numel() * t.element_size() for t in stored) if weight.device.type != "cpu" else 0
