"""A user's loop, not the benchmark's: several sequence lengths and batch sizes in one run, widths that
are not multiples of 64, train / eval / adapter toggles between steps.

Every comparison trains independent model copies from the same seeds and compares with ``torch.equal``:
streamed, ``stream=False`` (which shares the regions, so it cannot see their bugs) and, with the eager
codegen, the user's plain eager PEFT model.
"""

from __future__ import annotations

import contextlib

import warnings

import pytest
import torch

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.exactness.parity import SURFACES, adamw, compare, format_diffs, mode_toggles, train
from poros_fx.models.tiny import tiny_lora_model

EQUAL = {s: 0.0 for s in SURFACES}
# (batch, length): lengths that are not multiples of anything, a batch that grows, one of a single row
SHAPES = [(2, 16), (2, 24), (2, 7), (3, 40), (2, 33), (1, 19)]


def batches_of(shapes, vocab: int = 256, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, length in shapes:
        ids = torch.randint(0, vocab, (rows, length), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def marked(step_model):
    """The compiled model called with every length dynamic from the first batch, as the surfaces do."""
    return lambda **batch: step_model(**poros_fx.mark_dynamic(batch))


def run(mode: str, batches, *, codegen: str = "eager", mark: bool = True, **config):
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, **config)
    if mode == "eager":
        return train(model, model, batches), model
    poros_fx.prepare(model, device="cpu", codegen=codegen)
    compiled = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
    return train(model, marked(compiled) if mark else compiled, batches), model


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_every_length_from_one_compile(codegen):
    """Six shapes, one region traced once (its sizes are symbols) and one graph of the step: streamed ==
    stream=False, and == the eager loop with the eager codegen."""
    batches = batches_of(SHAPES)
    streamed, model = run("streamed", batches, codegen=codegen)
    resident, _ = run("resident", batches, codegen=codegen)
    assert compare(streamed, resident) == EQUAL, format_diffs(f"lengths, {codegen}", compare(streamed, resident))
    store = get_store(model)
    # a batch of one row is a size Dynamo specializes (0 and 1 are): a graph and a region of its own, for
    # every length of one row
    assert len(store.schedules) == 2
    assert len(store.regions.regions) == 2 and all(r.signature.dynamic for r in store.regions.regions)
    if codegen == "eager":
        eager, _ = run("eager", batches)
        assert compare(streamed, eager) == EQUAL, format_diffs("lengths vs eager", compare(streamed, eager))


def test_widths_that_are_not_multiples_of_64_with_inductor_padding():
    """Inductor pads the strides of what it computes for sizes off its alignment (CUDA's default; forced
    here on the CPU). Every output of a region keeps the strides its other graph expects: the step runs
    and streamed == stream=False."""
    from torch._inductor import config as inductor_config

    shapes = [(2, 16), (2, 23)]
    widths = dict(hidden=72, heads=4, kv_heads=2, intermediate=1376)
    with inductor_config.patch(comprehensive_padding=True, disable_padding_cpu=False, padding_stride_threshold=0):
        # the streamed model stays alive, so stream=False takes its Inductor-compiled regions instead of
        # compiling them again (as in every parity test)
        streamed, model = run("streamed", batches_of(shapes), codegen="inductor", **widths)
        resident, _ = run("resident", batches_of(shapes), codegen="inductor", **widths)
    assert compare(streamed, resident) == EQUAL


# -- mode state: eval / train, adapters switched off or swapped ------------------------------------------

def _toggles(model, step_model) -> list[torch.Tensor]:
    """Losses and gradients of a loop that switches mode between steps: train, eval with grad (a loss
    computed in eval mode, with its backward), eval under no_grad, the adapter switched off, a second
    adapter, train again."""
    batches = batches_of([(2, 16), (2, 21), (2, 16), (2, 12), (2, 16), (2, 18)], seed=5)
    out, step = mode_toggles(model, step_model, batches)
    model.set_adapter("second")
    step(batches[4])
    model.set_adapter("default")
    step(batches[5])
    return out


def _two_adapters(prepared: bool):
    import peft

    model = tiny_lora_model("qwen2", layers=2, dropout=0.2)
    torch.manual_seed(11)
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.3, init_lora_weights="gaussian",
                                                target_modules=["q_proj", "v_proj"]))
    if not prepared:
        return model, model
    poros_fx.prepare(model, device="cpu", codegen="eager")
    return model, torch.compile(model, backend="poros")


def test_mode_changes_reach_the_regions():
    """eval() with grad enabled (dropout off), disable_adapter(), set_adapter(): the streamed step equals
    the user's eager model at every stage (before, the regions kept the mode they were traced in)."""
    torch._dynamo.reset()
    streamed = _toggles(*_two_adapters(prepared=True))
    eager = _toggles(*_two_adapters(prepared=False))
    assert len(streamed) == len(eager)
    for i, (a, b) in enumerate(zip(streamed, eager)):
        assert torch.equal(a, b), f"value {i} differs by {(a - b).abs().max().item():.3e}"


# -- block-major that cannot be fooled -----------------------------------------------------------------------

def _prepared(**config):
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, **config)
    poros_fx.prepare(model, device="cpu", codegen="eager")
    return model, torch.compile(model, backend="poros")


def test_block_major_refuses_a_micro_batch_edited_in_place():
    """Masking tokens of a micro-batch just before its forward call, after micro-batch 0's forward has
    computed every micro-batch's outputs: raised, never a stale result."""
    from poros_fx.errors import PorosExactnessError

    model, step_model = _prepared()
    micro_batches = batches_of([(2, 16), (2, 16)])
    with pytest.raises(PorosExactnessError, match="changed in place"):
        with poros_fx.block_major(model, micro_batches):
            for batch in micro_batches:
                batch["labels"][:, :4] = -100
                (step_model(**batch, use_cache=False).loss / 2).backward()


def _accumulate(model, step_model, micro_batches, block_major: bool, hook: bool) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    seen: list[torch.Tensor] = []
    if hook:
        params[0].register_hook(lambda g: seen.append(g.clone()))
    torch.manual_seed(3)
    with poros_fx.block_major(model, micro_batches) if block_major else contextlib.nullcontext():
        losses = [(step_model(**b, use_cache=False).loss / 2) for b in micro_batches[:1]]
        losses[0].backward()
        for b in micro_batches[1:]:
            loss = step_model(**b, use_cache=False).loss / 2
            loss.backward()
            losses.append(loss)
    return [*[loss.detach() for loss in losses], *seen, *(p.grad.clone() for p in params)]


def test_block_major_runs_micro_batch_order_up_front_for_a_gradient_hook():
    """A gradient hook on an adapter weight sees each micro-batch's gradient in micro-batch order: the
    step runs micro-batch after micro-batch from its start, with a warning that says why, and equals it."""
    micro_batches = batches_of([(2, 16), (2, 16)])
    first = _prepared()  # kept alive: the second copy takes its region instead of tracing it again
    with pytest.warns(UserWarning, match="gradient hook"):
        block = _accumulate(*first, micro_batches, block_major=True, hook=True)
    micro = _accumulate(*_prepared(), micro_batches, block_major=False, hook=True)
    assert len(block) == len(micro) and all(torch.equal(a, b) for a, b in zip(block, micro))


def test_attention_dropout_with_sdpa_is_refused_and_with_eager_attention_runs_block_major():
    """SDPA draws its dropout mask inside the kernel eager's mask decision branches to (``torch.cond``),
    and a branch's backward draws again: refused at prepare. Eager attention's dropout is an op of its own:
    block-major replays it and equals micro-batch order on a padded batch."""
    from poros_fx.models.tiny import attention_batches

    with pytest.raises(poros_fx.PorosConfigError, match="attn_implementation='eager'"):
        _prepared(attention_dropout=0.2)
    micro_batches = attention_batches(2, seq=16, mode="pad")
    first = _prepared(attention_dropout=0.1, attn="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot replay.*")
        block = _accumulate(*first, micro_batches, block_major=True, hook=False)
    micro = _accumulate(*_prepared(attention_dropout=0.1, attn="eager"), micro_batches, block_major=False, hook=False)
    assert len(block) == len(micro) and all(torch.equal(a, b) for a, b in zip(block, micro))


# -- lifetime ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_dropout_in_half_precision_equals_the_eager_loop(dtype):
    """Eager's CPU dropout multiplies the gradient by its noise rounded to the input's dtype, where the
    traced op's backward scales it unrounded (passes/cpu_dropout_backward.py; 1 / 0.9 is not a bf16 or
    fp16 number): equal to the eager loop."""
    batches = batches_of([(2, 12), (2, 9), (2, 12), (2, 9)])
    streamed, _ = run("streamed", batches, dtype=dtype, attention_dropout=0.1, attn="eager")
    eager, _ = run("eager", batches, dtype=dtype, attention_dropout=0.1, attn="eager")
    diffs = compare(streamed, eager)
    assert diffs == {s: 0.0 for s in SURFACES}, format_diffs("streamed vs eager", diffs)


def test_unprepare_and_dropping_the_model_free_the_host_store():
    """The compiled graphs (in Dynamo's cache) hold the host store weakly: unprepare frees it, and so does
    dropping a prepared model and its compiled wrapper."""
    import gc
    import weakref

    batch = batches_of([(2, 16)])[0]
    model, step_model = _prepared()
    step_model(**batch, use_cache=False).loss.backward()
    store = weakref.ref(get_store(model))
    poros_fx.unprepare(model)
    gc.collect()
    assert store() is None
    model, step_model = _prepared()
    step_model(**batch, use_cache=False).loss.backward()
    store = weakref.ref(get_store(model))
    del model, step_model
    gc.collect()
    assert store() is None


# -- a memory budget over steps of different sizes ---------------------------------------------------------

def test_budget_is_measured_again_for_a_longer_step():
    """A plan measured on a short step is not trusted for a longer one: the longer step gives the kept
    blocks back and is measured fully streamed, and the plan is made again from it; an evaluation first
    measures nothing. Exact against stream=False throughout."""
    shapes = [(2, 16), (2, 16), (2, 40), (2, 40), (2, 16)]
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=2, dropout=0.1), device="cpu", codegen="eager",
                             memory_budget="1GB")
    step_model = torch.compile(model, backend="poros")
    with torch.no_grad():  # an evaluation before training
        step_model(**batches_of([(4, 48)])[0], use_cache=False)
    store = get_store(model)
    assert store.budget.plan is None and not store.budget.measuring
    torch.manual_seed(1234)
    optimizer = adamw(model)
    first = train(model, marked(step_model), batches_of(shapes[:2]), optimizer=optimizer)
    short = store.budget.plan.measured_size
    rest = train(model, marked(step_model), batches_of(shapes[2:], seed=1), optimizer=optimizer, seed=None)
    plan = poros_fx.stats(model)["residency_plan"]
    assert plan["measured_size"] > short and plan["resident_blocks"]  # planned again, blocks kept again
    assert any(f"more than the {short} the plan was measured on" in note for note in plan["adjustments"])
    torch._dynamo.reset()
    reference = poros_fx.prepare(tiny_lora_model("qwen2", layers=2, dropout=0.1), device="cpu", codegen="eager")
    reference_model = marked(torch.compile(reference, backend="poros", options={"stream": False}))
    torch.manual_seed(1234)
    optimizer = adamw(reference)
    expected = [train(reference, reference_model, batches_of(shapes[:2]), optimizer=optimizer),
                train(reference, reference_model, batches_of(shapes[2:], seed=1), optimizer=optimizer, seed=None)]
    assert compare(first, expected[0]) == EQUAL and compare(rest, expected[1]) == EQUAL


def test_dynamo_event_log_noise_is_filtered():
    """The one Dynamo log line a region compiled inside the step's compile provokes is dropped; others
    of that logger pass."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo.utils")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("ChromiumEventLogger: Start event not in stack, ignoring")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert records == ["something else"]
