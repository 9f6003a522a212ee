"""``poros::matmul_4bit``: a prepared ``Linear4bit`` traces to one op per linear, computes what
``bnb.matmul_4bit`` computes (streamed == stream=False == eager bitsandbytes, torch.equal), and the
bitsandbytes path it replaces still works where the op does not apply."""

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.prepare import get_store
from poros_fx.models.tiny import demo_batches, tiny_config

ZERO = {s: 0.0 for s in SURFACES}


def build(nested: bool):
    """A tiny NF4 QLoRA Qwen2 (fp32 compute, so eager is an exact reference on the CPU)."""
    import peft
    import transformers

    from poros_fx.io.quantize import quantize_nf4
    from poros_fx.models.tiny import TARGETS

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2), dtype=torch.float32)
    quantize_nf4(model, compute_dtype=torch.float32, nested=nested)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                      target_modules=list(TARGETS)))


def runs(nested: bool, use_op: bool = True):
    batches = demo_batches(8, vocab=256, seq=24, batch=2, seed=3)
    out, models = {}, {}
    for mode in ("stream", "resident", "eager"):
        torch._dynamo.reset()
        model = build(nested)
        step_model = model
        if mode != "eager":
            poros_fx.prepare(model, device="cpu")
            if not use_op:
                for m in model.modules():
                    if hasattr(m, "_poros_matmul_op"):
                        m._poros_matmul_op = False
            step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
        out[mode] = train(model, step_model, batches, accumulate=2)
        models[mode] = model
    return out, models


def targets(graph) -> list[str]:
    """The ops the graph runs, the decoder-layer regions' own graphs included."""
    from poros_fx.compiler.regions import expanded_targets

    return expanded_targets(graph)


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "plain-absmax"])
def test_one_op_per_linear_and_exact(nested):
    out, models = runs(nested)
    assert compare(out["stream"], out["resident"]) == ZERO, format_diffs("streamed vs stream=False", compare(out["stream"], out["resident"]))
    assert compare(out["stream"], out["eager"]) == ZERO, format_diffs("streamed vs eager bnb", compare(out["stream"], out["eager"]))
    (schedule,) = get_store(models["stream"]).schedules
    forward, backward = targets(schedule.graphs["forward"]), targets(schedule.graphs["backward"])
    # traced as one poros::matmul_4bit per linear, lowered to bitsandbytes' own calls after partitioning
    assert not [t for t in forward + backward if t.startswith("poros.matmul_4bit")]
    linears = 2 * 7  # two layers, seven projections, all NF4
    assert forward.count("bitsandbytes.gemm_4bit.default") == linears
    assert "bitsandbytes.dequantize_4bit.default" not in forward
    # the input gradient of every linear (layer 0's too: it runs the region every layer runs)
    assert backward.count("bitsandbytes.dequantize_4bit.default") == linears
    assert backward.count("bitsandbytes.dequantize_blockwise.default") == (linears if nested else 0)
    # the recompute runs the matmul again in the backward (the partitioner skips outputs no gradient reads)
    assert 0 < backward.count("bitsandbytes.gemm_4bit.default") <= linears


def test_the_op_itself_outside_torch_compile():
    """A prepared model called eagerly runs poros::matmul_4bit's own implementation and autograd
    formula: equal to bitsandbytes' MatMul4Bit."""
    batches = demo_batches(4, vocab=256, seq=24, batch=2, seed=5)
    prepared = build(nested=True)
    poros_fx.prepare(prepared, device="cpu")
    eager = build(nested=True)
    # an eager training forward of a prepared model is refused (HostStore.on_eager) unless a poros graph is
    # running: mark one as running to reach the op's own implementation and autograd formula
    steps = get_store(prepared).residency.steps
    steps.begin()
    try:
        streamed_eagerly = train(prepared, prepared, batches, accumulate=2)
    finally:
        steps.end()
    diffs = compare(streamed_eagerly, train(eager, eager, batches, accumulate=2))
    assert diffs == ZERO, format_diffs("prepared eager vs eager bnb", diffs)


def test_bitsandbytes_path_where_the_op_does_not_apply():
    out, models = runs(nested=True, use_op=False)
    assert compare(out["stream"], out["resident"]) == ZERO
    assert compare(out["stream"], out["eager"]) == ZERO, format_diffs("streamed (bnb path) vs eager", compare(out["stream"], out["eager"]))
    (schedule,) = get_store(models["stream"]).schedules
    forward = targets(schedule.graphs["forward"])
    assert "bitsandbytes.gemm_4bit.default" in forward and "poros.matmul_4bit.default" not in forward
