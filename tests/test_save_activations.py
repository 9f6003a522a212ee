"""``options={"save_activations": N}``: the last N layer blocks keep their activations for the backward
instead of recomputing them (``passes/recompute.py``); only their loads are rerun, so the backward still
reloads their base unless a memory budget keeps it. A block that is not recomputed runs what
``stream=False`` runs for it, so the step stays bit-equal to ``stream=False`` and to the eager loop.
Two independent runs each (fresh models, same seeds), ``torch.equal`` on every surface.
"""

from __future__ import annotations

import pytest
import torch

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

EQUAL = {s: 0.0 for s in SURFACES}
LAYERS = 3


def run(options: dict | None, *, codegen: str = "eager", nf4: bool = False, budget=None, accumulate: int = 2):
    """One training run of a fresh model: compiled with ``options`` (``None``: the plain eager loop);
    streamed runs accumulate block-major."""
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1, nf4=nf4)
    if options is None:
        return train(model, model, demo_batches(4, seq=16), accumulate=accumulate), model
    poros_fx.prepare(model, device="cpu", codegen=codegen, memory_budget=budget)
    step_model = torch.compile(model, backend="poros", options=options)
    streamed = options.get("stream", True)
    return train(model, step_model, demo_batches(4, seq=16), accumulate=accumulate, block_major=streamed), model


def _training_schedule(model):
    return next(s for s in get_store(model).schedules if s.blocks and s.stream)


def test_saved_blocks_equal_stream_false_and_the_eager_loop():
    """Layers 1 and 2 saved, layer 0 recomputed; LoRA dropout, accumulation 2 block-major, eager codegen."""
    saved, model = run({"save_activations": 2})
    schedule = _training_schedule(model)
    names = [b.name for b in schedule.blocks]
    assert sorted(names[i] for i in schedule.activation_blocks) == ["layers.1", "layers.2"]
    recomputed = {b.name: b.recomputed_nodes for b in schedule.blocks}
    # a saved block reruns its load alone; the recomputed one its whole region, under its saved RNG state
    assert recomputed["layers.1"] == recomputed["layers.2"] == 1 and recomputed["layers.0"] > 10
    assert {slot.block for slot in schedule.rng_slots} == {names.index("layers.0")}
    assert "not recomputed (save_activations): layers.1, layers.2" in schedule.table()
    # their base is still streamed: loaded again for the backward; the ledger counts them loaded, not rerun
    assert schedule.activation_blocks <= {ld.block for ld in schedule.loads if ld.phase == "backward"}
    stats = poros_fx.stats(model)
    assert stats["recomputed_blocks"] == stats["backward_runs"] * (len(stats["block_bytes"]) - 1 - 2)
    resident, _ = run({"stream": False})
    eager, _ = run(None)
    assert compare(saved, resident) == EQUAL, format_diffs("saved vs stream=False", compare(saved, resident))
    assert compare(saved, eager) == EQUAL, format_diffs("saved vs the eager loop", compare(saved, eager))


def test_every_block_saved_and_kept_is_stream_false_inductor_nf4():
    """Every layer saved (a count above the model's layers means all) with a budget that keeps every
    block on the device: no block is recomputed (no RNG slot), each is copied once; Inductor regions over
    an NF4 base."""
    saved, model = run({"save_activations": 99}, codegen="inductor", nf4=True, budget="1GB")
    schedule = _training_schedule(model)
    assert len(schedule.activation_blocks) == LAYERS and not schedule.rng_slots
    assert poros_fx.stats(model)["residency_plan"]["resident_blocks"] == [b.name for b in schedule.blocks[1:]]
    resident, _ = run({"stream": False}, codegen="inductor", nf4=True)
    assert compare(saved, resident) == EQUAL, format_diffs("saved + kept vs stream=False", compare(saved, resident))


@pytest.mark.parametrize("bad", [True, -1, 1.5, "all"])
def test_save_activations_takes_a_count(bad):
    with pytest.raises(Exception, match="save_activations must be an integer >= 0"):  # Dynamo wraps it
        torch.compile(torch.nn.Linear(2, 2), backend="poros", options={"save_activations": bad})(torch.ones(2))


def test_saved_blocks_in_a_loop_of_several_lengths_equal_the_eager_loop():
    """A user's loop: lengths 7-33 and a width that is not a multiple of 64 (intermediate 100), one
    compile for every length (the batches marked dynamic, as the surfaces do), eval() with grad between
    training steps: saved blocks == the eager model throughout."""
    shapes = [(2, 16), (2, 33), (3, 7), (2, 20)]

    def loop(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1, intermediate=100)
        step_model = model
        if compiled:
            poros_fx.prepare(model, device="cpu", codegen="eager")
            compiled_model = torch.compile(model, backend="poros", options={"save_activations": 2})
            step_model = lambda **b: compiled_model(**poros_fx.mark_dynamic(b))  # noqa: E731
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(1)
        out = []
        torch.manual_seed(2)
        for i, (rows, length) in enumerate(shapes):
            ids = torch.randint(0, 256, (rows, length), generator=g)
            model.train(i != 2)  # the third batch in eval mode, gradients still on
            loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return out + [p.detach().clone() for p in model.parameters() if p.requires_grad]

    saved, eager = loop(True), loop(False)
    assert len(saved) == len(eager)
    for i, (a, b) in enumerate(zip(saved, eager)):
        assert torch.equal(a, b), f"value {i} differs by {(a - b).abs().max().item():.3e}"
