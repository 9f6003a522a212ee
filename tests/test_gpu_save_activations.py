"""GPU parity of ``options={"save_activations": N}`` (``pytest -m gpu``; skipped without CUDA): the last N
layer blocks keep their activations instead of being recomputed. Four layers at hidden 256 with
``intermediate_size=1376`` (a width Inductor pads), bf16 and NF4 bases, both codegens, LoRA dropout 0.1,
accumulation 2 block-major, deterministic algorithms: streamed with two layers saved == ``stream=False``,
and with the eager codegen == the plain eager PEFT loop; every layer saved and kept by a memory budget ==
``stream=False``. ``POROS_FX_GPU_STEPS`` sets the optimizer steps (default 8).
"""

import os

import pytest
import torch

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

pytestmark = pytest.mark.gpu

STEPS, ACCUMULATE = int(os.environ.get("POROS_FX_GPU_STEPS", 8)), 2
EQUAL = {s: 0.0 for s in SURFACES}


def _run(options, batches, *, nf4, codegen, budget=None):
    torch._dynamo.reset()
    config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, intermediate=1376)
    model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device="cuda")
    if options is None:
        return train(model, model, batches, accumulate=ACCUMULATE), model
    poros_fx.prepare(model, device="cuda", codegen=codegen, memory_budget=budget)
    step_model = torch.compile(model, backend="poros", options=options)
    streamed = options.get("stream", True)
    return train(model, step_model, batches, accumulate=ACCUMULATE, block_major=streamed), model


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_gpu_saved_activations_equal_stream_false(nf4, codegen, deterministic):
    batches = [{k: v.cuda() for k, v in b.items()}
               for b in demo_batches(STEPS * ACCUMULATE, vocab=1024, seq=128, batch=1)]
    saved, model = _run({"save_activations": 2}, batches, nf4=nf4, codegen=codegen)
    schedule = next(s for s in get_store(model).schedules if s.blocks and s.stream)
    assert sorted(schedule.blocks[i].name for i in schedule.activation_blocks) == ["layers.2", "layers.3"]
    resident, _ = _run({"stream": False}, batches, nf4=nf4, codegen=codegen)
    assert compare(saved, resident) == EQUAL, format_diffs("saved vs stream=False (cuda)", compare(saved, resident))
    kept, _ = _run({"save_activations": 99}, batches, nf4=nf4, codegen=codegen, budget="100GB")
    assert compare(kept, resident) == EQUAL, format_diffs("saved + kept vs stream=False", compare(kept, resident))
    if codegen == "eager":
        eager, _ = _run(None, batches, nf4=nf4, codegen=codegen)
        assert compare(saved, eager) == EQUAL, format_diffs("saved vs the eager loop (cuda)", compare(saved, eager))
