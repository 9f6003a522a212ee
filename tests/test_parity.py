"""Parity: streamed == stream=False == the plain eager PEFT loop, torch.equal on every surface.

Every case builds three independent model copies from the same seeds (never one run compared with
itself) and trains 8 AdamW steps with LoRA dropout 0.1 (every step compared: from the first one on, the
same code runs every step, each a new set of dropout masks; an accumulation boundary every step).
"""

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

STEPS = 8
ZERO = {s: 0.0 for s in SURFACES}


def run(mode, family, dtype, nf4, accumulate, block_size, prefetch, **cfg):
    model = tiny_lora_model(family, dtype=dtype, nf4=nf4, dropout=0.1, **cfg)
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cpu", block_size=block_size, prefetch=prefetch)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(STEPS * accumulate, vocab=256, seq=24, batch=2, seed=7)
    # streamed, accumulation runs block-major (each block loaded once per optimizer step), as every surface does
    return train(model, step_model, batches, accumulate=accumulate, block_major=mode == "stream"), model


# fixed reference points; the generator (test_drawn_configs.py) draws every family, base and option
CASES = [
    # family,  dtype,          nf4,   accum, block_size, prefetch, eager reference
    ("qwen2", torch.float32, False, 1, 1, 1, True),
    ("llama", torch.float32, True, 2, 2, 1, True),
    ("qwen3", torch.float32, False, 2, 2, 1, True),
    ("qwen2", torch.bfloat16, True, 2, 1, 1, False),  # bf16 + SDPA with GQA: eager differs (docs/exactness.md)
]


@pytest.mark.parametrize("family,dtype,nf4,accumulate,block_size,prefetch,vs_eager", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-{'nf4' if c[2] else 'dense'}-acc{c[3]}-b{c[4]}-p{c[5]}" for c in CASES])
def test_streamed_equals_resident_and_eager(family, dtype, nf4, accumulate, block_size, prefetch, vs_eager):
    streamed, model = run("stream", family, dtype, nf4, accumulate, block_size, prefetch)
    resident, _ = run("resident", family, dtype, nf4, accumulate, block_size, prefetch)
    assert len(streamed.weights) == STEPS
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs("streamed vs stream=False", diffs)
    stats = poros_fx.stats(model)
    assert stats["recomputed_blocks"] == stats["backward_runs"] * (len(stats["block_bytes"]) - 1)
    assert stats["block_major_steps"] == (STEPS if accumulate > 1 else 0)
    if vs_eager:
        eager, _ = run("eager", family, dtype, nf4, accumulate, block_size, prefetch)
        diffs = compare(streamed, eager)
        assert diffs == ZERO, format_diffs("streamed vs eager", diffs)


@pytest.mark.parametrize("attn,kv_heads", [("eager", 2), ("sdpa", 4)])
def test_bf16_equals_eager_without_gqa_sdpa(attn, kv_heads):
    """bf16 on CPU equals eager whenever attention is not SDPA with grouped-query heads."""
    streamed, _ = run("stream", "llama", torch.bfloat16, False, 2, 1, 1, attn=attn, kv_heads=kv_heads)
    eager, _ = run("eager", "llama", torch.bfloat16, False, 2, 1, 1, attn=attn, kv_heads=kv_heads)
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs("bf16 streamed vs eager", diffs)


def test_compare_detects_a_difference():
    """The comparison itself can fail: one changed bit in one adapter weight is reported."""
    a, _ = run("eager", "qwen2", torch.float32, False, 1, 1, 1, layers=1)
    b, _ = run("eager", "qwen2", torch.float32, False, 1, 1, 1, layers=1)
    assert compare(a, b) == ZERO  # two independent eager runs agree
    b.weights[-1][0] = b.weights[-1][0].clone()
    b.weights[-1][0].view(-1)[0] = torch.nextafter(b.weights[-1][0].view(-1)[0], torch.tensor(1.0))
    assert compare(a, b)["weights"] > 0


def test_peft_bnb_lora_layer_is_exact():
    """A model loaded with BitsAndBytesConfig gets peft's lora.bnb.Linear4bit wrapper (not lora.Linear):
    streamed == stream=False == eager with it too."""
    import peft
    import transformers

    from poros_fx.io.quantize import quantize_nf4
    from poros_fx.models.tiny import TARGETS, tiny_config

    def build():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2), dtype=torch.float32)
        quantize_nf4(model, compute_dtype=torch.float32)
        model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                          target_modules=list(TARGETS)))

    batches = demo_batches(12, vocab=256, seq=24, batch=2, seed=7)
    traces = {}
    for mode in ("stream", "resident", "eager"):
        torch._dynamo.reset()
        model = build()
        assert type(model.get_base_model().model.layers[0].self_attn.q_proj).__module__ == "peft.tuners.lora.bnb"
        step_model = model
        if mode != "eager":
            poros_fx.prepare(model, device="cpu")
            step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
        traces[mode] = train(model, step_model, batches, accumulate=2)
    assert compare(traces["stream"], traces["resident"]) == ZERO
    assert compare(traces["stream"], traces["eager"]) == ZERO
