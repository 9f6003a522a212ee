"""``prefetch="auto"`` (the default): the backward's depth from the measured forward (runtime/depth.py)."""

import pytest
import torch

import poros_fx
import poros_fx.models.tiny
from poros_fx.prepare import get_store
from poros_fx.runtime.depth import choose_prefetch, summarize_timing


def test_depth_hides_a_copy_under_the_backward_of_the_blocks_before_it():
    timing = summarize_timing([8.2, 8.3, 8.1], [2.8, 2.9, 2.7], [0.1, 0.0, 0.2])
    assert timing == {"copy_ms": 8.2, "block_compute_ms": 2.8, "stall_ms": pytest.approx(0.3), "groups": 3}
    depth, why = choose_prefetch(timing, device_type="cuda", block_bytes=450 * 2**20, free_bytes=100 * 2**30)
    assert depth == 1 and "8.20 ms" in why and "2.80 ms" in why
    fast = summarize_timing([8.2], [1.0], [])
    assert choose_prefetch(fast, device_type="cuda", block_bytes=2**20, free_bytes=None)[0] == 3
    assert choose_prefetch(summarize_timing([50.0], [0.1], []), device_type="cuda", block_bytes=2**20,
                           free_bytes=None)[0] == 4  # LIMIT
    # half of the free memory holds the computing block and one more: capped at 1
    depth, why = choose_prefetch(fast, device_type="cuda", block_bytes=2**30, free_bytes=4 * 2**30)
    assert depth == 1 and "free device memory" in why
    assert choose_prefetch(None, device_type="cuda", block_bytes=1, free_bytes=None) == (
        1, "prefetch auto: 1 (nothing measured: the backward was compiled before the forward ran)")
    assert choose_prefetch(timing, device_type="cpu", block_bytes=1, free_bytes=None)[0] == 1
    assert choose_prefetch(summarize_timing([8.0], [], []), device_type="cuda", block_bytes=1, free_bytes=None)[0] == 1
    # a memory budget's kept blocks sit between streamed ones: two ahead at least, unless memory caps it
    depth, why = choose_prefetch(timing, device_type="cuda", block_bytes=450 * 2**20, free_bytes=100 * 2**30,
                                 budgeted=True)
    assert depth == 2 and "at least 2 under a memory budget" in why
    assert choose_prefetch(fast, device_type="cuda", block_bytes=2**20, free_bytes=None, budgeted=True)[0] == 3
    assert choose_prefetch(None, device_type="cuda", block_bytes=1, free_bytes=None, budgeted=True)[0] == 2
    assert choose_prefetch(fast, device_type="cuda", block_bytes=2**30, free_bytes=4 * 2**30, budgeted=True)[0] == 1
    assert choose_prefetch(timing, device_type="cpu", block_bytes=1, free_bytes=None, budgeted=True)[0] == 1


def test_auto_prefetch_on_the_cpu_trains_like_prefetch_1_and_says_why():
    from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
    from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

    batches = demo_batches(4, seq=16)
    runs = {}
    for prefetch in ("auto", 1):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = lora_model(tiny_config("qwen2", layers=2), dropout=0.1)
        poros_fx.prepare(model, device="cpu")  # the default is "auto"; the other run overrides it in options
        options = {} if prefetch == "auto" else {"prefetch": prefetch}
        runs[prefetch] = train(model, torch.compile(model, backend="poros", options=options), batches, accumulate=2)
        (schedule,) = get_store(model).schedules
        assert get_store(model).prefetch == "auto" and poros_fx.stats(model)["prefetch"] == "auto"
        if prefetch == "auto":
            assert schedule.auto_prefetch and schedule.prefetch == 1
            assert "CPU compute device" in schedule.prefetch_note and schedule.prefetch_note in schedule.table()
        else:
            assert not schedule.auto_prefetch and schedule.prefetch == 1 and not schedule.prefetch_note
    diffs = compare(runs["auto"], runs[1])
    assert diffs == {k: 0.0 for k in SURFACES}, format_diffs("prefetch auto vs 1", diffs)


def test_a_fixed_prefetch_in_prepare_turns_auto_off():
    model = poros_fx.models.tiny.lora_model(poros_fx.models.tiny.tiny_config("qwen2", layers=2))
    poros_fx.prepare(model, device="cpu", prefetch=2)
    torch._dynamo.reset()
    step = torch.compile(model, backend="poros")
    step(input_ids=torch.ones(1, 8, dtype=torch.long), labels=torch.ones(1, 8, dtype=torch.long)).loss.backward()
    (schedule,) = get_store(model).schedules
    assert not schedule.auto_prefetch and schedule.prefetch == 2


@pytest.mark.parametrize("text,value", [("auto", "auto"), ("0", 0), ("3", 3)])
def test_parse_prefetch(text, value):
    from poros_fx.options import parse_prefetch

    assert parse_prefetch(text) == value


@pytest.mark.parametrize("text", ["-1", "two", "Auto", ""])
def test_parse_prefetch_refuses(text):
    from poros_fx.errors import PorosConfigError
    from poros_fx.options import parse_prefetch

    with pytest.raises(PorosConfigError, match="prefetch must be an integer >= 0 .* or 'auto'"):
        parse_prefetch(text)
