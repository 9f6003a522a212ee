"""sequence_chunks: each decoder layer's MLP runs in K token chunks, each recomputed on its own in the
backward. Streamed == stream=False bit for bit (two independent runs, every step, with LoRA dropout);
the region then saves the MLP's input instead of its intermediates; the settings it cannot keep exact
with are refused before the first step."""

import collections

import pytest
import torch

import poros_fx
from poros_fx.compiler.regions import table as region_tables
from poros_fx.errors import PorosConfigError
from poros_fx.exactness.parity import compare, format_diffs, train
from poros_fx.handles import get_store
from poros_fx.models.tiny import demo_batches, tiny_lora_model
from poros_fx.compiler.ops import AFTER
from poros_fx.compiler.regions.sequence_chunks import CHUNK
from poros_fx.passes.order_sequence_chunks import computes_nothing, chunk_labels

STEPS = 4
ZERO = {"loss": 0.0, "weights": 0.0, "grad_norms": 0.0, "optimizer": 0.0}


def run(mode, family, nf4, chunks, accumulate, seq, dropout=0.1, codegen="eager", **cfg):
    model = tiny_lora_model(family, nf4=nf4, dropout=dropout, **cfg)
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cpu", sequence_chunks=chunks, codegen=codegen)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(STEPS * accumulate, vocab=256, seq=seq, batch=2, seed=3)
    return train(model, step_model, batches, accumulate=accumulate, block_major=mode == "stream"), model


# fixed reference points; the generator (test_drawn_configs.py) draws sequence_chunks over every family
CASES = [
    # family,        nf4,   chunks, accumulate, seq (odd lengths: chunks of unequal sizes), codegen
    ("llama", True, 2, 2, 24, "eager"),
    ("phi3", False, 2, 1, 21, "eager"),
    ("qwen2", True, 3, 1, 20, "inductor"),  # chunks ordered by poros::after (passes/order_sequence_chunks.py)
]


@pytest.mark.parametrize("family,nf4,chunks,accumulate,seq,codegen", CASES, ids=[f"{c[0]}-k{c[2]}-{c[5]}" for c in CASES])
def test_streamed_equals_resident_with_chunks(family, nf4, chunks, accumulate, seq, codegen):
    streamed, model = run("stream", family, nf4, chunks, accumulate, seq, codegen=codegen)
    resident, _ = run("resident", family, nf4, chunks, accumulate, seq, codegen=codegen)
    assert len(streamed.weights) == STEPS
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs("streamed vs stream=False (sequence_chunks)", diffs)
    assert get_store(model).sequence_chunks == chunks
    if codegen == "inductor":  # each chunk after the first waits for the one before it, forward and backward
        region = _chunked_regions(model)[0]
        for graph in (region.forward, region.backward):
            labels = {(n.meta.get("custom") or {}).get(CHUNK) for n in graph.graph.nodes} - {None}
            # the MLP and q, k, v, o: five modules in chunks, each chunk a label of its own
            assert len(labels) == 5 * chunks
            assert len({n.meta["custom"][CHUNK] for n in graph.graph.find_nodes(op="call_function", target=AFTER)}) \
                == len(labels) - 1


def test_without_dropout_chunks_differ_from_eager_only_in_rounding():
    """No dropout: the chunked MLP computes the same function as the eager loop's (the losses of the
    first step agree bit for bit here; the weights only up to the matmuls' summation order)."""
    chunked, _ = run("stream", "qwen2", False, 3, 1, 25, dropout=0.0)
    eager, _ = run("eager", "qwen2", False, 3, 1, 25, dropout=0.0)
    assert torch.equal(chunked.losses[0], eager.losses[0])
    diffs = compare(chunked, eager)
    assert 0 < diffs["weights"] < 1e-4, diffs


def _chunked_regions(model) -> list:
    table = region_tables._TABLES[get_store(model).regions.handle]
    return [r for rs in table.by_key.values() for r in rs if r.backward is not None]


def _saved_elements(model) -> int:
    """Elements a layer's region saves for its backward (beyond its outputs), at the traced sizes."""
    regions = _chunked_regions(model)
    fw = regions[0].forward
    outs = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])[regions[0].num_outputs:]
    total = 0
    for node in outs:
        val = node.meta["val"]
        total += int(torch.Size([int(s) if not isinstance(s, torch.SymInt) else s.node.hint for s in val.shape]).numel())
    return total


def test_chunks_save_the_inputs_of_the_chunked_modules_not_their_intermediates():
    """The MLP's intermediates (tokens x intermediate each) and the adapters' (a projection's dropped input,
    in the adapter's fp32) are recomputed, not saved: the chunked region saves less than an eighth of what the
    unchunked one saves (with the MLP alone in chunks, about a quarter)."""
    sizes = {}
    for chunks in (1, 4):
        torch._dynamo.reset()
        model = tiny_lora_model("llama", dropout=0.0, layers=1, intermediate=256)
        poros_fx.prepare(model, device="cpu", sequence_chunks=chunks)
        torch.compile(model, backend="poros")(**demo_batches(1, vocab=256, seq=16)[0]).loss.backward()
        sizes[chunks] = _saved_elements(model)
    assert sizes[4] < sizes[1] / 8, sizes
    # the backward runs chunk by chunk: each chunk's recompute and gradient (its nodes that compute) in one
    # run, not several chunks' recomputes side by side
    backward = _chunked_regions(model)[0].backward.graph
    labels = chunk_labels(backward)
    runs = [labels[n] for n in backward.nodes if labels[n] is not None and not computes_nothing(n)]
    runs = [label for i, label in enumerate(runs) if i == 0 or runs[i - 1] != label]
    assert sorted(runs) == list(range(5 * 4)), runs  # the MLP and q, k, v, o, four chunks each


def _matmul_shapes(step_model, batch) -> collections.Counter:
    """How often each matmul shape ran in one training step (the CPU profiler's ``aten::mm`` records)."""
    step_model(**batch).loss.backward()  # compiled before the counted step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step_model(**batch).loss.backward()
    return collections.Counter(str(e.input_shapes) for e in prof.events() if e.name == "aten::mm")


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_backward_reruns_a_region_for_its_saved_tensors_alone(chunks):
    """Streamed, the backward reruns each layer for what the layer's backward reads, not for its output
    (compiler/regions/split.py): the MLP's matmuls run as often as with stream=False (chunked: its forward
    and the backward's recompute of each chunk, not a third time; unchunked: the down projection once)."""
    counts = {}
    for stream in (True, False):
        torch._dynamo.reset()
        model = tiny_lora_model("llama", dropout=0.1, layers=2, intermediate=96)
        poros_fx.prepare(model, device="cpu", sequence_chunks=chunks)
        step_model = torch.compile(model, backend="poros", options={"stream": stream})
        counts[stream] = _matmul_shapes(step_model, demo_batches(1, vocab=256, seq=16)[0])
        region = _chunked_regions(model)[0] if chunks > 1 else get_store(model).regions.regions[0]
        assert "eager" in region.saved_only
    tokens = 2 * 16 // chunks
    into, out_of = f"[[{tokens}, 64], [64, 96]]", f"[[{tokens}, 96], [96, 64]]"  # x @ W_gate/up.T, and W_down's
    assert counts[False][into] and counts[False][out_of]
    # an unchunked layer saves its gate and up projections' outputs: the rerun computes them (two layers x two)
    assert counts[True][into] - counts[False][into] == (4 if chunks == 1 else 0)
    assert counts[True][out_of] == counts[False][out_of]  # the down projection is not rerun


def test_settings_that_cannot_run_chunks_are_refused():
    with pytest.raises(PorosConfigError, match="sequence_chunks must be an integer >= 1"):
        poros_fx.prepare(tiny_lora_model("qwen2"), device="cpu", sequence_chunks=0)
    with pytest.raises(PorosConfigError, match=r"regions=False\) has no regions"):
        poros_fx.prepare(tiny_lora_model("qwen2"), device="cpu", sequence_chunks=2, regions=False)
    model = tiny_lora_model("qwen2")
    poros_fx.prepare(model, device="cpu")
    compiled = torch.compile(model, backend="poros", options={"sequence_chunks": 2})
    batch = demo_batches(1, vocab=256, seq=8)[0]
    with pytest.raises(Exception, match="set it when the model is prepared"):
        compiled(**batch)


def test_step_sets_the_chunks_of_a_prepared_model():
    model = tiny_lora_model("qwen2", layers=1)
    poros_fx.prepare(model, device="cpu")

    @poros_fx.step(sequence_chunks=3)
    def train_step(model, batch):
        return model(**batch).loss

    train_step(model, demo_batches(1, vocab=256, seq=9)[0]).backward()
    assert get_store(model).sequence_chunks == 3
    assert all(layer.__dict__["_poros_sequence_chunks"] == 3 for layer in model.base_model.model.model.layers)
