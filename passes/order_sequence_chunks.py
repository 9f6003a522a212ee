"""Order sequence chunks: a region's graph runs one token chunk at a time, its recompute next to its gradient.

With ``sequence_chunks=K`` (``compiler/regions/sequence_chunks.py``) a region's MLP is ``K`` independent
calls on slices of the tokens, each recomputed in the backward. The min-cut partitioner places a
chunk's recompute before the first backward node that reads it, and a chunk's adapter gradients are
accumulated across chunks, so the backward it returns starts several chunks' recomputes before the
first chunk's gradient: their ``tokens/K x intermediate`` tensors live side by side. Inductor, free
to reorder independent nodes, computes all the chunks side by side (at seq 32768 with 8 chunks of a
7B shape, 128 live tensors, 10.3 GB, against 2.3 GB in graph order).

This pass labels every node with the chunk it belongs to (its ``poros_sequence_chunk`` annotation, or
that of all its users, or of all its labelled inputs) and sorts the graph chunk-major: the original
order, except that once a chunk's first node runs, every ready node of that chunk runs before any
node of another chunk. With the Inductor codegen, each chunk's entry slices also wait for the
previous chunk's results (``poros::after``, a copy of the slice that takes those results as
inputs), a dependency Inductor's scheduler keeps. Nothing is computed differently: the same ops on
the same values, in another order, and random ops replay their saved states.

Before (a region's backward, two chunks; ``[k]`` is the node's chunk)::

    slice_5 = aten.slice(primals_1, 1, 0, s0 // 2)           [0]
    mm_12 = aten.mm(view_19, t_13)                           [0]   # chunk 0's recompute ...
    slice_6 = aten.slice(primals_1, 1, s0 // 2, s0)          [1]
    mm_19 = aten.mm(view_32, t_22)                           [1]   # ... and chunk 1's, side by side
    mm_33 = aten.mm(slice_9, t_39)                           [1]   # chunk 1's gradient
    mm_46 = aten.mm(slice_8, t_64)                           [0]   # chunk 0's gradient

After (Inductor codegen)::

    slice_6 = aten.slice(primals_1, 1, s0 // 2, s0)          [1]
    mm_19 = aten.mm(view_32, t_22)                           [1]
    mm_33 = aten.mm(slice_9, t_39)                           [1]
    slice_5 = aten.slice(primals_1, 1, 0, s0 // 2)           [0]
    after = poros.after(slice_5, [add_25, slice_backward])  [0]   # waits for chunk 1's results
    mm_12 = aten.mm(view_19, t_13)                           [0]   # reads `after`
    mm_46 = aten.mm(slice_8, t_64)                           [0]
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Hashable
from typing import Any

import torch
import torch.fx as fx

from poros_fx.compiler.ops import AFTER
from poros_fx.compiler.regions.sequence_chunks import CHUNK
from poros_fx.compiler.schedule import Schedule

aten = torch.ops.aten
SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
SIZE = "size"  # chunk_major_order's queue of ready sizes and views


def order_sequence_chunks(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    chunk = chunk_labels(gm.graph)
    if len({c for c in chunk.values() if c is not None}) < 2:
        return gm
    _read_sizes_early(gm.graph)
    order = chunk_major_order(gm.graph, chunk)
    for before, node in zip(order, order[1:]):
        before.append(node)
    if schedule.codegen == "inductor" and not gm.graph.find_nodes(op="call_function", target=AFTER):
        _wait_for_previous_chunk(gm.graph, chunk, order)
    gm.graph.lint()
    gm.recompile()
    return gm


def chunk_labels(graph: fx.Graph) -> dict[fx.Node, Hashable | None]:
    """Each node's chunk: its annotation; else the one chunk all its users belong to, when it reads no
    other chunk (a random op whose results a chunk reads, a slice of the incoming gradient); else the
    one chunk of its labelled inputs (a node a pass added after the trace, such as the CPU dropout
    gradient, or the sum of a gradient over the chunks before and this one's part). A size computed
    in the graph (a chunk's bounds) belongs to no chunk: the next chunk reads it too."""
    sized = [n for n in graph.nodes if n.op == "call_function" and not _is_size(n)]
    chunk: dict[fx.Node, Hashable | None] = dict.fromkeys(graph.nodes)
    chunk.update({n: (n.meta.get("custom") or {}).get(CHUNK) for n in sized})
    changed = True
    while changed:
        changed = False
        for n in reversed(sized):
            if chunk[n] is None and n.users:
                users = {chunk[u] for u in n.users}
                if len(users) == 1 and None not in users and {chunk[i] for i in n.all_input_nodes} <= users | {None}:
                    chunk[n], changed = users.pop(), True
        for n in sized:
            if chunk[n] is None:
                inputs = {chunk[i] for i in n.all_input_nodes} - {None}
                if len(inputs) == 1:
                    chunk[n], changed = inputs.pop(), True
    return chunk


def chunk_major_order(graph: fx.Graph, chunk: dict[fx.Node, Hashable | None]) -> list[fx.Node]:
    """A topological order of ``graph``: the ready node that comes first in the graph, except that while
    the chunk of the last chunk node placed has a ready node, that chunk's next node, and that a chunk
    starts only once every chunk it reads from (through any path: a gradient summed over the chunks)
    has run all its nodes."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    reads = _chunks_read(graph, chunk)
    left = collections.Counter(chunk[n] for n in graph.nodes)
    waiting = {n: len(n.all_input_nodes) for n in graph.nodes}
    ready: dict[Hashable | None, list[tuple[int, fx.Node]]] = {}
    order: list[fx.Node] = []

    def release(n: fx.Node) -> None:
        # a size or a view runs as soon as it can: it costs nothing, and a chunk may wait for it
        key = SIZE if computes_nothing(n) else chunk[n]
        heapq.heappush(ready.setdefault(key, []), (position[n], n))

    for n in graph.nodes:
        if not waiting[n]:
            release(n)
    current = None
    while any(ready.values()):
        if ready.get(SIZE):
            label = SIZE
        elif current is not None and ready.get(current):
            label = current
        else:
            startable = [(heap[0][0], key) for key, heap in ready.items()
                         if heap and (key is None or not any(left[r] for r in reads.get(key, ())))]
            first = min(startable or [(heap[0][0], key) for key, heap in ready.items() if heap],
                        key=lambda item: item[0])
            label = first[1]
            if label is not None:
                current = label
        _, node = heapq.heappop(ready[label])
        order.append(node)
        left[chunk[node]] -= 1
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                release(user)
    if len(order) != len(position):
        raise AssertionError(f"order_sequence_chunks: {len(position) - len(order)} nodes never became ready")
    return order


def _read_sizes_early(graph: fx.Graph) -> None:
    """Point each ``sym_size`` at the first tensor in the graph with that size (an input, or a view of one)
    rather than at a chunk's result: a chunk's bounds are then known before any chunk runs."""
    first: dict[Any, tuple[fx.Node, int]] = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        if (n.op == "placeholder" or _is_view(n)) and isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                expr = size.node.expr if isinstance(size, torch.SymInt) else None
                if expr is not None and not expr.is_number:
                    first.setdefault(expr, (n, dim))
    position = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.find_nodes(op="call_function", target=aten.sym_size.int):
        val = n.meta.get("val")
        source = first.get(val.node.expr) if isinstance(val, torch.SymInt) else None
        if source is not None and position[source[0]] < position[n.args[0]]:
            n.args = source


def _chunks_read(graph: fx.Graph, chunk: dict[fx.Node, Hashable | None]) -> dict[Hashable, set[Hashable]]:
    """For each chunk, the other chunks whose nodes its nodes depend on (not through sizes: a size is
    known before any node runs)."""
    above: dict[fx.Node, frozenset] = {}
    reads: dict[Hashable, set[Hashable]] = collections.defaultdict(set)
    for n in graph.nodes:
        above[n] = frozenset() if _is_size(n) else \
            frozenset().union(*(above[i] | {chunk[i]} for i in n.all_input_nodes)) - {None}
        if chunk[n] is not None:
            reads[chunk[n]] |= above[n] - {chunk[n]}
    return reads


def _wait_for_previous_chunk(graph: fx.Graph, chunk: dict[fx.Node, Hashable | None], order: list[fx.Node]) -> None:
    """Give each chunk's computing nodes, where they read the chunk's entry slices (slices of a tensor from
    outside the chunk) or views of them, a copy (``poros::after``) that takes the previous chunk's results
    (what it computes for nodes outside it) as inputs."""
    position = {n: i for i, n in enumerate(order)}
    opened: list[Hashable] = []
    for n in order:
        if chunk[n] is not None and not computes_nothing(n) and chunk[n] not in opened:
            opened.append(chunk[n])
    for previous, label in zip(opened, opened[1:]):
        results = [n for n in order if chunk.get(n) == previous and not computes_nothing(n)
                   and isinstance(n.meta.get("val"), torch.Tensor) and any(chunk.get(u) != previous for u in n.users)]
        if not results:
            continue
        last = max(results, key=position.__getitem__)
        entries = [n for n in order if chunk.get(n) == label and n.target is aten.slice.Tensor
                   and isinstance(n.meta.get("val"), torch.Tensor) and chunk.get(n.args[0]) != label]
        for entry in entries:
            for source in (entry, *_views_of(entry)):
                if not isinstance(source.meta.get("val"), torch.Tensor):
                    continue
                readers = [u for u in source.users if not computes_nothing(u) and u.op != "output"]
                if not readers or any(position.get(u, len(order)) <= position[last] for u in readers):
                    continue  # read before the previous chunk ends: no order to keep
                # after the previous chunk's last result, or after the slice where it comes later (a slice of
                # a tensor the previous chunk's results lead to, such as the attention's output)
                with graph.inserting_after(max(last, source, key=lambda n: position.get(n, -1))):
                    after = graph.call_function(AFTER, (source, results))
                val = source.meta["val"]
                with val.fake_mode:
                    after.meta["val"] = val.clone()
                after.meta["custom"] = {CHUNK: label}
                chunk[after] = label
                for reader in readers:
                    reader.replace_input_with(source, after)


def _views_of(node: fx.Node) -> list[fx.Node]:
    """The views of ``node`` and of its views, in graph order."""
    found: list[fx.Node] = []
    frontier = [node]
    while frontier:
        for user in frontier.pop().users:
            if _is_view(user) and user not in found:
                found.append(user)
                frontier.append(user)
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=position.__getitem__)


def computes_nothing(n: fx.Node) -> bool:
    """A size or a view: it computes nothing and holds no memory of its own."""
    return n.op == "call_function" and (_is_size(n) or _is_view(n))


def _is_size(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), SCALARS)


def _is_view(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view
