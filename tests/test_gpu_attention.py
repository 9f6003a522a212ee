"""GPU (``pytest -m gpu``): streamed == the plain eager PEFT loop on CUDA with the default SDPA attention
and grouped-query heads, bf16 and NF4, deterministic algorithms, with and without padding, seq 512 and
2048 (the eager codegen: aten calls, the kernels eager runs; Inductor's fused kernels are exact against
``stream=False`` only). And a device other than the current one keeps the RNG replay exact.

``POROS_FX_GPU_REPORT=<folder>`` keeps each case's per-surface differences as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import attention_batches, lora_model, tiny_config

pytestmark = pytest.mark.gpu

EQUAL = {s: 0.0 for s in SURFACES}


def batches(seq: int, mode: str, device: str, count: int = 8) -> list[dict[str, torch.Tensor]]:
    return attention_batches(count, seq=seq, mode=mode, vocab=1024, pad=seq // 8, device=device)


def report(name: str, diffs: dict[str, float]) -> None:
    folder = os.environ.get("POROS_FX_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps({"case": name, "diffs": diffs}, indent=1))


@pytest.mark.parametrize("mode", ["none", "ones", "pad"])
@pytest.mark.parametrize("seq", [512, 2048])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_gpu_streamed_equals_eager_with_sdpa(nf4, seq, mode, deterministic):
    config = tiny_config("llama", layers=3, hidden=256, heads=8, kv_heads=2, vocab=1024)
    data = batches(seq, mode, "cuda")

    def run(compiled: bool):
        torch._dynamo.reset()
        model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device="cuda")
        step_model = model
        if compiled:
            poros_fx.prepare(model, device="cuda", codegen="eager")
            step_model = torch.compile(model, backend="poros")
        return train(model, step_model, data, accumulate=2)

    diffs = compare(run(True), run(False))
    report(f"sdpa_{'nf4' if nf4 else 'bf16'}_{seq}_{mode}", diffs)
    assert diffs == EQUAL, format_diffs(f"streamed vs eager PEFT (cuda, seq {seq}, {mode})", diffs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_gpu_second_device_replays_dropout(codegen, deterministic):
    """prepare(device="cuda:1") while cuda:0 is current: the forward saves, and the backward's
    recompute restores, cuda:1's generator (torch's wrappers would use the current device's)."""
    assert torch.cuda.current_device() == 0
    config = tiny_config("qwen2", layers=3, hidden=128, heads=4, kv_heads=2, vocab=512)
    data = batches(128, "ones", "cuda:1")

    def run(stream: bool):
        torch._dynamo.reset()
        model = lora_model(config, dtype=torch.bfloat16, dropout=0.1, device="cuda:1")
        poros_fx.prepare(model, device="cuda:1", codegen=codegen)
        return train(model, torch.compile(model, backend="poros", options={"stream": stream}), data, accumulate=2)

    diffs = compare(run(True), run(False))
    report(f"second_device_{codegen}", diffs)
    assert diffs == EQUAL, format_diffs("streamed vs stream=False on cuda:1", diffs)
