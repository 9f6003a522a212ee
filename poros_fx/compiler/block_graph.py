"""The block graph: blocks and the values that cross between them, as a ``networkx`` DAG.

A step's blocks (embed, layer blocks, head) are the DAG's nodes; an edge ``a -> b`` carries the forward
values block ``a`` computes and block ``b`` reads. A plain decoder is a chain (one hidden state from each
block to the next). State that crosses layers outside the hidden state adds edges: Gemma 4's per-layer
inputs go from the embed block to every layer, its stored keys and values from the layer that computes
them to each KV-shared layer that reads them::

    embed -> layers.0 -> layers.1 -> layers.2 -> layers.3 -> head      (hidden states)
    embed -> layers.0 .. layers.3                                       (per-layer inputs)
    layers.0 -> layers.2,  layers.1 -> layers.3                         (shared keys and values)

From it come the load order (a topological order: a block runs after every block it reads from; the
backward in reverse), each crossing value's liveness (the partitioner saves it: it lives from its
block's forward until the backward of the first block that reads it, where that block is recomputed
from it) and the bytes those saved values hold at the step's worst point — the boundary part of
``check``'s memory estimate. ``Schedule.table`` lists the edges a chain does not have; the dumps draw
the graph (``timeline.draw_block_graph``).

Positions: the forward runs blocks ``0..n-1`` (position ``k``), the backward runs them in reverse
(block ``k`` at position ``2n - 1 - k``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import networkx as nx

from ..errors import PorosConfigError


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A forward value of block ``producer`` read by the later blocks ``consumers``."""

    name: str
    producer: int
    consumers: tuple[int, ...]
    nbytes: int

    def live(self, num_blocks: int) -> tuple[int, int]:
        """(first, last) position it is held: from its block's forward to the backward of its first
        reader (whose recompute takes it)."""
        return self.producer, 2 * num_blocks - 1 - min(self.consumers)


def build(names: Sequence[str], crossings: Iterable[Crossing], nbytes: Sequence[int] | None = None) -> nx.DiGraph:
    """The DAG of blocks ``names`` (index order is run order) with ``crossings`` on its edges."""
    crossings = list(crossings)
    graph = nx.DiGraph()
    for i, name in enumerate(names):
        graph.add_node(i, name=name, nbytes=nbytes[i] if nbytes is not None else 0)
    for c in crossings:
        for consumer in c.consumers:
            if consumer <= c.producer:
                raise PorosConfigError(f"block {names[consumer]} reads {c.name} of the later block {names[c.producer]}: "
                                       "blocks must form a DAG in run order")
            if not graph.has_edge(c.producer, consumer):
                graph.add_edge(c.producer, consumer, values=[])
            graph.edges[c.producer, consumer]["values"].append(c)
    graph.graph["crossings"] = crossings
    return graph


def crossings(graph: nx.DiGraph) -> list[Crossing]:
    return list(graph.graph.get("crossings", []))


def load_order(graph: nx.DiGraph) -> list[int]:
    """The forward's block order: topological, ties by index (a chain: 0, 1, ..., head)."""
    if not nx.is_directed_acyclic_graph(graph):
        raise PorosConfigError("the blocks' data flow has a cycle; poros-fx streams blocks in one order")
    return list(nx.lexicographical_topological_sort(graph))


def is_chain(graph: nx.DiGraph) -> bool:
    return all(b == a + 1 for a, b in graph.edges)


def extra_edges(graph: nx.DiGraph) -> list[tuple[int, int]]:
    """The edges a chain does not have (state that skips blocks)."""
    return sorted((a, b) for a, b in graph.edges if b != a + 1)


def live_bytes(graph: nx.DiGraph) -> list[int]:
    """Bytes of saved crossing values held at each position of the step (forward, then backward)."""
    n = graph.number_of_nodes()
    held = [0] * (2 * n)
    for c in crossings(graph):
        first, last = c.live(n)
        for p in range(first, last + 1):
            held[p] += c.nbytes
    return held


def peak_live_bytes(graph: nx.DiGraph) -> int:
    """The most the saved crossing values hold at once (a chain: at the end of the forward, every block
    output)."""
    return max(live_bytes(graph), default=0)


def describe(graph: nx.DiGraph) -> str:
    """Lines for ``schedule.txt``: the shape of the DAG, each value that skips blocks or feeds several
    (with its liveness) and the peak of what the saved crossing values hold."""
    names = nx.get_node_attributes(graph, "name")
    n = graph.number_of_nodes()
    extra = extra_edges(graph)
    head = (f"block graph: {n} blocks, {graph.number_of_edges()} edges, "
            + ("a chain" if not extra else f"a DAG ({len(extra)} edges beyond the chain)")
            + f"; load order {' '.join(names[i] for i in load_order(graph))}"
            + f"; saved crossing values peak at {peak_live_bytes(graph)} bytes\n")
    lines = []
    for c in crossings(graph):
        if c.consumers == (c.producer + 1,):
            continue  # a chain's edge: the block's output to the next block
        first, last = c.live(n)
        readers = ", ".join(names[i] for i in c.consumers) if len(c.consumers) <= 4 else \
            f"{names[c.consumers[0]]} .. {names[c.consumers[-1]]} ({len(c.consumers)} blocks)"
        lines.append(f"  {c.name} ({c.nbytes} bytes): {names[c.producer]} -> {readers}; held from {names[c.producer]}'s "
                     f"forward to {names[min(c.consumers)]}'s backward (positions {first}..{last})\n")
    return head + "".join(lines)


def from_joint(gm: Any, names: Sequence[str], nbytes: Sequence[int], block_key: str, forward_key: str) -> nx.DiGraph:
    """The DAG of a joint graph whose nodes carry their block (``block_key``) and phase (``forward_key``):
    every forward value read by a forward node of another block is a crossing (its bytes from the fake
    value; a value a region hands to several later blocks is one crossing)."""
    import torch

    by_root: dict[Any, set[int]] = {}
    for node in gm.graph.nodes:
        if not node.meta.get(forward_key) or block_key not in node.meta:
            continue
        consumers = {u.meta[block_key] for u in node.users
                     if u.meta.get(forward_key) and u.meta.get(block_key, node.meta[block_key]) > node.meta[block_key]}
        if not consumers:
            continue
        root = node  # a view crossing blocks holds its base (per_layer_inputs[:, :, i] holds per_layer_inputs)
        while (isinstance(root.target, torch._ops.OpOverload) and root.target.is_view and root.args
               and hasattr(root.args[0], "meta") and block_key in root.args[0].meta):
            root = root.args[0]
        by_root.setdefault(root, set()).update(c for c in consumers if c > root.meta[block_key])
    found = [Crossing(root.name, root.meta[block_key], tuple(sorted(consumers)), _bytes(root.meta.get("val")))
             for root, consumers in by_root.items() if consumers]
    return build(names, found, nbytes)


def _bytes(val: Any) -> int:
    import torch

    if isinstance(val, torch.Tensor):
        numel = val.numel()
        if not isinstance(numel, int):  # a symbolic size: the size it was traced with
            numel = getattr(getattr(numel, "node", None), "hint", None) or 0
        return int(numel) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0
