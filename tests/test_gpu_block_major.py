"""GPU tests (``pytest -m gpu``) of block-major accumulation (``runtime/accumulate.py``) on CUDA: the
micro-batches of a step through each block together, with Inductor's regions (which draw their dropout
masks from seeds of the CUDA generator) and with the eager codegen, deterministic algorithms on.
Independent runs from the same seeds, ``torch.equal`` on every surface. Skipped without CUDA.
"""

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

pytestmark = pytest.mark.gpu
STEPS = 8
ACCUMULATE = 4


@pytest.mark.parametrize("nf4,codegen", [(False, "inductor"), (True, "inductor"), (True, "eager")],
                         ids=["bf16-inductor", "nf4-inductor", "nf4-eager"])
def test_gpu_block_major_equals_micro_batch_major_and_resident(nf4, codegen, deterministic):
    config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, tie_word_embeddings=True)
    batches = [{k: v.cuda() for k, v in b.items()}
               for b in demo_batches(ACCUMULATE * STEPS, vocab=1024, seq=128, batch=1)]

    def run(mode):
        torch._dynamo.reset()
        model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device="cuda")
        poros_fx.prepare(model, device="cuda", codegen=codegen)
        options = {"stream": mode != "resident", "block_major": mode == "block_major"}
        step_model = torch.compile(model, backend="poros", options=options)
        trace = train(model, step_model, batches, accumulate=ACCUMULATE, block_major=True)
        return trace, poros_fx.stats(model)

    block, b = run("block_major")
    micro, m = run("micro_major")
    resident, _ = run("resident")
    assert compare(block, micro) == {s: 0.0 for s in SURFACES}, format_diffs("block-major vs micro (cuda)",
                                                                            compare(block, micro))
    assert compare(block, resident) == {s: 0.0 for s in SURFACES}, format_diffs("block-major vs stream=False (cuda)",
                                                                               compare(block, resident))
    assert b["block_major_steps"] == STEPS and m["block_major_steps"] == 0
    assert m["bytes_copied"] == ACCUMULATE * b["bytes_copied"]


def test_gpu_step_decorator_with_a_budget_runs_block_major(deterministic):
    """@poros_fx.step(accumulate=4) with a memory budget: block-major, the plan made from the block-major
    first step, the measured peak under the budget, exact against micro-batch order."""
    config = tiny_config("qwen2", layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024)
    batches = [{k: v.cuda() for k, v in b.items()} for b in demo_batches(4 * 4, vocab=1024, seq=128, batch=1)]

    def run(block_major):
        torch._dynamo.reset()
        model = lora_model(config, dtype=torch.bfloat16, nf4=True, dropout=0.1, device="cuda")

        @poros_fx.step(accumulate=4, device="cuda", memory_budget="2GB", block_major=block_major)
        def train_step(model, batch):
            loss = model(**batch, use_cache=False).loss / 4
            loss.backward()
            return loss.detach()

        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        losses, opt = [], None
        for s in range(4):
            losses += train_step(model, batches[4 * s:4 * s + 4])
            if opt is None:
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            opt.step()
            opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        return losses, weights, poros_fx.stats(model), torch.cuda.max_memory_allocated()

    losses, weights, s, peak = run(True)
    ref_losses, ref_weights, _, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert s["block_major_steps"] == 4 and s["residency_plan"]["resident_blocks"]
    assert peak <= 2 * 10**9
