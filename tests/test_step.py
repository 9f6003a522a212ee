"""``@poros_fx.step``: the user's own step function, streamed, equals the same function run eagerly.

Exactness cases build two independent model copies from the same seeds: one goes through the
decorator (prepared and compiled on its first call), the other runs the undecorated function
(``train_step.__wrapped__``) on a plain eager PEFT model. LoRA dropout 0.1, AdamW, ``torch.equal``.
"""

import gc
import weakref

import pytest
import torch
from torch import nn

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.exactness.parity import SURFACES, Trace, compare, format_diffs, optimizer_step
from poros_fx.prepare import get_store
from poros_fx.step import PorosStep, step
from poros_fx.models.tiny import demo_batches, tiny_lora_model

STEPS = 12
ZERO = {s: 0.0 for s in SURFACES}


def optimize(model, call, batches, *, micro_losses=False):
    """AdamW steps with the optimizer outside the step function, as a user writes it; ``call(model, b)``
    runs one step's forward and backward and returns its loss (or, ``micro_losses``, a list of them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    torch.manual_seed(1234)  # dropout masks come from the global generator
    trace = Trace()
    for i, batch in enumerate(batches):
        out = call(model, batch, i)
        trace.losses.extend(t.detach().clone() for t in (out if micro_losses else [out]))
        optimizer_step(trace, params, opt)
    return trace


@step
def train_step(model, batch):
    """One step: forward, backward, return the loss."""
    loss = model(**batch).loss
    loss.backward()
    return loss


def test_step_equals_eager():
    batches = demo_batches(STEPS, seq=24, seed=7)
    model = tiny_lora_model(dropout=0.1)

    def call(fn):
        # alternate positional and keyword calls: the model is found either way
        return lambda m, b, i: fn(m, b) if i % 2 else fn(model=m, batch=b)

    streamed = optimize(model, call(train_step), batches)
    reference = tiny_lora_model(dropout=0.1)
    eager = optimize(reference, call(train_step.__wrapped__), batches)
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs("@step vs eager", diffs)

    assert get_store(reference) is None  # the undecorated function left its model alone
    stats = poros_fx.stats(model)
    assert len(get_store(model).schedules) == 1  # one wrapper, compiled once, reused every step
    assert stats["backward_runs"] == STEPS
    assert stats["recomputed_blocks"] == STEPS * (len(stats["block_bytes"]) - 1)


def test_accumulate_equals_eager_loop():
    accumulate = 2

    @step(accumulate=accumulate, block_size=2, prefetch=0)
    def accum_step(model, batch):
        loss = model(**batch).loss / accumulate  # the decorator does not rescale
        loss.backward()
        return loss

    flat = demo_batches(STEPS * accumulate, seq=24, seed=3)
    groups = [flat[i:i + accumulate] for i in range(0, len(flat), accumulate)]
    model = tiny_lora_model(dropout=0.1)
    streamed = optimize(model, lambda m, g, i: accum_step(m, g), groups, micro_losses=True)
    eager = optimize(tiny_lora_model(dropout=0.1),
                     lambda m, g, i: [accum_step.__wrapped__(m, b) for b in g], groups, micro_losses=True)
    assert len(streamed.losses) == STEPS * accumulate
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs("@step(accumulate=2) vs eager", diffs)
    stats = poros_fx.stats(model)
    assert stats["block_size"] == 2 and stats["prefetch"] == 0  # the decorator's settings reached prepare
    assert stats["backward_runs"] == STEPS * accumulate


def test_both_forms_keep_the_function():
    def f(model, batch):
        """doc of f"""

    for decorated in (step(f), step()(f), step(accumulate=3)(f)):
        assert isinstance(decorated, PorosStep)
        assert decorated.__wrapped__ is f
        assert decorated.__name__ == "f" and decorated.__doc__ == "doc of f"
    assert step(accumulate=3)(f).accumulate == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(accumulate=0), "accumulate must be an integer >= 1"),
    (dict(accumulate=True), "accumulate must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(stream="no"), "stream must be True or False"),
])
def test_bad_decorator_arguments(kwargs, match):
    with pytest.raises(PorosConfigError, match=match):
        step(**kwargs)(lambda model, batch: None)


@pytest.mark.parametrize("micro_batches,match", [
    ("one", "pass a list of 2 micro-batches as 'batch', got dict"),
    ("three", "accumulate=2 but got 3 micro-batches in 'batch'"),
])
def test_accumulate_rejects_wrong_micro_batches(micro_batches, match):
    calls = []

    @step(accumulate=2)
    def accum_step(model, batch):
        calls.append(batch)

    model = tiny_lora_model(layers=1)
    batches = demo_batches(3)
    with pytest.raises(PorosConfigError, match=match):
        accum_step(model, batches[0] if micro_batches == "one" else batches)
    assert calls == [] and get_store(model) is None  # raised before running or preparing anything


def test_no_module_argument():
    with pytest.raises(PorosConfigError, match="no nn.Module argument"):
        step(lambda model, batch: None)("not a model", {})


def test_compiled_model_is_refused():
    model = tiny_lora_model(layers=1)
    with pytest.raises(PorosConfigError, match="not torch.compile"):
        train_step(torch.compile(model, backend="poros"), demo_batches(1)[0])


def test_modules_without_parameters_pass_through_and_wrapper_is_cached():
    seen = []

    @step
    def loss_step(model, batch, loss_fn):
        seen.append((model, loss_fn))
        logits = model(input_ids=batch["input_ids"]).logits
        loss = loss_fn(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        return loss

    model, loss_fn = tiny_lora_model(layers=1), nn.CrossEntropyLoss()
    for batch in demo_batches(2):
        loss_step(model, batch, loss_fn)
    (wrapper, fn_a), (wrapper_b, fn_b) = seen
    assert fn_a is loss_fn and fn_b is loss_fn  # nothing to stream: left as it is
    assert wrapper is wrapper_b and wrapper._orig_mod is model  # one compiled wrapper per model
    assert get_store(loss_fn) is None


def test_unprepared_model_gets_a_new_wrapper():
    model = tiny_lora_model(layers=1)
    seen = []

    @step
    def spy_step(model, batch):
        seen.append(model)
        model(**batch).loss.backward()

    batch = demo_batches(1)[0]
    spy_step(model, batch)
    poros_fx.unprepare(model)
    spy_step(model, batch)  # prepared again; the old wrapper was compiled against the old store
    assert seen[0] is not seen[1] and seen[1]._orig_mod is model
    assert poros_fx.stats(model)["backward_runs"] == 1  # the new store counts only its own step


def test_decorator_does_not_keep_the_model_alive():
    model = tiny_lora_model(layers=1)
    train_step(model, demo_batches(1)[0])
    gone = weakref.ref(model)
    assert len(train_step._compiled) >= 1
    del model
    gc.collect()
    assert gone() is None  # nor its host store: a model made per trial in a sweep is freed
