"""A mixture of experts' router logits and auxiliary load-balancing loss (``output_router_logits=True``):
transformers records the logits with hooks on the router modules, which a region's compiled code does not
run; the region returns them as more outputs and ``call_region`` appends them where the hooks would
(``compiler/regions/recorded.py``). The model's own code then adds the auxiliary loss.

Parity: streamed == ``stream=False`` == the plain eager PEFT loop, with padded rows (the auxiliary loss
weights each token by the attention mask), dropout and accumulation 2 block-major.
"""

from __future__ import annotations

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train_as
from poros_fx.models.tiny import demo_batches, tiny_lora_model
from poros_fx.prepare import set_trace_options

EQUAL = {s: 0.0 for s in SURFACES}
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5)


def padded_batches(count: int) -> list[dict]:
    """Two rows each, the second padded at its end (attention mask 0, label -100)."""
    batches = demo_batches(count, seq=12, batch=2, seed=5)
    for batch in batches:
        mask = torch.ones_like(batch["input_ids"])
        mask[1, 9:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batches


def run(mode: str, family: str) -> poros_fx.exactness.parity.Trace:
    torch._dynamo.reset()
    model = tiny_lora_model(family, layers=2, dropout=0.1, **ROUTER)
    return train_as(model, mode, padded_batches(4), accumulate=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_auxiliary_loss_trains_exactly(family):
    streamed = run("stream", family)
    resident = run("resident", family)
    assert compare(streamed, resident) == EQUAL, format_diffs(f"{family} streamed vs stream=False",
                                                              compare(streamed, resident))
    eager = run("eager", family)
    assert compare(streamed, eager) == EQUAL, format_diffs(f"{family} streamed vs eager", compare(streamed, eager))


def test_the_regions_return_every_layers_router_logits():
    """The compiled step's output holds one router-logit tensor per layer, each bit-equal to eager's, and the
    loss holds the auxiliary loss (a different loss than the same model's without it)."""
    batch = padded_batches(1)[0]
    eager_model = tiny_lora_model("qwen3_moe", layers=3, dropout=0.0, **ROUTER)
    eager = eager_model(**batch)
    model = tiny_lora_model("qwen3_moe", layers=3, dropout=0.0, **ROUTER)
    poros_fx.prepare(model, device="cpu", codegen="eager")
    out = torch.compile(model, backend="poros")(**batch)
    assert len(out.router_logits) == len(eager.router_logits) == 3
    for mine, theirs in zip(out.router_logits, eager.router_logits):
        assert torch.equal(mine, theirs)
    assert torch.equal(out.aux_loss, eager.aux_loss) and torch.equal(out.loss, eager.loss)
    model.config.output_router_logits = False
    torch._dynamo.reset()
    without = torch.compile(model, backend="poros")(**batch)
    assert without.aux_loss is None and not torch.equal(without.loss, out.loss)


def test_router_logits_with_sequence_chunks_are_refused():
    """Token chunks would record one router-logit tensor per chunk, which the auxiliary loss reads as layers:
    refused at prepare (the config asks for them), at set_trace_options, or when a call asks for them."""
    with pytest.raises(poros_fx.PorosConfigError, match="output_router_logits=True with sequence_chunks > 1"):
        poros_fx.prepare(tiny_lora_model("qwen3_moe", layers=1, **ROUTER), device="cpu", sequence_chunks=2)
    model = poros_fx.prepare(tiny_lora_model("qwen3_moe", layers=1, **ROUTER), device="cpu")
    with pytest.raises(poros_fx.PorosConfigError, match="output_router_logits=True with sequence_chunks > 1"):
        set_trace_options(model, {"sequence_chunks": 2})
    model = poros_fx.prepare(tiny_lora_model("qwen3_moe", layers=1), device="cpu", sequence_chunks=2)
    with pytest.raises(Exception, match="output_router_logits=True with sequence_chunks > 1"):
        torch.compile(model, backend="poros")(**padded_batches(1)[0], output_router_logits=True)
