"""Families beyond tests/test_parity.py: streamed == stream=False == the plain eager PEFT loop.

Same recipe as the parity suite: three independent model copies from the same seeds, a tiny fp32
config, LoRA dropout 0.1 on every decoder-layer linear, gradient accumulation 2, 20 AdamW steps,
``torch.equal`` on loss, adapter weights, gradient norms and optimizer state.
"""

import pytest
import torch

import poros_fx
from poros_fx.tools.parity import SURFACES, compare, format_diffs, train
from poros_fx.prepare import get_store
from poros_fx.tools.tiny import demo_batches, tiny_lora_model

STEPS = 20
ACCUMULATE = 2
ZERO = {s: 0.0 for s in SURFACES}

CASES = {
    # Gemma 3 text ties lm_head to its scaled embedding; the tiny config mixes sliding (window 8 < seq 24)
    # and full attention layers
    "gemma3_text": dict(block_size=1, prefetch=1, config=dict(tie_word_embeddings=True)),
    # Phi-3: LoRA on the fused qkv_proj / gate_up_proj
    "phi3": dict(block_size=2, prefetch=0, config={}),
}
ADAPTED = {"gemma3_text": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
           "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}


def run(mode, family, block_size, prefetch, config):
    model = tiny_lora_model(family, dtype=torch.float32, dropout=0.1, **config)
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cpu", block_size=block_size, prefetch=prefetch)  # validated: no family=
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(STEPS * ACCUMULATE, vocab=256, seq=24, batch=2, seed=7)
    return train(model, step_model, batches, accumulate=ACCUMULATE), model


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_streamed_equals_resident_and_eager(family):
    case = CASES[family]
    streamed, model = run("stream", family, **case)
    assert get_store(model).family is poros_fx.VALIDATED[family]
    assert poros_fx.VALIDATED[family].test == "tests/test_families.py"
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == ADAPTED[family]
    assert len(streamed.weights) == STEPS

    resident, _ = run("resident", family, **case)
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs stream=False", diffs)
    stats = poros_fx.stats(model)
    assert stats["backward_runs"] == STEPS * ACCUMULATE
    assert stats["recomputed_blocks"] == stats["backward_runs"] * (len(stats["block_bytes"]) - 1)

    eager, _ = run("eager", family, **case)
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs eager", diffs)


def test_gemma3_tiny_config_exercises_its_features():
    """The parity case above covers what sets Gemma 3 apart: both attention kinds with a window shorter
    than the sequence, a scaled embedding tied to lm_head, the pre/post feed-forward norms."""
    model = tiny_lora_model("gemma3_text", tie_word_embeddings=True)
    config = model.config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window < 24
    lm = model.get_base_model()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert float(lm.model.embed_tokens.embed_scale) != 1.0
    assert hasattr(lm.model.layers[0], "pre_feedforward_layernorm")
