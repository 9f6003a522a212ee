"""GPU (``pytest -m gpu``): what a user gets with no options on CUDA, and the options that change it.

No options: region calls replay from CUDA graphs (``options.cuda_graphs_choice``), equal bit for bit to
``stream=False`` (which replays too) and to a streamed run without graphs. ``memory_budget="auto"``
(the trainers' and the command line's default): the budget is what the device has free less a margin,
the first step plans from its measured peak and keeps blocks resident, still equal. With
``offload_boundaries`` the default turns graphs off and says so in one warning; ``least_memory`` keeps
nothing and captures nothing. Four layers, NF4, LoRA dropout 0.1, Inductor regions, deterministic
algorithms, two sequence lengths (one padded).
"""

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import attention_batches, lora_model, tiny_config

pytestmark = pytest.mark.gpu

EQUAL = {s: 0.0 for s in SURFACES}


def _batches() -> list[dict]:
    plain = attention_batches(6, seq=128, mode="none", vocab=1024, batch=1, seed=1)
    padded = attention_batches(6, seq=96, mode="pad", vocab=1024, batch=2, seed=2)
    return [{k: v.cuda() for k, v in b.items()} for pair in zip(plain, padded) for b in pair]


def _run(options: dict, batches: list[dict]) -> tuple[object, dict]:
    torch._dynamo.reset()
    config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, intermediate=1376)
    model = lora_model(config, dtype=torch.bfloat16, nf4=True, dropout=0.1, device="cuda")
    poros_fx.prepare(model, device="cuda")
    step_model = torch.compile(model, backend="poros", options=options)
    trace = train(model, step_model, batches, accumulate=1)
    return trace, poros_fx.stats(model)


def test_gpu_defaults_replay_graphs_and_auto_budget_keeps_blocks(deterministic):
    batches = _batches()
    default, stats = _run({}, batches)
    assert stats["cuda_graphs_choice"].startswith("on by default"), stats["cuda_graphs_choice"]
    assert stats["cuda_graphs"]["replays"] > 0 and stats["cuda_graphs"]["fallbacks"] == 0, stats["cuda_graphs"]
    resident, _ = _run({"stream": False}, batches)
    assert compare(default, resident) == EQUAL, format_diffs("defaults vs stream=False", compare(default, resident))
    plain, plain_stats = _run({"cuda_graphs": False}, batches)
    assert plain_stats["cuda_graphs"] is None
    assert compare(default, plain) == EQUAL, format_diffs("defaults vs no graphs", compare(default, plain))
    auto, auto_stats = _run({"memory_budget": "auto"}, batches)
    assert auto_stats["budget_source"].startswith("auto: "), auto_stats["budget_source"]
    assert auto_stats["residency_plan"]["resident_blocks"], auto_stats["residency_plan"]
    assert compare(auto, resident) == EQUAL, format_diffs("budget auto vs stream=False", compare(auto, resident))


def test_gpu_default_graphs_give_way_to_offload_and_least_memory(deterministic):
    batches = _batches()[:4]
    with pytest.warns(UserWarning, match="CUDA graphs off by default with offload_boundaries"):
        offloaded, stats = _run({"offload_boundaries": True}, batches)
    assert stats["cuda_graphs"] is None
    least, least_stats = _run({"least_memory": True}, batches)
    assert least_stats["cuda_graphs"] is None and least_stats["residency_plan"] is None
    assert least_stats["cuda_graphs_choice"].startswith("off (least_memory")
    resident, _ = _run({"stream": False, "cuda_graphs": False}, batches)
    assert compare(least, resident) == EQUAL, format_diffs("least_memory vs stream=False", compare(least, resident))
    assert compare(offloaded, resident) == EQUAL, format_diffs("offload vs stream=False", compare(offloaded, resident))
