"""Residency: what the ledger measured, and the structure of the partitioned graphs."""

import pytest
import torch
import torch.fx as fx

import poros_fx
from poros_fx.runtime.executor import GraphRuntime
from poros_fx.passes.residency import aliases
from poros_fx.models.tiny import demo_batches, tiny_lora_model


def step(model, step_model, micro_batches):
    for batch in micro_batches:
        step_model(**batch, use_cache=False).loss.backward()


@pytest.mark.parametrize("block_size,prefetch", [(1, 0), (1, 1), (2, 0), (2, 1), (1, 2)])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_peak_and_loads(block_size, prefetch, nf4):
    model = tiny_lora_model("qwen2", layers=4, nf4=nf4)
    poros_fx.prepare(model, device="cpu", block_size=block_size, prefetch=prefetch)
    step_model = torch.compile(model, backend="poros")
    step(model, step_model, demo_batches(1))  # compile
    poros_fx.stats(model, reset=True)
    micro = 3
    step(model, step_model, demo_batches(micro, seed=1))
    s = poros_fx.stats(model)
    blocks = s["block_bytes"]
    assert s["block_names"][0] == "embed" and s["block_names"][-1] == "head"
    assert len(blocks) == 2 + 4 // block_size
    # everything loaded was evicted but the first `prefetch` layer blocks, which the backward left for the
    # next forward (it starts with them)
    back = sum(blocks[1:1 + prefetch])
    assert s["resident_base_bytes"] == back
    assert 0 < s["peak_resident_base_bytes"] <= (1 + prefetch) * max(blocks)
    # every decoder-layer and head weight twice per micro-batch (forward, recompute), except the
    # turn-around: the head (and with prefetch, the last layer block) stay from the forward's end into the
    # backward, which starts with them, and the backward's last blocks stay for the next forward (the
    # compiling step left them for the first of these); the embedding table never: its rows are
    # gathered from the host store
    assert blocks[0] == 0
    turnaround = blocks[-1] + (blocks[-2] if prefetch >= 1 else 0)
    assert s["bytes_loaded"] == micro * (2 * sum(blocks) - turnaround - back)
    assert s["recomputed_blocks"] == micro * (len(blocks) - 1)
    assert s["forward_runs"] == s["backward_runs"] == micro


def test_without_turnaround_every_block_is_loaded_twice():
    model = tiny_lora_model("qwen2", layers=4)
    poros_fx.prepare(model, device="cpu", prefetch=1)
    step_model = torch.compile(model, backend="poros", options={"turnaround": False})
    step(model, step_model, demo_batches(1))
    poros_fx.stats(model, reset=True)
    step(model, step_model, demo_batches(2, seed=1))
    s = poros_fx.stats(model)
    assert s["bytes_loaded"] == 2 * 2 * sum(s["block_bytes"]) and s["resident_base_bytes"] == 0


def test_peak_grows_with_prefetch():
    peaks = []
    for prefetch in (0, 1):
        torch._dynamo.reset()
        model = tiny_lora_model("llama", layers=4)
        poros_fx.prepare(model, device="cpu", prefetch=prefetch)
        step(model, torch.compile(model, backend="poros"), demo_batches(1))
        peaks.append(poros_fx.stats(model)["peak_resident_base_bytes"])
    assert peaks[1] > peaks[0]


def test_stream_false_keeps_base_resident():
    model = tiny_lora_model("qwen2", layers=2)
    poros_fx.prepare(model, device="cpu")
    step_model = torch.compile(model, backend="poros", options={"stream": False})
    step(model, step_model, demo_batches(2))
    s = poros_fx.stats(model)
    entries = poros_fx.prepare.__globals__["get_store"](model).host.tensors()
    gathered = [e for e in entries if not e.blocks]  # the embedding table: rows are gathered, never loaded
    assert [e.name for e in gathered] == ["model.embed_tokens.weight"]
    # everything but the gathered table, once: each layer as its block (its tensors and the alignment gaps
    # between them), the head's tensors one by one
    assert s["peak_resident_base_bytes"] == s["resident_base_bytes"] == sum(s["block_bytes"])
    assert s["host_bytes"] - gathered[0].nbytes <= sum(s["block_bytes"]) <= s["host_bytes"] + 2 * 37 * 512
    assert s["recomputed_blocks"] == 0 and s["evictions"] == 0
    assert s["loads"] == 2 + 2  # two layer blocks, the head's norm and weight


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "inline"])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_no_base_copy_crosses_to_backward(nf4, regions):
    """Structural: no value the forward saves for the backward is a loaded base tensor or a view of one,
    and the backward graph loads every layer block again itself."""
    model = tiny_lora_model("qwen2", layers=3, nf4=nf4)
    poros_fx.prepare(model, device="cpu", regions=regions)
    step(model, torch.compile(model, backend="poros"), demo_batches(1))
    store = poros_fx.prepare.__globals__["get_store"](model)
    (schedule,) = store.schedules
    fw, bw = schedule.graphs["forward"], schedule.graphs["backward"]
    loads = [n for n in fw.graph.nodes if n.op == "call_function" and getattr(n.target, "__func__", None) is GraphRuntime.load]
    assert loads, "the forward graph loads the base"
    loaded = {a for ld in loads for a in aliases(ld)}
    output = next(iter(fw.graph.find_nodes(op="output")))
    saved = [a for a in output.args[0] if hasattr(a, "op")]
    assert not loaded & set(saved)
    bw_blocks = {n.args[2] for n in bw.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "__func__", None) is GraphRuntime.load}
    assert bw_blocks == set(range(1, len(schedule.blocks)))  # every layer block and the head, not the embedding
    # besides the RNG states of the dropouts, the backward keeps one hidden state per block boundary
    # (plus the rotary tables and the tokens' sequence numbers the attention's mask is made from), never
    # block interiors
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    rng_states = {n for n in schedule.saved_boundaries if fw_nodes[n].args and isinstance(fw_nodes[n].args[0], fx.Node)
                  and fw_nodes[n].args[0].name.startswith("run_and_save")}
    # inline: one slot per random op (7 LoRA dropouts a layer, + SDPA with dropout_p=0); regions: one per layer
    assert len(rng_states) == len(schedule.rng_slots) == 3 if regions else len(rng_states) >= 3 * 7
    assert len(set(schedule.saved_boundaries) - rng_states) <= len(schedule.blocks) + 3


def test_inference_streams_without_backward():
    model = tiny_lora_model("qwen2", layers=2)
    poros_fx.prepare(model, device="cpu", prefetch=0)
    step_model = torch.compile(model, backend="poros")
    with torch.no_grad():
        step_model(**demo_batches(1)[0], use_cache=False)
    s = poros_fx.stats(model)
    assert s["resident_base_bytes"] == 0 and s["bytes_loaded"] == sum(s["block_bytes"])


def test_tied_embedding_is_gathered_then_loaded_by_the_head():
    """Qwen2.5-0.5B ties lm_head to the embedding: the embed block gathers rows of the table, the head
    loads the whole table (once: the forward's copy turns around into the backward), and nothing is
    kept after the step."""
    model = tiny_lora_model("qwen2", layers=2, tie_word_embeddings=True)
    lm = model.get_base_model()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    poros_fx.prepare(model, device="cpu", prefetch=0)
    step(model, torch.compile(model, backend="poros"), demo_batches(1))
    s = poros_fx.stats(model)
    assert s["resident_base_bytes"] == 0
    assert s["peak_resident_base_bytes"] <= max(s["block_bytes"])
    assert s["block_bytes"][0] == 0 and s["block_bytes"][-1] >= lm.model.embed_tokens.weight.nbytes
    assert s["bytes_loaded"] == 2 * sum(s["block_bytes"]) - s["block_bytes"][-1]
