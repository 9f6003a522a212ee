"""Residency: hand loads to the runtime and evict every loaded tensor right after its last use.

Each ``poros.load`` becomes a call of the graph's ``GraphRuntime.load`` (ledger, resident cache for
``stream=False``). With streaming on, the loads of one prefetch group (the consecutive loads the
prefetch pass numbered alike) first get one ``load_group`` node that copies all their host tensors
in one device buffer (one copy per contiguous host range, one copy-done event), and each load takes
its tensor from it (``options={"group_copies": False}``: each load copies its own tensor, the
runtime before grouping, kept to measure the two side by side). An evict (``GraphRuntime.book_evict``,
which books the tensor out of the ledger; its memory goes with its last reference) follows the last
reader of the loaded tensor and of every view of it, and the pass checks the structural promise:
nothing computed from loaded tensors alone (a view, a cast, a dequantized weight) leaves the forward
graph, so the backward can only get base weights by loading them again. On CUDA, where loads run on the copy stream, a ``wait`` goes right before the
first reader, and every reader takes the tensor from it.

Before (forward graph)::

    load = poros.load(primals_3, cuda)
    t = aten.t(load)
    mm = aten.mm(view, t)
    add = aten.add(mm, ...)

After (CUDA; on the CPU there is no wait and ``t`` reads ``load``)::

    load_group = runtime.load_group([primals_3, primals_4, ...], cuda, 1)   # the group's one copy
    load = runtime.load(primals_3, cuda, 1, False, load_group, 0)
    wait = runtime.wait(load)              # compute stream waits for the group's copy
    t = aten.t(wait)
    mm = aten.mm(view, t)
    book_evict = runtime.book_evict(load)  # load and t are dead from here: booked out of the ledger
    add = aten.add(mm, ...)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from poros_fx.errors import PorosExactnessError
from poros_fx.compiler.ops import LOAD
from poros_fx.compiler.schedule import Evict, Schedule

from .block_partition import BLOCK
from .prefetch import GROUP, move_host_views_before
from .rng import PHASE


def aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view derived from it."""
    found, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            target = user.target
            if isinstance(target, torch._ops.OpOverload) and target.is_view and user not in found:
                found.append(user)
                todo.append(user)
    return found


def computed_from_loads(graph: fx.Graph, loads: list[fx.Node]) -> list[fx.Node]:
    """Every node computed from loaded base tensors alone (``loads``, their views, and what casts,
    dequantizes or combines only those): base data in another form, never an activation."""
    found = set(loads)
    for n in graph.nodes:
        if n.op != "call_function" or n in found:
            continue
        inputs = _nodes((n.args, n.kwargs))
        if inputs and all(a in found for a in inputs):
            found.add(n)
    return [n for n in graph.nodes if n in found]


def _nodes(value: object) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def check_no_base_leaves(graph: fx.Graph, loads: list[fx.Node], phase: str) -> None:
    """The structural promise: nothing computed from loaded base tensors alone (a view, a cast, a
    dequantized weight) is an output of a streamed graph, so the backward can only get base weights by
    loading them again (a forward's outputs include what it saves for the backward)."""
    output = next(iter(graph.find_nodes(op="output")))
    leaving = [n for n in computed_from_loads(graph, loads)
               if n in output.all_input_nodes and not isinstance(n.meta.get("val"), _SCALARS)]
    if leaving:
        n = leaving[0]
        source = [ld.name for ld in loads if ld in _ancestors(n)]
        raise PorosExactnessError(f"{phase} graph hands {n.name} ({n.target}), computed from the loaded base tensor(s) "
                                  f"{', '.join(source[:4])} alone, to its output; the backward would keep base data "
                                  "on the device instead of loading it again. Dynamo splitting the step between "
                                  "the load and its use (a graph break) does this: TORCH_LOGS=graph_breaks names "
                                  "the break; remove it, or train with stream=False")


_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)  # sizes a graph may hand on


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def residency(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    phase = gm.meta[PHASE]
    runtime = schedule.runtime
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    loads = [n for n in graph.nodes if n.target is LOAD]
    if schedule.stream:
        check_no_base_leaves(graph, loads, phase)
    # the prefetch pass numbered each load's group (consecutive loads); one copy-done event per group
    groups: dict[object, list[fx.Node]] = {}
    for ld in loads:
        groups.setdefault(ld.meta.get(GROUP, ld), []).append(ld)
    last_in_group = {ld: ld is members[-1] for members in groups.values() for ld in members}
    batch_of = {}
    if schedule.stream and schedule.options.group_copies:
        for members in groups.values():
            batch = _group_copy(graph, runtime, members)
            batch_of.update((ld, (batch, i)) for i, ld in enumerate(members))
    for ld in loads:
        host, device = ld.args
        block = ld.meta[BLOCK]
        weight, _ = schedule.load_source(ld)
        ld.target = runtime.load
        ld.args = (host, device, block, last_in_group[ld], *batch_of.get(ld, ()))
        if not schedule.stream:
            continue
        group = aliases(ld)
        last = max((u for a in group for u in a.users), key=position.__getitem__)
        first = min(ld.users, key=position.__getitem__)
        with graph.inserting_after(last):
            ev = graph.call_function(runtime.book_evict, (ld,))
        ev.meta[BLOCK] = block
        if runtime.overlap:
            with graph.inserting_before(first):
                wait = graph.call_function(runtime.wait, (ld,))
            wait.meta[BLOCK] = block
            ld.replace_all_uses_with(wait, delete_user_cb=lambda user: user not in (wait, ev))
        schedule.evicts.append(Evict(phase=phase, block=block, weight=weight, after_node=last.name))
    graph.lint()
    return gm  # the backend generates the code once, after the last pass


def _group_copy(graph: fx.Graph, runtime: object, members: list[fx.Node]) -> fx.Node:
    """A ``load_group`` node right before the group's first load, reading every member's host tensor
    (a head chunk's host is a slice: its slice nodes move up with it)."""
    first = members[0]
    position = {n: i for i, n in enumerate(graph.nodes)}
    for ld in members[1:]:
        move_host_views_before(ld, first, position)
    with graph.inserting_before(first):
        batch = graph.call_function(runtime.load_group, ([ld.args[0] for ld in members], first.args[1],
                                                         first.meta[BLOCK]))
    batch.meta[BLOCK] = first.meta[BLOCK]
    return batch
