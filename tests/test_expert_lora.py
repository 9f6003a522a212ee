"""LoRA on a mixture of experts' fused weights (PEFT's ``target_parameters``) in a region
(``poros_fx/compiler/regions/parameter_lora.py``).

Float experts: streamed (accumulation 2, block-major) == ``stream=False`` == the plain eager PEFT loop, for
Qwen3-MoE's experts layout and gpt-oss's transposed one with biases. NF4 experts (named by full path, which
is how PEFT matches a parametrized weight): streamed == ``stream=False``; PEFT's own forward cannot run them.
"""

from __future__ import annotations

import peft
import pytest
import torch

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train, train_as
from poros_fx.models.tiny import (add_lora, base_model, demo_batches, expert_parameter_paths, expert_paths_of_config,
                                  lora_targets, tiny_config)

EQUAL = {s: 0.0 for s in SURFACES}


def run(mode: str, family: str, *, nf4: bool = False) -> tuple:
    torch._dynamo.reset()
    base = base_model(tiny_config(family, layers=2), dtype=torch.bfloat16, nf4=nf4)
    # PEFT refuses LoRA dropout on a parameter
    model = add_lora(base, targets=list(lora_targets(family)), dropout=0.0, parameters=expert_parameter_paths(base))
    return train_as(model, mode, demo_batches(4, vocab=256, seq=16, batch=2, seed=3), accumulate=2), model


def expert_adapters(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "experts.lora_" in n or "experts.base_layer.lora_" in n]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_on_float_experts_is_exact_to_both_references(family):
    streamed, model = run("stream", family)
    adapters = expert_adapters(model)
    assert len(adapters) == 2 * 2 * 2  # two layers, two weights, A and B
    resident, _ = run("resident", family)
    assert compare(streamed, resident) == EQUAL, format_diffs(f"{family} streamed vs stream=False",
                                                              compare(streamed, resident))
    eager, eager_model = run("eager", family)
    assert compare(streamed, eager) == EQUAL, format_diffs(f"{family} streamed vs eager", compare(streamed, eager))
    # the experts' adapters trained (LoRA B starts non-zero, so A moves from the first step)
    fresh = expert_adapters(add_lora(base_model(tiny_config(family, layers=2), dtype=torch.bfloat16),
                                     targets=list(lora_targets(family)), dropout=0.0,
                                     parameters=["experts.gate_up_proj", "experts.down_proj"]))
    assert all(not torch.equal(a, b) for a, b in zip(adapters, fresh))


def test_lora_on_nf4_experts_streams_exactly_to_stream_false():
    streamed, model = run("stream", "qwen3_moe", nf4=True)
    assert len(expert_adapters(model)) == 8
    resident, _ = run("resident", "qwen3_moe", nf4=True)
    assert compare(streamed, resident) == EQUAL, format_diffs("NF4 experts streamed vs stream=False",
                                                              compare(streamed, resident))


def test_a_bare_expert_name_peft_skipped_on_nf4_experts_is_refused():
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    with pytest.warns(RuntimeWarning, match="no parameter was matched"):
        model = peft.get_peft_model(base_model(tiny_config("qwen3_moe"), dtype=torch.bfloat16, nf4=True), lora)
    with pytest.raises(PorosConfigError, match=r"'mlp.experts.down_proj' names decoder layer 0's mlp.experts.down_proj"
                                               r".*full module path"):
        poros_fx.prepare(model, device="cpu")


def test_lora_on_expert_parameters_without_regions_is_refused():
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    model = peft.get_peft_model(base_model(tiny_config("qwen3_moe")), lora)
    with pytest.raises(PorosConfigError, match="LoRA on the parameter 'down_proj'.*regions=False"):
        poros_fx.prepare(model, device="cpu", regions=False)


def test_the_loader_attaches_lora_to_every_layers_nf4_experts_by_full_path():
    """What ``poros-fx bench --expert-lora`` builds: ``from_config`` with NF4 experts and the full paths of
    ``expert_paths_of_config``; every layer's two experts weights are adapted and a compiled step trains them."""
    config = tiny_config("qwen3_moe", layers=2)
    paths = expert_paths_of_config(config)
    assert paths == [f"model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(lora_targets("qwen3_moe")), target_parameters=paths)
    model = poros_fx.from_config(config, "nf4", device="cpu", seed=0, lora=lora, progress=False)
    assert len(expert_adapters(model)) == 8
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend="poros")(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in expert_adapters(model))
    assert expert_paths_of_config(tiny_config("qwen2")) == []


def attached_after_prepare(mode: str) -> tuple:
    torch._dynamo.reset()
    base = base_model(tiny_config("qwen3_moe", layers=2), dtype=torch.bfloat16, nf4=True).requires_grad_(False)
    paths = expert_parameter_paths(base)
    poros_fx.prepare(base, device="cpu", codegen="eager")
    model = add_lora(base, targets=list(lora_targets("qwen3_moe")), dropout=0.0, parameters=paths)
    step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    return train(model, step_model, demo_batches(2, vocab=256, seq=16, batch=2, seed=3)), model


def test_lora_on_nf4_experts_attached_after_prepare():
    """PEFT reads each experts weight while it attaches (a dequantization of the prepared NF4 tensors, not a
    forward) and places the adapter where the experts' first tensor is (the host): it is moved to the compute
    device, and the run is equal to stream=False."""
    streamed, model = attached_after_prepare("stream")
    assert len(expert_adapters(model)) == 8
    resident, _ = attached_after_prepare("resident")
    assert compare(streamed, resident) == EQUAL, format_diffs("attached after prepare", compare(streamed, resident))
