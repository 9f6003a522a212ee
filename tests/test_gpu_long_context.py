"""GPU (``pytest -m gpu``): long sequences with every long-sequence option, streamed == ``stream=False``
with ``torch.equal`` on every step (loss, adapter weights, gradient norms, optimizer state).

Qwen2.5-7B widths, random-init NF4, LoRA r16 on the seven projections with dropout 0.05, batch 1, the
default codegen (Inductor on CUDA), ``chunked_loss`` + ``sequence_chunks=8``, and the streamed run's
boundaries offloaded to host memory: 4 layers at 16384 tokens for 20 steps, and all 28 layers at 32768
tokens for 5 steps. Each case takes minutes (two models, two compiles). Skipped without CUDA.
"""

from __future__ import annotations

import peft
import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import lora_targets, qwen25_config

pytestmark = pytest.mark.gpu

EQUAL = {s: 0.0 for s in SURFACES}


def _run(mode: str, layers: int, seq: int, steps: int):
    torch._dynamo.reset()
    config = qwen25_config("7b")
    config.num_hidden_layers = layers
    config.max_position_embeddings = seq
    torch.manual_seed(0)  # the adapter's initial values
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=lora_targets("qwen2"))
    model = poros_fx.from_config(config, "nf4", device="cuda", seed=0, lora=lora, progress=False, chunked_loss=True,
                                 sequence_chunks=8, offload_boundaries=mode == "streamed")
    compiled = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=g).cuda()
        batches.append({"input_ids": ids, "labels": ids.clone()})
    result = train(model, compiled, batches, lr=1e-4)
    poros_fx.unprepare(model)  # the next run's model takes the device memory this one held
    del compiled, model
    torch.cuda.empty_cache()
    return result


@pytest.mark.parametrize("layers,seq,steps", [(4, 16384, 20), (28, 32768, 5)], ids=["4layers-16k", "7b-32k"])
def test_gpu_long_context_streamed_equals_stream_false(layers, seq, steps):
    streamed = _run("streamed", layers, seq, steps)
    resident = _run("resident", layers, seq, steps)
    assert len(streamed.losses) == steps
    diffs = compare(streamed, resident)
    assert diffs == EQUAL, format_diffs(f"streamed vs stream=False, {layers} layers, seq {seq}", diffs)


def test_gpu_a_length_over_the_budget_is_refused_before_the_first_step():
    """torch.compile learns the length at the first call: a step estimated over the memory budget is refused
    then, before anything runs, naming the long-sequence options that fit."""
    torch._dynamo.reset()
    config = qwen25_config("7b")
    config.num_hidden_layers = 2
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=lora_targets("qwen2"))
    model = poros_fx.from_config(config, "nf4", device="cuda", seed=0, lora=lora, progress=False)
    compiled = torch.compile(model, backend="poros", options={"memory_budget": "8GB"})
    ids = torch.zeros(1, 65536, dtype=torch.long, device="cuda")
    before = torch.cuda.max_memory_allocated()
    with pytest.raises(Exception, match=r"1 x 65536 tokens.*more than the memory budget.*longest length estimated to fit"):
        compiled(input_ids=ids, labels=ids)
    assert torch.cuda.max_memory_allocated() == before  # refused before the step ran
    poros_fx.unprepare(model)
