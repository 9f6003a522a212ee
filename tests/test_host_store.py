"""The host store's arena and the embedding row gather (CPU); the pinned/copy-stream side is in test_gpu_parity."""

import pytest
import torch
import torch.nn.functional as F

import poros_fx
from poros_fx import ops
from poros_fx.prepare import get_store
from poros_fx.runtime.arena import ALIGN, HostArena, aligned
from poros_fx.runtime.budget import BudgetState
from poros_fx.runtime.host_tensors import HostTensors
from poros_fx.runtime.store import HostStore
from poros_fx.models.tiny import tiny_lora_model


@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_every_base_tensor_is_a_view_of_one_exact_size_arena(nf4):
    model = tiny_lora_model("qwen2", layers=2, nf4=nf4)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    poros_fx.prepare(model, device="cpu")
    store = get_store(model)
    arena = store.host.arena
    start, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.capacity
    spans = []
    for entry in store.host.tensors():
        assert start <= entry.host.data_ptr() and entry.host.data_ptr() + entry.nbytes <= end, entry.name
        assert entry.host.data_ptr() % ALIGN == 0
        spans.append((entry.host.data_ptr(), entry.host.data_ptr() + entry.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "no two tensors overlap"
    # exact size: the base's bytes, plus at most the alignment padding of each tensor
    assert arena.used == arena.capacity == sum(aligned(e.nbytes) for e in store.host.tensors())
    assert store.host.host_bytes() <= arena.capacity < store.host.host_bytes() + ALIGN * len(store.host.entries)
    s = poros_fx.stats(model)
    assert s["pinned_host_bytes"] == 0 and not s["pinned"]  # a CPU compute device pins nothing
    poros_fx.unprepare(model)
    after = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    if not nf4:  # (an NF4 model's frozen names change under prepare; test_parity round-trips it)
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_arena_refuses_more_than_it_counted():
    arena = HostArena(aligned(16))
    arena.place(torch.ones(4))
    with pytest.raises(AssertionError, match="arena full"):
        arena.place(torch.ones(1))


def test_gather_is_the_embedding_lookup():
    table = torch.randn(50, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[3, 3, 49, 0], [7, 1, 2, 3]])
    rows = ops.gather(table, ids, torch.device("cpu"))
    assert torch.equal(rows, F.embedding(ids, table))
    assert rows.data_ptr() != table.data_ptr()


def test_embedding_gathers_rows_inside_the_compiled_graph():
    model = tiny_lora_model("llama", layers=2)
    poros_fx.prepare(model, device="cpu")
    step_model = torch.compile(model, backend="poros")
    ids = torch.randint(0, 256, (2, 16))
    step_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    (schedule,) = get_store(model).schedules
    fw = schedule.graphs["forward"]
    gathers = [n for n in fw.graph.nodes if n.target is ops.GATHER]
    assert len(gathers) == 1 and gathers[0].meta["poros_block"] == 0
    assert not any(ld.block == 0 for ld in schedule.loads), "the embed block loads no table"


@pytest.mark.parametrize("prefetch", [0, 1])
def test_chunked_head_is_exact_and_never_resident_whole(prefetch):
    """A head loaded in row chunks: streamed == stream=False on every surface, each chunk its own
    prefetch group, and the whole lm_head weight never on the device at once."""
    from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
    from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

    config = tiny_config("qwen2", layers=2, vocab=4096)  # a head 4x larger than a layer, as at 32B-72B
    batches = demo_batches(4, vocab=4096, seq=16)
    runs = {}
    for stream in (True, False):
        torch._dynamo.reset()
        model = lora_model(config, dropout=0.1)
        poros_fx.prepare(model, device="cpu", prefetch=prefetch, head_chunks=4)
        runs[stream] = train(model, torch.compile(model, backend="poros", options={"stream": stream}), batches,
                             accumulate=2)
        if stream:
            store = get_store(model)
            s = poros_fx.stats(model)
            head_weight = model.get_base_model().lm_head.weight
            head_bytes = head_weight.numel() * head_weight.element_size()
            (schedule,) = store.schedules
            chunk_loads = [ld for ld in schedule.loads if "lm_head.weight[rows" in ld.weight]
            assert len(chunk_loads) == 8 and {ld.nbytes for ld in chunk_loads} == {head_bytes // 4}  # 4 fw + 4 bw
            assert s["head_chunks"] == 4 and s["peak_resident_base_bytes"] < head_bytes
            assert s["peak_resident_base_bytes"] <= (1 + prefetch) * max(max(s["block_bytes"][1:-1]), head_bytes // 4 + 4096)
    diffs = compare(runs[True], runs[False])
    assert diffs == {k: 0.0 for k in SURFACES}, format_diffs("chunked head: streamed vs stream=False", diffs)


def test_head_chunks_is_automatic_above_512_mib():
    from poros_fx.prepare import head_chunk_count

    assert head_chunk_count(272 * 2**20, 151936) == 1  # Qwen2.5-0.5B's tied head: whole
    assert head_chunk_count(1557 * 2**20, 152064) == 7  # 32B: 1.56 GB in chunks of <= 256 MiB
    assert head_chunk_count(10, 5, requested=9) == 5
    with pytest.raises(poros_fx.PorosConfigError, match="head_chunks"):
        head_chunk_count(10, 5, requested=0)


def test_host_runs_merge_neighbours_of_one_storage_only():
    from poros_fx.runtime.copies import RUN_GAP, host_runs

    arena = HostArena(3 * RUN_GAP)
    a = arena.place(torch.arange(100, dtype=torch.float32))
    b = arena.place(torch.arange(7, dtype=torch.int8))  # 512 B after a: the same range
    arena.reserve((RUN_GAP + ALIGN,), torch.uint8)  # a hole wider than RUN_GAP: a new range
    c = arena.place(torch.ones(3, dtype=torch.bfloat16))
    other = torch.zeros(4)  # another storage
    strided = torch.arange(12.0).view(3, 4).t()
    runs = host_runs([c, other, b, strided, a])
    members = sorted(sorted(r[3]) for r in runs)
    assert sorted(members) == sorted([[2, 4], [0], [1], [3]])
    merged = next(r for r in runs if sorted(r[3]) == [2, 4])
    assert merged[1] == a.data_ptr() and merged[2] == b.data_ptr() + 7


def test_a_block_is_one_copy_and_the_group_views_keep_host_alignment():
    from poros_fx.runtime.executor import GraphRuntime

    model = tiny_lora_model("qwen2", layers=2, nf4=True)
    poros_fx.prepare(model, device="cpu")
    store = get_store(model)
    hosts = [e.host for e in store.host.tensors() if e.blocks == (1,)]
    runtime = GraphRuntime(store, stream=True, phase="forward")
    out = runtime.load_group(hosts, torch.device("cpu"), 1)
    assert store.residency.ledger.copies == 1  # the arena keeps a block's tensors side by side
    for h, d in zip(hosts, out):
        assert torch.equal(h, d) and d.dtype == h.dtype and d.data_ptr() % ALIGN == h.data_ptr() % ALIGN
    assert len({d.untyped_storage().data_ptr() for d in out}) == 1
    # the layout is planned once per group; a later load of the group is a fresh buffer, same values
    again = runtime.load_group(hosts, torch.device("cpu"), 1)
    assert len(runtime._plans) == 1 and store.residency.ledger.copies == 2
    assert all(torch.equal(a, d) and a.data_ptr() != d.data_ptr() for a, d in zip(again, out))
    runtime.load_group(hosts[:2], torch.device("cpu"), 1)
    assert len(runtime._plans) == 2
    # compiled, each layer traced into the step's graph (a region takes a block as one flat tensor): one copy per
    # group of many tensors (forward: embed's table is gathered, layers, head; backward: head, layers)
    poros_fx.unprepare(model)
    poros_fx.prepare(model, device="cpu", regions=False)
    compiled = torch.compile(model, backend="poros", options={"turnaround": False})  # every block twice
    batch = {"input_ids": torch.randint(0, 256, (1, 16)), "labels": torch.randint(0, 256, (1, 16))}
    poros_fx.stats(model, reset=True)
    compiled(**batch).loss.backward()
    s = poros_fx.stats(model)
    assert s["copies"] == 2 * (len(s["block_names"]) - 1) and s["loads"] > 10 * s["copies"]


def test_per_tensor_copies_train_exactly_like_block_copies():
    """``group_copies=False`` (a copy per tensor, for A/B measurements) and the default (a copy per
    block) are the same computation: two independent NF4 runs, equal on every surface."""
    from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
    from poros_fx.models.tiny import demo_batches

    batches = demo_batches(4, seq=16)
    runs, counts = {}, {}
    for group_copies in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_lora_model("qwen2", layers=2, nf4=True, dtype=torch.bfloat16)
        # layers inline: every host tensor is a load of its own (a region loads its layer's block whole)
        poros_fx.prepare(model, device="cpu", regions=False)
        compiled = torch.compile(model, backend="poros", options={"group_copies": group_copies, "turnaround": False})
        runs[group_copies] = train(model, compiled, batches, accumulate=2)
        s = poros_fx.stats(model)
        counts[group_copies] = (s["loads"], s["copies"])
    diffs = compare(runs[True], runs[False])
    assert diffs == {k: 0.0 for k in SURFACES}, format_diffs("block copies vs tensor copies", diffs)
    assert counts[False][0] == counts[False][1] == counts[True][0] > 10 * counts[True][1]


def test_a_region_loads_its_layer_as_one_block():
    """With regions, a decoder layer's host tensors (NF4 weights and quant state, norms: 37 of them) are
    one load of the arena range that holds them side by side, and the region sees each as a view."""
    from poros_fx.models.tiny import demo_batches

    model = tiny_lora_model("qwen2", layers=2, nf4=True)
    poros_fx.prepare(model, device="cpu")
    store = get_store(model)
    blocks = [e for e in store.host.entries.values() if e.spans]
    assert [e.blocks for e in blocks] == [(1,), (2,)]
    layer_bytes = sum(e.nbytes for e in store.host.tensors() if e.blocks == (1,))
    assert layer_bytes <= blocks[0].nbytes <= layer_bytes + 512 * 37  # the tensors and their alignment gaps
    torch.compile(model, backend="poros", options={"turnaround": False})(**demo_batches(1)[0],
                                                                          use_cache=False).loss.backward()
    s = poros_fx.stats(model)
    assert s["loads"] == 2 * 2 + 2 * 2  # each layer's block, forward and recompute; the head's norm and weight too
    assert s["host_bytes"] == sum(e.nbytes for e in store.host.tensors())  # blocks are not counted twice


def test_the_store_reads_and_sets_its_parts_where_the_training_loop_and_the_benchmark_rows_use_it():
    store = HostStore(device=torch.device("cpu"), prefetch=1, family=None,
                      host=HostTensors(block_size=1, block_names=["embed", "layers.0", "head"]),
                      budget=BudgetState(memory_budget=10))
    store.host.head_chunks = 3
    assert store.head_chunks == 3 and store.block_bytes() == [0, 0, 0]
    assert store.memory_budget == 10
    store.memory_budget = None
    assert store.budget.memory_budget is None
    graphs = object()
    store.region_graphs = graphs
    assert store.residency.region_graphs is graphs and store.region_graphs is graphs
    assert store.resident_cache is store.residency.resident_cache
