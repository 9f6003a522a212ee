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
from poros_fx.compiler.host_fit import offloaded_bytes
from poros_fx.handles import get_store
from poros_fx.loss import chunked_causal_lm_loss, eager_rows, row_chunks
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import lora_model, tiny_config

pytestmark = pytest.mark.gpu

EQUAL = {s: 0.0 for s in SURFACES}
VOCAB, CHUNKS = 1024, 3
LENGTHS = (96, 96, 200, 200)  # one length per optimizer step (block-major runs a step's micro-batches together)


def _batches(lengths=LENGTHS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (2, length), generator=g).cuda()
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _run(mode: str, nf4: bool, codegen: str, **chunking):
    """``chunking``: prepare's options beyond the chunked loss (``head_chunks`` by default)."""
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
    poros_fx.prepare(model, device="cuda", codegen=codegen, chunked_loss=True, offload_boundaries=mode == "streamed",
                     **(chunking or {"head_chunks": CHUNKS}))
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
    # the forward's compile page-locked one micro-batch at the first length; block-major's second micro-batch
    # outgrew it, so the second optimizer step grew it, and (longer) outgrew that
    assert stats["offload_arena"]["allocations"] == 2 and stats["offload_arena"]["overflow_bytes"] > 0, \
        stats["offload_arena"]
    if codegen == "eager":
        eager, _ = _run("eager", nf4, codegen)
        assert compare(streamed, eager) == EQUAL, format_diffs("long vs eager chunked", compare(streamed, eager))


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_gpu_sequence_chunks_exact(nf4, codegen, deterministic):
    """Each layer's MLP in 4 token chunks (their dropout replayed from the CUDA generator's saved state),
    with the chunked loss, offloaded boundaries and block-major accumulation."""
    streamed, model = _run("streamed", nf4, codegen, sequence_chunks=4)
    resident, _ = _run("resident", nf4, codegen, sequence_chunks=4)
    assert compare(streamed, resident) == EQUAL, format_diffs(f"chunks {codegen}", compare(streamed, resident))
    assert poros_fx.stats(model)["offloads"] > 0


def test_gpu_offload_reuses_one_page_locked_buffer():
    """Steps of one length: the forward's compile page-locks what one run of it offloads (before the first
    step runs: it takes nothing from torch's pinned allocator), every step copies into that one buffer, and
    what the backward reads from it is what the forward wrote (== stream=False)."""
    def run(mode, steps=4):
        torch._dynamo.reset()
        config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=VOCAB, intermediate=1376)
        model = lora_model(config, dtype=torch.bfloat16, nf4=False, dropout=0.1, device="cuda")
        poros_fx.prepare(model, device="cuda", offload_boundaries=mode == "streamed")
        compiled = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
        return train(model, compiled, _batches((128,) * steps)), model

    _, first = run("streamed", steps=1)
    stats = poros_fx.stats(first)
    schedule = get_store(first).schedules[-1]
    reserved = offloaded_bytes(schedule.graphs["forward"], schedule.offloaded)
    assert reserved == stats["offloaded_bytes"] > 0  # what the step offloaded (every size 512-aligned)
    assert stats["offload_arena"] == {"bytes": reserved, "allocations": 1, "overflow_bytes": 0}, stats

    streamed, model = run("streamed")
    resident, _ = run("resident")
    assert compare(streamed, resident) == EQUAL, format_diffs("offload arena", compare(streamed, resident))
    arena = poros_fx.stats(model)["offload_arena"]
    assert arena["allocations"] == 1 and arena["overflow_bytes"] == 0 and arena["bytes"] > 0, arena
