"""Load slots (``runtime/load_slots.py``): where streamed layer blocks land under CUDA graphs, on the CPU.

A slot is handed out again only once nothing over it is alive — a view of the load, or a tensor a replay
rebuilt over its storage (``cuda_graphs._on``) — and a step that loads and frees in the same order gets the
same addresses every time, which is what lets the graphs read the blocks in place. The graphs themselves
are tested on the H200 (``tests/test_gpu_cuda_graphs.py``).
"""

from __future__ import annotations

import types

import torch

import poros_fx
from poros_fx.compiler.backend import _reused_by_forward
from poros_fx.options import PorosOptions
from poros_fx.prepare import get_store
from poros_fx.runtime import budget
from poros_fx.runtime.arena import nbytes
from poros_fx.runtime.cuda_graphs import RegionGraphs
from poros_fx.runtime.executor import GraphRuntime
from poros_fx.runtime.load_slots import MAX_SLOTS, LoadSlots
from poros_fx.runtime.host_tensors import HostTensors
from poros_fx.runtime.store import HostStore
from poros_fx.models.tiny import tiny_lora_model

CPU = torch.device("cpu")


def _take(slots: LoadSlots, size: int = 64) -> torch.Tensor | None:
    """A view of a slot, as a load is (``None``: every slot of the size in use)."""
    slot = slots.take(size, lambda n: torch.empty(n, dtype=torch.uint8))
    return None if slot is None else slot[:]


def test_a_slot_stays_taken_while_any_tensor_over_it_lives():
    slots = LoadSlots()
    first = _take(slots)
    address = first.data_ptr()
    view = first[16:32].view(torch.int32)
    rebuilt = torch.empty(0, dtype=torch.int32).set_(view.untyped_storage(), 8, (2,), (1,))  # as a replay rebuilds
    del first, view
    second = _take(slots)
    assert second.data_ptr() != address  # the rebuilt tensor still reads the first slot
    del rebuilt
    assert _take(slots).data_ptr() == address  # free again: the first slot, first
    assert slots.holds(second[8:]) and not slots.holds(torch.empty(64, dtype=torch.uint8))
    assert _take(slots, size=128).data_ptr() not in (address, second.data_ptr())  # a size of its own
    assert slots.as_dict() == {"slots": 3, "bytes": 2 * 64 + 128, "takes": 4, "overflows": 0}


def test_more_loads_alive_than_max_slots_are_ordinary_allocations():
    slots = LoadSlots()
    alive = [_take(slots) for _ in range(MAX_SLOTS)]
    assert len({t.data_ptr() for t in alive}) == MAX_SLOTS
    assert _take(slots) is None and slots.overflows == 1
    alive.pop()
    assert _take(slots) is not None


def _graphed_runtime(model: torch.nn.Module) -> tuple[GraphRuntime, HostStore]:
    """A forward runtime of ``model``'s store as a graph with ``options={"cuda_graphs": True}`` has it (the
    graphs' backend is never asked to capture: only the loads are driven)."""
    store = get_store(model)
    store.residency.region_graphs = RegionGraphs(CPU, backend=object())
    schedule = types.SimpleNamespace(options=types.SimpleNamespace(cuda_graphs=True, block_major=False))
    return GraphRuntime(store, stream=True, phase="forward", schedule=schedule, training=True), store


def test_streamed_layer_blocks_land_at_the_same_addresses_every_step():
    """Four layers loaded two ahead, each dropped after its use: every step the same slot addresses, the
    blocks' own bytes, never a slot another live load holds; the head is an ordinary allocation."""
    model = tiny_lora_model("qwen2", layers=4, nf4=True)
    poros_fx.prepare(model, device="cpu")
    runtime, store = _graphed_runtime(model)
    names = store.host.block_names
    hosts = {b: [e.host for e in store.host.tensors() if e.blocks == (b,)] for b in range(len(names))}
    layers = [b for b in range(len(names)) if names[b].startswith("layers")]
    head = names.index("head")

    def step() -> dict[int, int]:
        addresses, live = {}, []
        for b in layers:
            group = runtime.load_group(hosts[b], CPU, b)
            assert all(torch.equal(h, d) for h, d in zip(hosts[b], group))
            assert all(runtime.is_resident(d) for d in group)
            addresses[b] = group[0].untyped_storage().data_ptr()
            assert addresses[b] not in {g[0].untyped_storage().data_ptr() for g in live}
            live.append(group)
            if len(live) > 2:
                live.pop(0)
        out = runtime.load_group(hosts[head], CPU, head)
        assert not any(runtime.is_resident(d) for d in out)
        return addresses

    first = step()
    assert len(set(first.values())) == 3  # two ahead and the one in use
    assert step() == first and step() == first
    assert store.residency.region_graphs.load_slots.as_dict()["slots"] == 3


def test_the_budget_counts_the_slots_and_the_copies_in_them_once():
    """Between steps the slots (and a backward's copies left in them for the next forward) are the step's
    loads, not what stays allocated: ``fit`` subtracts them once, and a copy outside a slot once."""
    store = HostStore(device=torch.device("cuda"), prefetch=2, family=None,
                      host=HostTensors(block_size=1, block_names=["layers.0"]))
    slots = LoadSlots()
    store.residency.region_graphs = types.SimpleNamespace(load_slots=slots)
    in_slot, other = _take(slots, 256), torch.empty(100, dtype=torch.uint8)
    store.residency.copies_for_forward = {(1,): [in_slot[:128]], (2,): [other]}
    assert budget._load_window(store) == 256 + nbytes(other)
    store.residency.region_graphs = None
    assert budget._load_window(store) == 128 + nbytes(other)


def test_with_cuda_graphs_a_backward_leaves_the_forwards_whole_first_window():
    """Two blocks ahead, the next forward starts holding three layer blocks (the one computing and two
    loading): without graphs a backward leaves the first two (a third would sit in memory through the
    optimizer step); with graphs the load slots hold all three between steps anyway, so it leaves three."""
    blocks = {"blocks": list(range(8)), "stream": True, "prefetch": 2}
    plain = types.SimpleNamespace(**blocks, options=PorosOptions())
    graphed = types.SimpleNamespace(**blocks, options=PorosOptions(cuda_graphs=True))
    assert _reused_by_forward(plain) == {1, 2}
    assert _reused_by_forward(graphed) == {1, 2, 3}
    assert _reused_by_forward(types.SimpleNamespace(**blocks, options=PorosOptions(cuda_graphs=True,
                                                                                    turnaround=False))) == set()
