"""A memory budget keeps blocks resident: exact for every budget, fewer bytes per step, peak under it.

The first step streams everything and measures its peak (on the CPU: the ledger's base bytes); the
blocks that fit in ``budget - that peak`` then stay on the device, loaded once (``runtime/budget.py``).
Two independent runs each (fresh models, same seeds), compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

import poros_fx
from poros_fx.runtime.budget import _spread, parse_size
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

EQUAL = {s: 0.0 for s in SURFACES}
LAYERS = 4


def run(stream: bool = True, budget=None, option=None, steps: int = 8, accumulate: int = 2, prefetch="auto"):
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1), device="cpu",
                             memory_budget=budget, prefetch=prefetch)
    options = {"stream": stream}
    if option is not None:
        options["memory_budget"] = option
    trace = train(model, torch.compile(model, backend="poros", options=options), demo_batches(steps),
                  accumulate=accumulate)
    return trace, poros_fx.stats(model)


@pytest.fixture(scope="module")
def reference():
    """stream=False, and the fully streamed run (its peak is the smallest budget that works)."""
    resident, _ = run(stream=False)
    streamed, s = run()
    assert compare(streamed, resident) == EQUAL
    return resident, s


@pytest.mark.parametrize("kept", [0, 3, LAYERS + 1], ids=["none", "some", "all"])
def test_budget_keeps_blocks_resident_exactly(reference, kept):
    resident, streamed_stats = reference
    sizes = streamed_stats["block_bytes"]
    minimum = streamed_stats["peak_resident_base_bytes"]
    names = streamed_stats["block_names"]  # embed, layers.0..3, head
    # the plan keeps the head, then layers spread evenly: 3 blocks are the head, layers.3 and layers.1
    wanted = {0: [], 3: ["layers.1", "layers.3", names[-1]], LAYERS + 1: names[1:]}[kept]
    kept_bytes = sum(n for name, n in zip(names, sizes) if name in wanted)
    smallest = min(n for n in sizes if n)
    budget = minimum + kept_bytes + (smallest - 1 if kept <= LAYERS else 0)  # no room for more
    trace, s = run(budget=budget)
    assert compare(trace, resident) == EQUAL, format_diffs(f"budget keeping {kept}", compare(trace, resident))
    plan = s["residency_plan"]
    assert plan["resident_blocks"] == wanted
    assert plan["streamed_peak"] == minimum and plan["resident_bytes"] == kept_bytes
    assert s["peak_resident_base_bytes"] <= plan["predicted_peak"] <= budget
    assert plan["streamed_bytes_per_step"] == plan["streamed_bytes_per_step_before"] - 2 * plan["resident_bytes"]


def test_kept_blocks_are_spread_over_the_layers():
    """The head first, then layer blocks evenly spaced (the last layer among them), so a streamed block's
    copy runs while a kept one computes; blocks of unequal size fill what room is left from the last layer."""
    from poros_fx.runtime.budget import estimate

    names = ["embed", *(f"layers.{i}" for i in range(8)), "head"]
    sizes = [0, *[10] * 8, 30]
    kept, kept_bytes, copied = estimate(sizes, names, budget=100 + 30 + 30 + 5, streamed_peak=100)
    assert kept == ["layers.2", "layers.5", "layers.7", "head"] and kept_bytes == 60
    assert copied == 2 * (sum(sizes) - 60)
    assert estimate(sizes, names, 100 + 110, 100)[0] == names[1:]
    assert estimate(sizes, names, 100 + 20, 100)[0] == ["layers.3", "layers.7"]  # no room for the head
    sizes[8] = 25  # an odd last layer: the spread of two does not fit, one does, the room left takes another
    assert estimate(sizes, names, 100 + 30 + 26, 100)[0] == ["layers.7", "head"]
    assert estimate(sizes, names, 100 + 30 + 21, 100)[0] == ["layers.5", "layers.6", "head"]


def test_resident_blocks_are_not_copied_again():
    """After the first step, each micro-batch copies the plan's streamed bytes per step, no more."""
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS), device="cpu", memory_budget=10**9)
    step_model = torch.compile(model, backend="poros")
    batch = demo_batches(1, seq=16)[0]
    step_model(**batch, use_cache=False).loss.backward()  # the measured, fully streamed step
    step_model(**batch, use_cache=False).loss.backward()  # copies the kept blocks once
    before = poros_fx.stats(model)
    step_model(**batch, use_cache=False).loss.backward()
    after = poros_fx.stats(model)
    plan = after["residency_plan"]
    assert plan["resident_blocks"] == after["block_names"][1:]  # everything but the gathered embedding
    assert after["bytes_copied"] - before["bytes_copied"] == plan["streamed_bytes_per_step"] == 0
    assert after["resident_base_bytes"] == plan["resident_bytes"]  # kept, never evicted


def test_budget_below_the_streamed_minimum_names_the_smallest_that_works(reference):
    _, streamed_stats = reference
    minimum = streamed_stats["peak_resident_base_bytes"]
    with pytest.raises(poros_fx.PorosOOMError, match=f"the smallest budget that works is {minimum} bytes"):
        run(budget=minimum - 1, steps=2)
    run(budget=minimum, steps=2)


def test_the_option_overrides_prepares_budget(reference):
    resident, streamed_stats = reference
    trace, s = run(budget="1GB", option=streamed_stats["peak_resident_base_bytes"])
    assert s["memory_budget"] == streamed_stats["peak_resident_base_bytes"]
    assert s["residency_plan"]["resident_blocks"] == []
    assert compare(trace, resident) == EQUAL


def test_parse_size():
    assert parse_size(None) is None and parse_size(123) == 123
    assert parse_size("24GB") == 24 * 10**9 and parse_size("1.5 GiB") == int(1.5 * 2**30) and parse_size("500mb") == 5 * 10**8
    for bad in ("lots", "-1GB", 0, True, "3 parsecs"):
        with pytest.raises(poros_fx.PorosConfigError, match="memory_budget must be"):
            parse_size(bad)
    with pytest.raises(Exception, match="memory_budget must be"):  # Dynamo wraps the backend's error
        torch.compile(torch.nn.Linear(2, 2), backend="poros", options={"memory_budget": "big"})(torch.ones(2))


def test_step_decorator_takes_a_budget():
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=2)

    @poros_fx.step(memory_budget="1GB")
    def train_step(model, batch):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss

    for batch in demo_batches(2, seq=16):
        train_step(model, batch)
    s = poros_fx.stats(model)
    assert s["memory_budget"] == 10**9 and s["residency_plan"]["resident_blocks"] == s["block_names"][1:]


def test_report_shows_the_plan():
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=2), device="cpu", memory_budget="1GB")
    assert "planned after the first (fully streamed) step" in poros_fx.report(model)
    step_model = torch.compile(model, backend="poros")
    step_model(**demo_batches(1, seq=16)[0], use_cache=False).loss.backward()
    text = poros_fx.report(model)
    assert "resident layers.0, layers.1, head" in text and "predicted peak" in text


def spread_with_head(names: list[str], count: int) -> list[str]:
    """The plan's rule for ``count`` kept blocks of every block kept: the head, then layers spread evenly."""
    layers = list(range(1, len(names) - 1))
    return [names[i] for i in _spread(layers, count - 1)] + [names[-1]] if count > 1 else names[-1:][:count]


def every_block_kept(budget: int):
    """A fresh model with room for every block in ``budget``, trained two optimizer steps of 2 micro-batches:
    (model, compiled, the 8 batches, its AdamW, the trace of those first 4)."""
    from poros_fx.exactness.parity import adamw

    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1), device="cpu", memory_budget=budget)
    step_model = torch.compile(model, backend="poros")
    batches, opt = demo_batches(8), adamw(model)
    return model, step_model, batches, opt, train(model, step_model, batches[:4], accumulate=2, optimizer=opt)


def test_kept_blocks_are_given_back_when_what_stays_allocated_grows(reference):
    """What stays allocated between steps can grow after the plan was made (on a GPU the optimizer's state
    appears at the first optimizer.step(), after the measured step); the next training forward gives kept
    blocks back until the budget holds again, what stays spread over the layers, and the run stays exact."""
    import warnings

    from poros_fx.exactness.parity import steps

    resident, streamed_stats = reference
    sizes = streamed_stats["block_bytes"]
    budget = streamed_stats["peak_resident_base_bytes"] + sum(sizes)  # room for every block
    model, step_model, batches, opt, first = every_block_kept(budget)
    kept_before = list(poros_fx.stats(model)["residency_plan"]["resident_blocks"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager load below is warned about once
        held = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight  # base bytes held on the device
    second = train(model, step_model, batches[4:], accumulate=2, seed=None, optimizer=opt)
    plan = poros_fx.stats(model)["residency_plan"]
    assert kept_before == streamed_stats["block_names"][1:] and len(plan["resident_blocks"]) < len(kept_before)
    assert plan["resident_blocks"] == spread_with_head(streamed_stats["block_names"], len(plan["resident_blocks"]))
    assert plan["adjustments"] and "gave back" in plan["adjustments"][0]
    assert plan["predicted_peak"] <= budget and held.numel() > 0
    both = type(first)(losses=first.losses + second.losses, grad_norms=first.grad_norms + second.grad_norms,
                       weights=first.weights + second.weights, optimizer=first.optimizer + second.optimizer)
    assert compare(both, steps(resident, 0, 4, accumulate=2)) == EQUAL


def test_kept_blocks_are_given_back_when_the_time_between_steps_peaked_above_the_budget(reference):
    """The check after a backward does not see what happens before the next forward (the optimizer step, the
    copies the backward left for that forward, tensors of the user's that come and go); the next training
    forward checks the peak since the last one started and gives kept blocks back when it was over."""
    import warnings

    from poros_fx.exactness.parity import steps

    resident, streamed_stats = reference
    sizes = streamed_stats["block_bytes"]
    budget = streamed_stats["peak_resident_base_bytes"] + sum(sizes)  # room for every block
    model, step_model, batches, opt, first = every_block_kept(budget)
    kept_before = list(poros_fx.stats(model)["residency_plan"]["resident_blocks"])
    allocated = poros_fx.stats(model)["resident_base_bytes"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager loads below are warned about once
        held = [m.base_layer.weight for m in model.modules() if hasattr(m, "base_layer")]  # base bytes on the device
    assert poros_fx.stats(model)["resident_base_bytes"] > budget
    del held  # gone again before the next step: what stays allocated did not grow
    assert poros_fx.stats(model)["resident_base_bytes"] == allocated
    second = train(model, step_model, batches[4:], accumulate=2, seed=None, optimizer=opt)
    plan = poros_fx.stats(model)["residency_plan"]
    assert kept_before == streamed_stats["block_names"][1:] and len(plan["resident_blocks"]) < len(kept_before)
    assert plan["resident_blocks"] == spread_with_head(streamed_stats["block_names"], len(plan["resident_blocks"]))
    assert any("the last step with the optimizer step after it peaked at" in a for a in plan["adjustments"])
    both = type(first)(losses=first.losses + second.losses, grad_norms=first.grad_norms + second.grad_norms,
                       weights=first.weights + second.weights, optimizer=first.optimizer + second.optimizer)
    assert compare(both, steps(resident, 0, 4, accumulate=2)) == EQUAL


def test_a_peak_over_the_budget_is_given_back_once(reference):
    """The check after a backward and the one before the next forward read the same peak counter (reset when
    a training forward starts): a step that went over gives the overflow back once, not again at the next
    forward."""
    from poros_fx.prepare import get_store
    from poros_fx.runtime import budget

    _, streamed_stats = reference
    sizes = streamed_stats["block_bytes"]
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS), device="cpu",
                             memory_budget=streamed_stats["peak_resident_base_bytes"] + sum(sizes))
    step_model = torch.compile(model, backend="poros")
    for batch in demo_batches(2):
        step_model(**batch, use_cache=False).loss.backward()
    store = get_store(model)
    p = store.budget.plan
    assert len(p.resident_blocks) == LAYERS + 1
    store.residency.ledger.step_peak = p.budget + sizes[1]  # as if the step just run had peaked one block over
    budget.measure_and_plan(store)
    kept, notes = list(p.resident_blocks), len(p.adjustments)
    assert len(kept) < LAYERS + 1 and notes == 1
    budget.start_measuring(store, p.measured_size)  # the next training forward: the same peak, nothing new
    assert p.resident_blocks == kept and len(p.adjustments) == notes


# -- turn-around ---------------------------------------------------------------------------------------------

def test_turnaround_blocks_are_not_evicted_and_reloaded():
    """The head and the last layer block are the forward's last blocks and the backward's first: their
    forward copies stay for the backward; the first layer block is the backward's last and the next
    forward's first: its backward copy stays for that forward. Exact, the same peak, fewer bytes, only
    that block left after the last step."""
    resident, _ = run(stream=False)
    counts = {}
    for turnaround in (True, False):
        torch._dynamo.reset()
        model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS, dropout=0.1), device="cpu", prefetch=1)
        step_model = torch.compile(model, backend="poros", options={"turnaround": turnaround})
        trace = train(model, step_model, demo_batches(8), accumulate=2)
        assert compare(trace, resident) == EQUAL
        counts[turnaround] = poros_fx.stats(model)
    on, off = counts[True], counts[False]
    sizes = on["block_bytes"]
    # 8 micro-batches, each a forward and a backward; every forward but the first starts with layers.0
    assert off["bytes_loaded"] - on["bytes_loaded"] == 8 * (sizes[-1] + sizes[-2]) + 7 * sizes[1]
    assert on["peak_resident_base_bytes"] == off["peak_resident_base_bytes"]
    assert on["resident_base_bytes"] == sizes[1] and off["resident_base_bytes"] == 0


def test_a_kept_block_gives_its_turnaround_place_to_the_next_streamed_block(reference):
    """Two blocks ahead, a backward leaves the next forward's first two layer blocks. The plan keeping 3
    blocks keeps layers.1 (it stays anyway), so the backward leaves layers.0 and layers.2 instead: exact,
    and the peak still under the budget."""
    resident, _ = reference
    _, streamed = run(prefetch=2)
    sizes, names = streamed["block_bytes"], streamed["block_names"]
    wanted = ["layers.1", "layers.3", names[-1]]
    kept_bytes = sum(n for name, n in zip(names, sizes) if name in wanted)
    budget = streamed["peak_resident_base_bytes"] + kept_bytes + min(n for n in sizes if n) - 1
    trace, s = run(budget=budget, prefetch=2)
    assert compare(trace, resident) == EQUAL, format_diffs("kept layers.1, two ahead", compare(trace, resident))
    assert s["residency_plan"]["resident_blocks"] == wanted
    assert s["resident_base_bytes"] == kept_bytes + sizes[names.index("layers.0")] + sizes[names.index("layers.2")]
    assert s["peak_resident_base_bytes"] <= s["residency_plan"]["predicted_peak"] <= budget


def test_a_measuring_step_leaves_no_copies_for_the_next_forward(reference):
    """The step that measures for a budget runs fully streamed from start to end: its backward leaves
    nothing for the next forward (whose plan may keep that block); the steps after it do."""
    _, streamed_stats = reference
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=LAYERS), device="cpu",
                             memory_budget=streamed_stats["peak_resident_base_bytes"])  # room for nothing kept
    step_model = torch.compile(model, backend="poros")
    first, second = demo_batches(2)
    step_model(**first, use_cache=False).loss.backward()
    assert poros_fx.stats(model)["resident_base_bytes"] == 0
    step_model(**second, use_cache=False).loss.backward()
    s = poros_fx.stats(model)
    assert s["residency_plan"]["resident_blocks"] == []
    assert s["resident_base_bytes"] == s["block_bytes"][1]  # layers.0, for the next forward


def test_a_forward_without_backward_leaves_nothing_behind():
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=2), device="cpu", prefetch=1)
    step_model = torch.compile(model, backend="poros")
    batch = demo_batches(1, seq=16)[0]
    step_model(**batch, use_cache=False).loss.backward()
    loss = step_model(**batch, use_cache=False).loss  # abandoned: its turn-around copies wait
    del loss
    assert poros_fx.stats(model)["resident_base_bytes"] > 0
    step_model(**batch, use_cache=False).loss.backward()  # the next step's backward drops what it did not take
    s = poros_fx.stats(model)
    assert s["resident_base_bytes"] == s["block_bytes"][1]  # layers.0, left for the next forward


def test_loader_and_cli_take_a_budget(tmp_path):
    from typer.testing import CliRunner

    from poros_fx.cli.app import app
    from poros_fx.models.tiny import tiny_config

    model = poros_fx.from_config(tiny_config("qwen2", layers=2), quantization="bf16", device="cpu",
                                 memory_budget="1GB")
    assert poros_fx.stats(model)["memory_budget"] == 10**9
    with pytest.raises(poros_fx.PorosConfigError, match="memory_budget must be"):
        poros_fx.from_config(tiny_config("qwen2", layers=2), memory_budget="lots")
    config = tiny_config("qwen2", layers=2)
    config.save_pretrained(tmp_path / "cfg")
    result = CliRunner().invoke(app, ["train", "--from-config", str(tmp_path / "cfg" / "config.json"), "--data", "demo",
                                      "--out", str(tmp_path / "out"), "--steps", "2", "--seq-len", "16",
                                      "--quantization", "bf16", "--device", "cpu", "--memory-budget", "1GB"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["train", "--from-config", "x", "--data", "demo", "--out", str(tmp_path / "o2"),
                                   "--memory-budget", "lots"])
    assert bad.exit_code == 2 and "memory_budget must be" in bad.output
