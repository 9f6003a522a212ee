"""GPU parity for Qwen3.5, Gemma 4, Phi-3 and the mixture-of-experts families (``pytest -m gpu tests/test_gpu_families.py``; skipped without CUDA).

Four layers of each family at a small width on the H200, deterministic algorithms on: streamed ==
``stream=False`` on every surface over 20 optimizer steps (``POROS_FX_GPU_STEPS``) (LoRA dropout 0.1, accumulation 2 block-major,
NF4 and bf16 bases, both codegens), and with ``codegen="eager"`` also == the plain eager PEFT loop. Qwen3.5 runs
whichever Gated DeltaNet path transformers picks (``poros-fx doctor`` says which); Gemma 4 runs once
with every option (per-layer inputs, KV sharing, keys equal to values, double-wide MLP, MoE) and once
with the 31B's (keys equal to values only). Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``, an
``intermediate_size`` Inductor pads) crashed in its Inductor region's backward on the H200 (``assert_size_stride``;
on the CPU the cause is a region output Inductor's decompositions laid out otherwise, tests/test_regions.py). ``POROS_FX_GPU_REPORT=<folder>`` keeps a JSON line per case.
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.cli.kernels import linear_attention_paths
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, gemma4_options, lora_model, tiny_config

pytestmark = pytest.mark.gpu

# POROS_FX_GPU_STEPS shortens a run of the whole matrix on a time-limited device
STEPS, ACCUMULATE = int(os.environ.get("POROS_FX_GPU_STEPS", 20)), 2
CASES = {
    "qwen3_5": ("qwen3_5_text", {}),
    "gemma4_all": ("gemma4_text", gemma4_options()),
    "gemma4_31b_like": ("gemma4_text", {"attention_k_eq_v": True}),
    "phi3": ("phi3", {"intermediate": 1376}),
    # mixture-of-experts families: NF4 bases quantize the fused experts too (io/nf4_experts.py)
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),
    "gpt_oss": ("gpt_oss", {}),
    "mixtral": ("mixtral", {}),
    # the router logits recorded in the regions and the auxiliary load-balancing loss added
    "qwen3_moe_aux_loss": ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.5}),
}


def _run(mode, family, options, *, nf4, codegen, batches):
    torch._dynamo.reset()
    config = tiny_config(family, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, **options)
    model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device="cuda")
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cuda", codegen=codegen)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    started = time.perf_counter()
    trace = train(model, step_model, batches, accumulate=ACCUMULATE, block_major=mode == "stream")
    return trace, model, time.perf_counter() - started


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_family_streamed_equals_resident(case, nf4, codegen, deterministic):
    family, options = CASES[case]
    batches = [{k: v.cuda() for k, v in b.items()} for b in demo_batches(STEPS * ACCUMULATE, vocab=1024, seq=128, batch=1)]
    streamed, model, seconds = _run("stream", family, options, nf4=nf4, codegen=codegen, batches=batches)
    store = get_store(model)
    assert store.family is poros_fx.VALIDATED[family] and store.regions.regions
    assert sorted(i for r in store.regions.regions for i in r.layers) == [0, 1, 2, 3]
    resident, _, _ = _run("resident", family, options, nf4=nf4, codegen=codegen, batches=batches)
    diffs = compare(streamed, resident)
    row = {"case": case, "family": family, "base": "nf4" if nf4 else "bf16", "codegen": codegen, "steps": STEPS,
           "streamed_vs_resident": diffs, "streamed_seconds": round(seconds, 1),
           "gated_deltanet": dict(linear_attention_paths()) if family == "qwen3_5_text" else None,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if codegen == "eager":
        eager, _, _ = _run("eager", family, options, nf4=nf4, codegen=codegen, batches=batches)
        row["streamed_vs_eager"] = compare(streamed, eager)
    folder = os.environ.get("POROS_FX_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "gpu_families.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    assert diffs == {s: 0.0 for s in SURFACES}, format_diffs(f"{case} {row['base']} {codegen} streamed vs stream=False", diffs)
    if codegen == "eager":
        assert row["streamed_vs_eager"] == {s: 0.0 for s in SURFACES}, format_diffs(
            f"{case} {row['base']} streamed vs the eager loop", row["streamed_vs_eager"])
