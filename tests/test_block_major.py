"""Block-major accumulation: each block loaded once per optimizer step, the adapter the same bits.

Every comparison trains independent model copies from the same seeds (never one run against
itself): block-major streamed, micro-batch-major streamed (``block_major=False``), ``stream=False``
and, where CPU kernels allow, the plain eager PEFT loop; ``torch.equal`` on losses, adapter weights,
gradient norms and AdamW state at every step, LoRA dropout 0.1.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx

import poros_fx
from poros_fx.errors import PorosConfigError, PorosExactnessError
from poros_fx.runtime import draws
from poros_fx.runtime.lockstep import Lockstep
from poros_fx.exactness.parity import SURFACES, adamw, compare, format_diffs, optimizer_step, train, Trace
from poros_fx.models.tiny import demo_batches, tiny_lora_model

EQUAL = {s: 0.0 for s in SURFACES}
LAYERS = 3
STEPS = 3


# the prepared models of the running test: a later copy takes its region from a live one of the same
# structure instead of tracing it again (~6 s), as stream=False takes the streamed model's in every parity test
_LIVE: list[torch.nn.Module] = []


@pytest.fixture(autouse=True)
def _drop_live_models():
    yield
    _LIVE.clear()


def model_for(mode: str, nf4: bool = False, dtype: torch.dtype = torch.float32, codegen: str = "eager"):
    model = tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1, nf4=nf4, dtype=dtype)
    if mode == "eager":
        return model, model
    poros_fx.prepare(model, device="cpu", codegen=codegen)
    _LIVE.append(model)
    options = {"stream": mode != "resident", "block_major": mode == "block_major"}
    return model, torch.compile(model, backend="poros", options=options)


def copied_per_forward_pass(s: dict, forwards: int) -> int:
    """Bytes a run copied as if no forward took the first layer block the backward before it left on the
    device (every forward but the first does: prefetch 1 on the CPU, ``compiler/backend.py``)."""
    return s["bytes_copied"] + (forwards - 1) * s["block_bytes"][1]


def run(mode: str, accumulate: int, steps: int = STEPS, seq: int = 16, **kw):
    torch._dynamo.reset()
    model, step_model = model_for(mode, **kw)
    batches = demo_batches(steps * accumulate, seq=seq, batch=2)
    trace = train(model, step_model, batches, accumulate=accumulate, block_major=mode != "eager")
    return trace, (poros_fx.stats(model) if mode != "eager" else None)


# fp32 and bf16 at accumulation 2 and 4, against stream=False and the eager loop, run in the parity matrix
# (tests/test_parity.py: its streamed runs with accumulation are block-major)
# (the generator draws block-major with the Inductor codegen)
@pytest.mark.parametrize("accumulate,nf4,dtype,codegen", [(3, True, torch.float32, "eager")], ids=["nf4-acc3"])
def test_block_major_equals_micro_batch_major_and_resident(accumulate, nf4, dtype, codegen):
    block, s = run("block_major", accumulate, nf4=nf4, dtype=dtype, codegen=codegen)
    micro, m = run("micro_major", accumulate, nf4=nf4, dtype=dtype, codegen=codegen)
    resident, _ = run("resident", accumulate, nf4=nf4, dtype=dtype, codegen=codegen)
    assert compare(block, micro) == EQUAL, format_diffs("block-major vs micro-batch-major", compare(block, micro))
    assert compare(block, resident) == EQUAL, format_diffs("block-major vs stream=False", compare(block, resident))
    assert s["block_major_steps"] == STEPS and m["block_major_steps"] == 0
    # each block crosses the link once per pass per optimizer step, not once per micro-batch (block-major
    # runs STEPS forwards, micro-batch-major STEPS * accumulate)
    assert copied_per_forward_pass(m, STEPS * accumulate) == accumulate * copied_per_forward_pass(s, STEPS)
    assert s["forward_runs"] == s["backward_runs"] == STEPS * accumulate
    if codegen == "eager":  # CPU aten kernels: the plain eager loop too
        eager, _ = run("eager", accumulate, nf4=nf4, dtype=dtype)
        assert compare(block, eager) == EQUAL, format_diffs("block-major vs eager", compare(block, eager))


def test_copies_per_step_do_not_grow_with_accumulation(tmp_path, monkeypatch):
    _, one = run("block_major", 1, steps=1)
    monkeypatch.setenv("POROS_FX_DUMP", str(tmp_path))
    _, four = run("block_major", 4, steps=1)
    assert four["bytes_copied"] == one["bytes_copied"] and four["loads"] == one["loads"]
    assert one["block_major_steps"] == 0  # a single micro-batch has nothing to share
    # the dump prints the lockstep's segments, each a graph of its own (runtime/lockstep.py)
    for phase in ("forward", "backward"):
        (dumped,) = tmp_path.glob(f"graph_*/*_lockstep_{phase}.py")
        text = dumped.read_text()
        assert "class segment_0_body" in text and "class segment_1_body" in text, text[:2000]


def _step_fn(accumulate: int, **options):
    @poros_fx.step(accumulate=accumulate, device="cpu", **options)
    def train_step(model, batch):
        loss = model(**batch, use_cache=False).loss / accumulate
        loss.backward()
        return loss.detach()

    return train_step


def _decorated(block_major: bool, zero_every: int = 1):
    """AdamW steps of ``@poros_fx.step(accumulate=3)`` calls; the optimizer steps every ``zero_every``
    calls (gradients of several calls add up first)."""
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1)
    _LIVE.append(model)  # prepared by the decorator's first call
    train_step = _step_fn(3, block_major=block_major)
    batches = demo_batches(4 * 3, seq=16, batch=2)
    torch.manual_seed(1234)
    trace, opt = Trace(), None
    for call in range(4):
        trace.losses += train_step(model, batches[3 * call:3 * call + 3])
        if opt is None:
            params, opt = [p for p in model.parameters() if p.requires_grad], adamw(model)
        if (call + 1) % zero_every == 0:
            optimizer_step(trace, params, opt)
    return trace, poros_fx.stats(model)


def test_lengths_above_256_run_block_major():
    """The graph takes the length as an int; Python makes a new int object per call above 256, so the
    micro-batches' inputs are compared by value there (they once raised PorosExactnessError)."""
    block, s = run("block_major", 2, steps=2, seq=260)
    micro, m = run("micro_major", 2, steps=2, seq=260)
    assert compare(block, micro) == EQUAL, format_diffs("block-major vs micro-batch-major", compare(block, micro))
    assert s["block_major_steps"] == 2 and m["block_major_steps"] == 0


def test_step_decorator_runs_block_major():
    """Calls 1 and 3 start from no ``.grad``; calls 2 and 4 from the ``.grad`` the call before left (no
    zero_grad in between), which is summed first, as autograd's accumulation does."""
    block, s = _decorated(True, zero_every=2)
    micro, m = _decorated(False, zero_every=2)
    assert compare(block, micro) == EQUAL, format_diffs("@step block-major vs micro-batch-major", compare(block, micro))
    assert s["block_major_steps"] == 4 and m["block_major_steps"] == 0


def _forwards_then_backwards(block_major: bool, order, prepared=None):
    """All forwards first, then the backwards in ``order``: autograd adds the gradients in call order.
    ``prepared``: the (model, compiled model) of an earlier call to run again instead of a new copy."""
    if prepared is None:
        torch._dynamo.reset()
        prepared = model_for("block_major" if block_major else "micro_major")
    model, step_model = prepared
    model.zero_grad(set_to_none=True)
    batches = demo_batches(3, seq=16, batch=2)
    torch.manual_seed(5)
    with poros_fx.block_major(model, batches):
        losses = [step_model(**b, use_cache=False).loss for b in batches]
        for i in order:
            losses[i].backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad], losses, prepared


def test_backward_order_is_autogards_call_order():
    grads, losses, _ = _forwards_then_backwards(True, [2, 0, 1])
    ref_grads, ref_losses, micro = _forwards_then_backwards(False, [2, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    # the same micro-batch-major model again (no optimizer step between), only the order changed
    in_order, same_losses, _ = _forwards_then_backwards(False, [0, 1, 2], prepared=micro)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, same_losses))
    assert not all(torch.equal(a, b) for a, b in zip(ref_grads, in_order))  # the order shows in the bits


def _one_step(fn, accumulate: int = 2, **kw):
    torch._dynamo.reset()
    model, step_model = model_for("block_major", **kw)
    batches = demo_batches(accumulate, seq=16, batch=2)
    torch.manual_seed(3)
    with poros_fx.block_major(model, batches):
        fn(step_model, batches)
    return model


def test_micro_batches_moved_inside_the_loop_run_micro_batch_major_and_say_why():
    def moved(step_model, batches):
        for b in batches:
            step_model(**{k: v.clone() for k, v in b.items()}, use_cache=False).loss.backward()

    with pytest.warns(UserWarning, match="neither a tensor of the model nor a tensor of micro_batches"):
        model = _one_step(moved)
    assert poros_fx.stats(model)["block_major_steps"] == 0


def test_micro_batches_of_different_shapes_run_micro_batch_major():
    torch._dynamo.reset()
    model, step_model = model_for("block_major")
    batches = [demo_batches(1, seq=16, batch=2)[0], demo_batches(1, seq=12, batch=2)[0]]
    with pytest.warns(UserWarning, match="micro-batches of different shapes run micro-batch-major"):
        with poros_fx.block_major(model, batches):
            for b in batches:
                step_model(**b, use_cache=False).loss.backward()
    assert poros_fx.stats(model)["block_major_steps"] == 0


def test_random_numbers_drawn_between_micro_batches_raise():
    def draws_between(step_model, batches):
        for b in batches:
            step_model(**b, use_cache=False).loss.backward()
            torch.rand(3)  # micro-batch order would give the next micro-batch other masks

    with pytest.raises(PorosExactnessError, match="random numbers were drawn between micro-batch 0's forward"):
        _one_step(draws_between)


def test_a_backward_left_out_raises_at_the_end_of_the_step():
    def skips(step_model, batches):
        losses = [step_model(**b, use_cache=False).loss for b in batches]
        losses[0].backward()

    with pytest.raises(PorosExactnessError, match="the backward ran for 1 of the step's 2 micro-batches"):
        _one_step(skips)


def test_other_inputs_than_the_micro_batch_raise():
    def twice(step_model, batches):
        for b in (batches[0], batches[0]):  # the second forward's outputs were computed for micro_batches[1]
            step_model(**b, use_cache=False).loss.backward()

    with pytest.raises(PorosExactnessError, match="micro-batch 1's forward got other inputs"):
        _one_step(twice)


def test_a_replay_that_misses_a_draw_raises_before_anything_is_returned(monkeypatch):
    """Breaking the construction on purpose: if the replayed draws did not advance the generator as the
    graph does, micro-batch 1 would get micro-batch 0's masks; the check sees it and raises."""
    monkeypatch.setattr(draws, "replay", lambda found: None)

    def plain(step_model, batches):
        for b in batches:
            step_model(**b, use_cache=False).loss.backward()

    with pytest.raises(PorosExactnessError, match="could not reproduce micro-batch order's random numbers"):
        _one_step(plain)


def test_bad_uses_raise():
    model = tiny_lora_model("qwen2", layers=1)
    with pytest.raises(PorosConfigError, match="call poros_fx.prepare"):
        with poros_fx.block_major(model, [{}]):
            pass
    poros_fx.prepare(model, device="cpu")
    with pytest.raises(PorosConfigError, match="as a non-empty list"):
        with poros_fx.block_major(model, {}):
            pass
    with pytest.raises(PorosConfigError, match="already running"):
        with poros_fx.block_major(model, [{}]), poros_fx.block_major(model, [{}]):
            pass
    with pytest.raises(Exception, match="block_major must be True or False"):  # Dynamo wraps the backend's error
        torch.compile(model, backend="poros", options={"block_major": "yes"})(torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(PorosConfigError, match="block_major must be True or False"):
        poros_fx.step(block_major=1)(lambda model, batch: None)
    with pytest.raises(PorosConfigError, match="block_major must be True or False"):
        poros_fx.prepare(tiny_lora_model("qwen2", layers=1), device="cpu", block_major="yes")


def test_lockstep_sums_outputs_in_list_order():
    """The lockstep runner on a small graph: shared nodes once, per-micro-batch nodes per list, outputs
    summed in list order (a different order gives other bits for these values)."""
    graph = fx.Graph()
    w, x = graph.placeholder("w"), graph.placeholder("x")
    shared = graph.call_function(torch.mul, (w, 3.0))
    out = graph.call_function(torch.mul, (shared, x))
    graph.output((out, None))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    calls = []
    plan = Lockstep(gm, frozenset({1}), is_evict=lambda n: False, draws=lambda n: False, reduce=True)
    w0 = torch.tensor([1.0])
    xs = [torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])]  # float32: 3 + -3e8 == -3e8
    total, none = plan.run([[w0, x] for x in xs])
    assert none is None and total.item() == 3.0  # (3e8 + -3e8) + 3
    reversed_total, _ = plan.run([[w0, x] for x in reversed(xs)])
    assert reversed_total.item() == 0.0  # (3 + -3e8) + 3e8
    per = Lockstep(gm, frozenset({1}), is_evict=lambda n: False, draws=lambda n: False)
    outs = per.run([[w0, x] for x in xs], switch=calls.append)
    assert [o[0].item() for o in outs] == [3e8, -3e8, 3.0] and calls == []  # nothing draws: no switching


def test_trainer_runs_block_major(tmp_path):
    """PorosTrainer with gradient_accumulation_steps=2 copies the base half as often as micro-batch order,
    with the same adapter (tests/test_trainer.py compares it with a plain Trainer)."""
    import transformers

    from poros_fx.hf import PorosTrainer

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.rows = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0]}
                         for b in demo_batches(8, vocab=256, seq=16, batch=1, seed=3)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    def fit(block_major: bool):
        torch._dynamo.reset()
        model = tiny_lora_model("qwen2", dtype=torch.float32, dropout=0.1, layers=2)
        _LIVE.append(model)  # PorosTrainer prepares it
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(block_major)), max_steps=2,
                                              per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                              learning_rate=1e-3, logging_steps=1, seed=1, report_to=[],
                                              use_cpu=True, disable_tqdm=True, save_strategy="no")
        trainer = PorosTrainer(model=model, args=args, train_dataset=Rows(),
                               poros_options={"device": "cpu", "block_major": block_major})
        trainer.train()
        weights = [p.detach().clone() for n, p in model.named_parameters() if "lora_" in n]
        return weights, [h["loss"] for h in trainer.state.log_history if "loss" in h], poros_fx.stats(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights, log, s = fit(True)
    assert not [w for w in caught if "block-major" in str(w.message)]  # no fallback: it really ran block-major
    ref_weights, ref_log, m = fit(False)
    assert log == ref_log and all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert s["block_major_steps"] == 2 and copied_per_forward_pass(m, 4) == 2 * copied_per_forward_pass(s, 2)
