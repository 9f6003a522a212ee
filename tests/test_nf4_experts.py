"""NF4 experts (``poros_fx/io/nf4_experts.py``): a mixture of experts' fused 3-D weights quantized one expert
matrix at a time by bitsandbytes, dequantized by bitsandbytes inside the region.

Byte identity: every stored tensor is what ``bitsandbytes.functional.quantize_4bit`` gives for that expert's
matrix, and the values the layer reads are what ``bitsandbytes.functional.dequantize_4bit`` gives from it.
Parity: streamed == ``stream=False`` (== the plain eager PEFT loop for Qwen3-MoE here; the generator compares
every mixture-of-experts family's NF4 draws with it) on the same NF4 model, every step.
"""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train_as
from poros_fx.handles import get_store
from poros_fx.io.nf4_experts import NF4Experts
import poros_fx
from poros_fx.models.tiny import (EXPERTS, add_lora, base_model, demo_batches, gemma4_options, lora_targets,
                                 tiny_config)

EQUAL = {s: 0.0 for s in SURFACES}


class OpCounter(TorchDispatchMode):
    """Counts the bitsandbytes ops that run under it, by name."""

    def __enter__(self) -> "OpCounter":
        self.calls: dict[str, int] = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "bitsandbytes":
            name = func._opname
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_each_expert_is_bitsandbytes_own_nf4_of_its_matrix():
    torch.manual_seed(0)
    plain = base_model(tiny_config("qwen3_moe", layers=1), dtype=torch.bfloat16)
    quantized = base_model(tiny_config("qwen3_moe", layers=1), dtype=torch.bfloat16, nf4=True)  # same seed
    experts, reference = quantized.model.layers[0].mlp.experts, plain.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        weights = getattr(reference, name).detach()
        stored = experts.parametrizations[name]
        assert isinstance(stored[0], NF4Experts) and not any(p.requires_grad for p in stored.parameters())
        values = getattr(experts, name)
        assert values.shape == weights.shape and values.dtype == torch.bfloat16
        for e, matrix in enumerate(weights):
            packed, state = bnb_functional.quantize_4bit(matrix.contiguous(), blocksize=64, compress_statistics=True,
                                                         quant_type="nf4")
            assert torch.equal(stored.original0[e], packed.reshape(-1))
            assert torch.equal(stored.original1[e], state.absmax)
            assert torch.equal(stored.original2[e], state.offset.reshape(()))
            assert torch.equal(stored.original3[e], state.state2.absmax)
            assert torch.equal(stored.original4, state.state2.code)
            assert torch.equal(values[e], bnb_functional.dequantize_4bit(packed, state))
    # a matrix that is not whole 64-value blocks (bitsandbytes' last block is partial), on meta too
    odd = torch.randn(2, 26, 21, dtype=torch.bfloat16)
    tensors = NF4Experts(torch.bfloat16).right_inverse(odd)
    meta = NF4Experts(torch.bfloat16).right_inverse(odd.to("meta"))
    assert [t.shape for t in meta] == [t.shape for t in tensors]
    parametrization = NF4Experts(torch.bfloat16)
    parametrization.right_inverse(odd)
    for e, matrix in enumerate(odd):
        packed, state = bnb_functional.quantize_4bit(matrix.contiguous(), blocksize=64, compress_statistics=True,
                                                     quant_type="nf4")
        assert torch.equal(tensors[0][e], packed.reshape(-1)) and torch.equal(tensors[1][e], state.absmax)
        assert torch.equal(parametrization(*tensors)[e], bnb_functional.dequantize_4bit(packed, state))
    with pytest.raises(ValueError, match=r"need a \[experts, out, in\] parameter"):
        NF4Experts(torch.bfloat16).right_inverse(torch.zeros(3, 5))


@pytest.mark.parametrize("shape, max_elements, calls", [
    ((3, 128, 128), None, 1),  # whole nested blocks per expert: one bitsandbytes call for all the experts
    ((5, 128, 128), 2 * 128 * 128, 3),  # past the 32-bit element index: calls of two experts at most
    ((3, 64, 64), None, 1),  # 64 blocks per expert: each expert's last nested block is partial
    ((4, 96, 200), None, 1),  # 300 blocks per expert (gpt-oss's 2880 x 5760 has 259200): two nested, one partial
    ((2, 26, 21), None, 2),  # 546 values per expert: its last 64-value block is partial, one call each
])
def test_experts_dequantize_as_bitsandbytes_does_each_matrix(shape, max_elements, calls, monkeypatch):
    """However the experts are grouped into bitsandbytes calls, each expert's values are bitsandbytes'
    ``dequantize_4bit`` of that expert's own quantized matrix; experts whose nested scale blocks do not end
    where they do (gpt-oss's) still take one call."""
    from poros_fx.io import nf4_experts

    if max_elements is not None:
        monkeypatch.setattr(nf4_experts, "MAX_KERNEL_ELEMENTS", max_elements)
    weights = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    parametrization = NF4Experts(torch.bfloat16)
    tensors = parametrization.right_inverse(weights)
    assert len(parametrization._groups(shape[0])) == calls
    with OpCounter() as counted:
        parametrization(*tensors)
    assert counted.calls == {"dequantize_blockwise": 1, "dequantize_4bit": calls}
    values = parametrization(*tensors)
    assert values.shape == weights.shape and values.dtype == torch.bfloat16
    for e, matrix in enumerate(weights):
        packed, state = bnb_functional.quantize_4bit(matrix.contiguous(), blocksize=64, compress_statistics=True,
                                                     quant_type="nf4")
        assert torch.equal(values[e], bnb_functional.dequantize_4bit(packed, state))


# the three expert layouts: [E, 2I, H] (Mixtral's is Qwen3-MoE's), gpt-oss's transposed ones with biases, and
# Gemma 4's experts beside a dense MLP; the generator (test_drawn_configs.py) draws NF4 bases of every
# mixture-of-experts family, Qwen3.5-MoE and Mixtral too
FAMILIES = {"qwen3_moe": {}, "gpt_oss": {}, "gemma4_text": dict(layers=4, **gemma4_options())}


def run(mode: str, family: str, config: dict) -> tuple:
    torch._dynamo.reset()
    model = add_lora(base_model(tiny_config(family, **{"layers": 2, **config}), dtype=torch.bfloat16, nf4=True),
                     targets=list(lora_targets(family)), dropout=0.1)
    return train_as(model, mode, demo_batches(4, vocab=256, seq=16, batch=2, seed=3), accumulate=2), model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nf4_experts_stream_exactly(family):
    """bf16 compute, LoRA dropout 0.1, accumulation 2 block-major: streamed == stream=False (and == the eager
    loop for Qwen3-MoE); the experts' NF4 tensors are the host store's, and layers of one structure share one
    region."""
    streamed, model = run("stream", family, FAMILIES[family])
    store = get_store(model)
    names = [e.name for e in store.host.tensors()]
    assert any(n.endswith("experts.parametrizations.gate_up_proj.original0") for n in names)
    if family == "qwen3_moe":  # layers of one structure (each has a parametrized class of its own)
        assert [r.layers for r in store.regions.regions] == [[0, 1]]
    resident, _ = run("resident", family, FAMILIES[family])
    assert compare(streamed, resident) == EQUAL, format_diffs(f"{family} streamed vs stream=False", compare(streamed, resident))
    if family == "qwen3_moe":  # the generator compares every family's NF4 draws with the eager loop
        eager, _ = run("eager", family, FAMILIES[family])
        assert compare(streamed, eager) == EQUAL, format_diffs(f"{family} streamed vs eager", compare(streamed, eager))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_regions_keep_no_dequantized_experts_for_their_backward(family):
    """The region's backward dequantizes the experts again from the loaded block (``regions/dequantized.py``):
    nothing of the experts' size is among what its forward saves, and the step still equals ``stream=False``
    (test_nf4_experts_stream_exactly, and the generator's NF4 draws)."""
    torch._dynamo.reset()
    model = add_lora(base_model(tiny_config(family, layers=2), dtype=torch.bfloat16, nf4=True),
                     targets=list(lora_targets(family)), dropout=0.0)
    poros_fx.prepare(model, device="cpu")
    batch = demo_batches(1, vocab=256, seq=16, batch=2, seed=3)[0]
    torch.compile(model, backend="poros")(**batch, use_cache=False).loss.backward()
    regions = get_store(model).regions.regions
    assert regions
    for region in regions:
        outputs = next(iter(region.forward.graph.find_nodes(op="output"))).args[0]
        saved = [tuple(n.meta["val"].shape) for n in outputs[region.num_outputs:] if isinstance(n, torch.fx.Node)]
        assert saved and not [s for s in saved if len(s) == 3 and s[0] == EXPERTS], saved
