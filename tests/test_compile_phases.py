"""``stats(model)["compile"]``: the host seconds of each one-time phase of the first step, per graph."""

from __future__ import annotations

import torch

import poros_fx
from poros_fx.models.tiny import demo_batches, tiny_lora_model

PHASES = ("joint_trace_s", "partition_s", "forward_passes_s", "backward_passes_s", "forward_first_run_s",
          "backward_first_run_s", "region_trace_s")


def test_first_step_phases_are_measured_once():
    torch._dynamo.reset()
    # a layer structure no other test builds (dropout 0.17): conftest keeps every traced region for the
    # session, and a model of a structure traced before reuses it (no trace, region_trace_s 0)
    model = tiny_lora_model("qwen2", layers=2, dropout=0.17)
    poros_fx.prepare(model, device="cpu")
    step_model = torch.compile(model, backend="poros")
    batches = demo_batches(3, seq=16, batch=2)
    step_model(**batches[0], use_cache=False).loss.backward()
    first = poros_fx.stats(model)["compile"]
    assert first["graphs"] == 1
    assert all(first[k] > 0 for k in PHASES), first
    for batch in batches[1:]:  # later steps run the compiled graphs: nothing is added
        step_model(**batch, use_cache=False).loss.backward()
    assert poros_fx.stats(model)["compile"] == first
