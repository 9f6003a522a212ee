"""A prepared base without an adapter; adapters attached after ``prepare``; merging refused.

``prepare`` takes a base with no trainable parameters; PEFT's ``get_peft_model`` or
``PeftModel.from_pretrained`` on it afterwards works (torch's registration hooks keep the layers'
tensor lists current). Merging an adapter into a streamed base would change a loaded copy of the base
weight and silently drop the adapter: it raises.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.compiler.regions.table import check_on_device
from poros_fx.prepare import get_store
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, lora_targets, tiny_config

EQUAL = {s: 0.0 for s in SURFACES}


def base(family: str = "llama") -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, layers=2), dtype=torch.float32)
    return model.requires_grad_(False)


def attach(model: torch.nn.Module) -> peft.PeftModel:
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets("llama"),
                           init_lora_weights="gaussian")
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def test_prepare_takes_a_base_and_an_adapter_attached_after_trains_exactly():
    data = demo_batches(4, seq=32)
    torch._dynamo.reset()
    late = base()
    poros_fx.prepare(late, device="cpu")
    late = attach(late)  # after prepare
    late_trace = train(late, torch.compile(late, backend="poros"), data, accumulate=2)
    assert poros_fx.stats(late)["loads"] > 0

    torch._dynamo.reset()
    usual = poros_fx.prepare(attach(base()), device="cpu")  # the usual order
    usual_trace = train(usual, torch.compile(usual, backend="poros"), data, accumulate=2)
    diffs = compare(late_trace, usual_trace)
    assert diffs == EQUAL, format_diffs("adapter after prepare vs before", diffs)


def test_a_region_call_with_tensors_off_the_compute_device_is_refused():
    """On CUDA, PEFT puts an adapter attached after ``prepare`` where the base weights are: host memory.
    A region call (fake tensors while Dynamo traces it, real ones at run time) whose inputs are not all on
    the layer's compute device is refused with what to do (on the H200 it was a fake-tensor device error
    inside the region's trace, reported as a layer that does not fit a region)."""
    on_device = [torch.zeros(2, 3)]
    check_on_device(0, torch.device("cpu"), on_device)
    check_on_device(0, torch.device("meta"), [torch.zeros(2, 3, device="meta"), torch.tensor(True)])  # a CPU flag
    with pytest.raises(PorosConfigError, match="decoder layer 4 has tensors of its own on cpu while the model "
                                               "computes on cuda:0: an adapter attached after poros_fx.prepare"):
        check_on_device(4, torch.device("cuda", 0), on_device)


def test_peft_from_pretrained_on_a_prepared_base(tmp_path):
    trained = attach(base())
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 256, (2, 24))

    reference = peft.PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits

    torch._dynamo.reset()
    prepared = poros_fx.prepare(base(), device="cpu")
    model = peft.PeftModel.from_pretrained(prepared, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, expected)  # eager
        compiled = torch.compile(model, backend="poros")(input_ids=ids, use_cache=False).logits
    assert torch.equal(compiled, expected)


def test_a_base_without_adapter_evaluates_streamed():
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        expected = base().eval()(input_ids=ids, labels=ids, use_cache=False).loss
    torch._dynamo.reset()
    model = poros_fx.prepare(base().eval(), device="cpu")
    with torch.no_grad():
        loss = torch.compile(model, backend="poros")(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.equal(loss, expected)
    assert poros_fx.stats(model)["loads"] > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_merge_adapter_on_a_prepared_model_raises(compiled):
    model = poros_fx.prepare(attach(base()), device="cpu")
    ids = torch.randint(0, 256, (1, 16))
    run = torch.compile(model, backend="poros") if compiled else model
    model.merge_adapter()  # PEFT adds B@A to a loaded copy of the weight: lost
    with pytest.raises(Exception) as excinfo, torch.no_grad():
        run(input_ids=ids, use_cache=False)
    error = excinfo.value  # under torch.compile, Dynamo wraps it (the message keeps our text)
    while error is not None and not isinstance(error, PorosConfigError):
        error = error.__cause__ or error.__context__
    assert error is not None and "merging a LoRA adapter into a prepared" in str(error)


def test_merge_and_unload_on_a_prepared_model_raises():
    model = poros_fx.prepare(attach(base()), device="cpu")
    with pytest.raises(PorosConfigError, match="poros-fx export"):
        model.merge_and_unload()


def test_freeing_another_prepared_model_does_not_recompile_a_compiled_step():
    """The registration hooks serve every prepared model; a forward that slices its layers
    (``self.layers[:n]``) calls them while Dynamo traces. Freeing another prepared model between two
    micro-batches must not change what the compiled step was guarded on (on the H200 it recompiled
    micro-batch 1, and block-major accumulation raised)."""
    import gc

    model = attach(poros_fx.prepare(base(), device="cpu", codegen="eager"))
    other = attach(poros_fx.prepare(base(), device="cpu", codegen="eager"))
    step_model = torch.compile(model, backend="poros")
    batches = demo_batches(2, vocab=256, seq=16, batch=1)
    torch._dynamo.utils.counters.clear()
    with poros_fx.block_major(model, batches):
        for i, batch in enumerate(batches):
            step_model(**batch, use_cache=False).loss.backward()
            if i == 0:
                del other
                gc.collect()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_unprepare_removes_the_hooks():
    model = poros_fx.prepare(base(), device="cpu")
    poros_fx.unprepare(model)
    model = attach(model)  # no prepared layer to follow: nothing happens
    layer = model.base_model.model.model.layers[0]
    assert not hasattr(layer, "_poros_own")
    merged = model.merge_and_unload()  # allowed: the base is the user's again
    assert isinstance(merged, transformers.PreTrainedModel)


def test_dora_on_an_nf4_base_is_refused_at_prepare():
    """PEFT's DoRA reads the base weight as a bitsandbytes ``Params4bit``; streamed, it would be handed the
    packed bytes (a shape error mid-trace): ``prepare`` refuses, before anything is moved."""
    from poros_fx.models.tiny import add_lora, base_model

    model = add_lora(base_model(tiny_config("qwen2", layers=1), dtype=torch.bfloat16, nf4=True), dora=True,
                     targets=["q_proj"])
    with pytest.raises(PorosConfigError, match="DoRA"):
        poros_fx.prepare(model, device="cpu")
    assert get_store(model) is None


def test_dora_on_an_fp32_base_equals_the_eager_loop():
    """DoRA on a full-precision base streams like LoRA: == the plain eager PEFT loop (eager codegen)."""
    from poros_fx.models.tiny import add_lora, base_model

    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        model = add_lora(base_model(tiny_config("llama", layers=2)), dora=True, dropout=0.1)
        step_model = model
        if compiled:
            poros_fx.prepare(model, device="cpu")
            step_model = torch.compile(model, backend="poros")
        runs.append(train(model, step_model, demo_batches(4, seq=12), accumulate=2))
    assert compare(*runs) == EQUAL, format_diffs("DoRA streamed vs eager", compare(*runs))
