"""Long sequences: the head and loss in vocabulary chunks, boundary activations offloaded to the host.

Exactness as everywhere (``torch.equal``): streamed == ``stream=False``; with the eager codegen also ==
the user's eager loop computing the loss with the same chunked function (``poros_fx.loss``: the chunked
sum order is not HF's ``cross_entropy``, so HF's own loss is not the reference here). The Inductor
codegen's streamed == ``stream=False`` with the chunked loss is checked in tests/test_compile_cache.py.
"""

import types

import pytest
import torch

import poros_fx
from poros_fx.compiler import host_fit
from poros_fx.compiler.host_fit import HOST_HEADROOM, offloaded_bytes, reserve_offload
from poros_fx.errors import PorosConfigError
from poros_fx.loss import chunked_causal_lm_loss, eager_rows, row_chunks
from poros_fx.prepare import set_trace_options
from poros_fx.prepare import get_store
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

ZERO = {s: 0.0 for s in SURFACES}
VOCAB, SEQ, BATCH, CHUNKS = 384, 24, 2, 3  # chunks of 128 rows: no saved size is a chunk's by chance


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's cores are shared
    yield
    torch.set_num_threads(threads)


def _eager_chunked(model):
    """The user's eager loop with the chunked loss: decoder, then ``chunked_causal_lm_loss``."""
    lm = model.get_base_model()

    def step(input_ids, labels, **kwargs):
        hidden = lm.model(input_ids=input_ids, **kwargs).last_hidden_state
        return types.SimpleNamespace(loss=chunked_causal_lm_loss(hidden, eager_rows(lm.lm_head),
                                                                 row_chunks(VOCAB, CHUNKS), labels))

    return step


def _run(mode, *, codegen="eager", accumulate=1, steps=3, **prepare_kwargs):
    model = tiny_lora_model("qwen2", dropout=0.1, layers=2, vocab=VOCAB)
    if mode == "eager":
        step_model = _eager_chunked(model)
    else:
        poros_fx.prepare(model, device="cpu", head_chunks=CHUNKS, chunked_loss=True, codegen=codegen, **prepare_kwargs)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(steps * accumulate, vocab=VOCAB, seq=SEQ, batch=BATCH, seed=7)
    return train(model, step_model, batches, accumulate=accumulate, block_major=mode == "stream"), model


@pytest.mark.parametrize("rows,count", [(152064, 19), (151936, 5), (262144, 33), (32000, 4), (100, 3), (256, 3)])
def test_vocabulary_chunks_cover_the_rows_on_aligned_boundaries(rows, count):
    """Every chunk of a real vocabulary starts and ends on a multiple of 64 rows (its logits' row stride is
    aligned); a vocabulary too small for that keeps even, unaligned chunks. Never an empty chunk."""
    chunks = row_chunks(rows, count)
    assert len(chunks) == count and chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and all(lo < hi for lo, hi in chunks)
    if rows >= 64 * count * 2:
        assert all(hi % 64 == 0 or hi == rows for _, hi in chunks)


def test_chunked_loss_and_offloaded_boundaries_exact_eager_codegen():
    streamed, model = _run("stream", offload_boundaries=True, accumulate=2)
    resident, _ = _run("resident", accumulate=2)
    eager, _ = _run("eager", accumulate=2)
    assert compare(streamed, resident) == ZERO, format_diffs("streamed vs stream=False", compare(streamed, resident))
    assert compare(streamed, eager) == ZERO, format_diffs("streamed vs eager chunked", compare(streamed, eager))
    stats = poros_fx.stats(model)
    assert stats["block_major_steps"] == 3
    # every block output (the embedding's and each layer's) went to the host, once per micro-batch
    schedule = get_store(model).schedules[-1]
    assert len(schedule.offloaded) == 3 and stats["offloads"] == 3 * 6
    assert stats["offloaded_bytes"] == stats["offloads"] * BATCH * SEQ * 64 * 4
    # nothing of tokens x chunk rows is kept for the backward: each chunk's logits are recomputed
    nodes = {n.name: n for n in schedule.graphs["forward"].graph.nodes}
    saved = [tuple(nodes[name].meta["val"].shape) for name in schedule.saved_boundaries
             if isinstance(nodes[name].meta.get("val"), torch.Tensor)]
    chunk_rows = {stop - start for start, stop in row_chunks(VOCAB, CHUNKS)} | {VOCAB}
    assert saved and not [s for s in saved if any(isinstance(d, int) and d in chunk_rows for d in s)], saved
    assert sum(1 for s in saved if len(s) == 1) >= CHUNKS  # the per-chunk logsumexps, [tokens] each


def test_offloaded_copies_are_what_the_backward_reads_and_surfaces():
    """Zeroing the host copies between forward and backward changes the gradients (the backward reads
    them, not a device tensor kept aside); chunked_loss returns no logits, and HF's path comes back
    when it is switched off; a compile option that disagrees with the traced forward is refused."""
    batch = demo_batches(1, vocab=VOCAB, seq=SEQ, batch=BATCH, seed=3)[0]

    def grads(tamper):
        model = tiny_lora_model("qwen2", dropout=0.0, layers=2, vocab=VOCAB)
        poros_fx.prepare(model, device="cpu", offload_boundaries=True, chunked_loss=True)
        out = torch.compile(model, backend="poros")(**batch, use_cache=False)
        assert out.logits is None
        if tamper:
            copies = [ref() for ref in get_store(model).offloaded if ref() is not None]
            assert len(copies) == 3
            for t in copies:
                t.data.zero_()  # .data: autograd's version counter of the saved tensor stays
        out.loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    clean, tampered = grads(False), grads(True)
    assert any(not torch.equal(a, b) for a, b in zip(clean, tampered))

    model = tiny_lora_model("qwen2", dropout=0.0, layers=2, vocab=VOCAB)
    reference = tiny_lora_model("qwen2", dropout=0.0, layers=2, vocab=VOCAB)
    poros_fx.prepare(model, device="cpu", chunked_loss=True)
    with pytest.raises(Exception, match="traced with chunked_loss=True"):  # Dynamo wraps the backend's error
        torch.compile(model, backend="poros", options={"chunked_loss": False})(**batch, use_cache=False)
    torch._dynamo.reset()
    set_trace_options(model, {"chunked_loss": False})
    out = torch.compile(model, backend="poros", options={"chunked_loss": False})(**batch, use_cache=False)
    expected = reference(**batch, use_cache=False)
    assert out.logits is not None and torch.equal(out.loss, expected.loss)
    with pytest.raises(PorosConfigError, match="chunked_loss must be True or False"):
        poros_fx.prepare(tiny_lora_model("qwen2", layers=2), device="cpu", chunked_loss="yes")


def test_a_step_estimated_over_the_device_memory_is_refused_with_what_fits():
    """The compiled surfaces learn the length at the first step: the backend (on CUDA) estimates the streamed
    step at the traced tokens and refuses one over the device's memory, naming the options that fit or the
    longest length. The check itself, on a prepared tiny model and made-up device memory."""
    from poros_fx.compiler.device_fit import check_step_fits, step_estimate, traced_tokens

    model = tiny_lora_model("qwen2", layers=4)
    poros_fx.prepare(model, device="cpu")
    store = get_store(model)
    lm = store.lm_ref()
    ids = torch.zeros(2, 4096, dtype=torch.long)
    buffer = torch.zeros(1, 8192, dtype=torch.long)  # an integer buffer before the inputs is not the tokens
    assert traced_tokens(["L_self_buffers_position_ids_", "L_kwargs_input_ids_", "L_kwargs_labels_"],
                         [buffer, ids, ids]) == (2, 4096)
    assert traced_tokens(["L_self_buffers_position_ids_", "L_labels_"], [buffer, ids]) == (2, 4096)
    assert traced_tokens(["L_inputs_embeds_"], [ids.float()[..., None]]) is None

    def need(offload: bool) -> int:  # the boundaries' share is what offloading changes at this size
        return step_estimate(store, lm, (2, 4096), offload_boundaries=offload).total

    between = (need(False) + need(True)) // 2
    assert need(True) < between < need(False)
    check_step_fits(store, lm, (2, 4096), need(False) + 2**20, "enough", offload_boundaries=False)  # nothing raised
    with pytest.raises(PorosConfigError, match=r"2 x 4096 tokens.*more than the cap: (with .* which fits|the longest)"):
        check_step_fits(store, lm, (2, 4096), between, "the cap", offload_boundaries=False)
    with pytest.raises(PorosConfigError, match=r"longest length estimated to fit is about \d+ tokens"):
        check_step_fits(store, lm, (2, 1 << 20), between, "the cap", offload_boundaries=True)


def test_what_a_forward_offloads_is_reserved_before_it_runs_or_the_step_is_refused(monkeypatch):
    """``offloaded_bytes`` of a compiled forward is what one run of it offloads (the ledger's bytes); on CUDA a
    host whose available memory cannot page-lock that much refuses the step before it runs, with the length
    that fits, and page-locks nothing."""
    model = tiny_lora_model("qwen2", dropout=0.0, layers=2, vocab=VOCAB)
    poros_fx.prepare(model, device="cpu", offload_boundaries=True, chunked_loss=True)
    batch = demo_batches(1, vocab=VOCAB, seq=SEQ, batch=BATCH, seed=3)[0]
    torch.compile(model, backend="poros")(**batch, use_cache=False).loss.backward()
    store = get_store(model)
    schedule = store.schedules[-1]
    forward = schedule.graphs["forward"]
    need = offloaded_bytes(forward, schedule.offloaded)
    assert need == poros_fx.stats(model)["offloaded_bytes"] == 3 * BATCH * SEQ * 64 * 4  # every size 512-aligned
    on_cuda = types.SimpleNamespace(stream=True, offload_boundaries=True, device=torch.device("cuda"),
                                    offloaded=schedule.offloaded)
    monkeypatch.setattr(host_fit, "host_ram_available", lambda: HOST_HEADROOM + need // 4)
    with pytest.raises(PorosConfigError, match=r"offloads 3 block outputs, .* to page-locked host memory .* About "
                                               r"1024 tokens per sequence would fit"):
        reserve_offload(forward, on_cuda, store, (BATCH, 4096))
    assert store.offload_arena.capacity == 0 and store.offload_arena.allocations == 0
    monkeypatch.setattr(host_fit, "host_ram_available", lambda: None)  # unreadable: not refused (nor checked)
    off = types.SimpleNamespace(**{**vars(on_cuda), "offload_boundaries": False})
    reserve_offload(forward, off, store, (BATCH, 4096))  # nothing offloaded: nothing to reserve
    assert store.offload_arena.capacity == 0
