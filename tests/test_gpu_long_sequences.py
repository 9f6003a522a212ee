"""GPU (``pytest -m gpu``): the chunked head + loss and boundaries offloaded to pinned host memory on
CUDA — the copy stream carries the boundaries out and back. Streamed == ``stream=False`` with
``torch.equal`` on both codegens, bf16 and NF4, three sequence lengths and block-major accumulation;
with the eager codegen also == the user's eager loop computing the same chunked loss. Skipped without
CUDA.
"""

from __future__ import annotations

import types

import pytest
import torch

import poros_fx
from poros_fx.loss import chunked_causal_lm_loss, eager_rows, row_chunks
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import lora_model, tiny_config

pytestmark = pytest.mark.gpu

EQUAL = {s: 0.0 for s in SURFACES}
VOCAB, CHUNKS = 1024, 3
LENGTHS = (96, 96, 200, 200)  # one length per optimizer step (block-major runs a step's micro-batches together)


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (2, length), generator=g).cuda()
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _run(mode: str, nf4: bool, codegen: str):
    torch._dynamo.reset()
    config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=VOCAB, intermediate=1376)
    model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device="cuda")
    if mode == "eager":
        lm = model.get_base_model()

        def step(input_ids, labels, **kwargs):
            hidden = lm.model(input_ids=input_ids, **kwargs).last_hidden_state
            return types.SimpleNamespace(loss=chunked_causal_lm_loss(hidden, eager_rows(lm.lm_head),
                                                                     row_chunks(VOCAB, CHUNKS), labels))

        return train(model, step, _batches(), accumulate=2), model
    poros_fx.prepare(model, device="cuda", codegen=codegen, head_chunks=CHUNKS, chunked_loss=True,
                     offload_boundaries=mode == "streamed")
    compiled = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
    result = train(model, lambda **b: compiled(**poros_fx.mark_dynamic(b)), _batches(), accumulate=2,
                   block_major=mode == "streamed")
    return result, model


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_gpu_chunked_loss_offloaded_boundaries_exact(nf4, codegen, deterministic):
    streamed, model = _run("streamed", nf4, codegen)
    resident, _ = _run("resident", nf4, codegen)
    assert compare(streamed, resident) == EQUAL, format_diffs(f"long {codegen}", compare(streamed, resident))
    stats = poros_fx.stats(model)
    assert stats["offloads"] > 0 and stats["eager_loads"] == 0
    if codegen == "eager":
        eager, _ = _run("eager", nf4, codegen)
        assert compare(streamed, eager) == EQUAL, format_diffs("long vs eager chunked", compare(streamed, eager))
