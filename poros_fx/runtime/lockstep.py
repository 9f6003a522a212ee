"""Lockstep: run one compiled graph on the inputs of N micro-batches together, block by block.

Block-major accumulation (``runtime/accumulate.py``) runs the step's forward graph once for all N
micro-batches of an optimizer step, and its backward graph once for all N backwards: each block's
base weights are loaded once and every micro-batch goes through them before the next block is
loaded. The graph stays the one the passes made for a single micro-batch; this module runs it N
times side by side. Its nodes are sorted into

* *shared* nodes, whose inputs are the same objects for every micro-batch (loads of host tensors,
  their waits, anything computed from parameters or constants alone): run once;
* *per-micro-batch* nodes (anything reading an activation, a saved tensor or a gradient, and every
  node that draws random numbers): run once for each micro-batch, in its own slots;
* *evicts*, which end a loaded tensor's life: run once, after the last micro-batch used it.

and cut into *segments* after each run of evicts (a block's end). A segment runs its shared nodes,
then its per-micro-batch nodes for micro-batch 0, 1, ... N-1, then its evicts. Each segment is
generated Python code, like the graph's own. Values are freed at their last use (a micro-batch's
value after its last reader in that micro-batch, a shared value after the segment of its last
reader), so memory holds what the single-micro-batch graph holds, plus one set of boundary values
per micro-batch.

The graph's per-micro-batch nodes run unchanged, in their order, for each micro-batch: micro-batch
``i`` computes the same bits as when the graph runs on its inputs alone. Random numbers are the
caller's business: ``run`` calls ``switch(i)`` / ``switched(i)`` around a segment's nodes for
micro-batch ``i`` when they draw, so the caller can give each micro-batch its own generator state.
A backward graph's outputs (gradients of parameters, the same for every micro-batch) can be summed
over the micro-batches as they are made, in micro-batch order (``reduce``), the order autograd's
gradient accumulation adds them in, without holding N sets of gradients.

A forward graph of two layer blocks (loads and evicts as the residency pass placed them)::

    load_group = load_group([primals_4], cpu, 1)          # shared
    load = load(primals_4, cpu, 1, True, load_group, 0)   # shared
    load_group_1 = load_group([primals_19], cpu, 2)       # shared (prefetch)
    load_1 = load(primals_19, cpu, 2, True, load_group_1, 0)
    gather = poros.gather(primals_2, primals_1, cpu)      # per micro-batch (primals_1: its input_ids)
    run_and_save_rng_state = ..._region_r0_forward([gather, ..., load], ...)   # per micro-batch, draws
    getitem = run_and_save_rng_state[0]
    evict = evict(load)                                   # evict: ends segment 0
    run_and_save_rng_state_1 = ..._region_r0_forward([getitem_1, ..., load_1], ...)
    evict_1 = evict(load_1)                               # ends segment 1

runs as: segment 0: the two loads; gather, region 0 for micro-batch 0, then for micro-batch 1 ...;
evict. Segment 1: region 1 for micro-batch 0, 1, ...; evict.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch.fx as fx

SHARED, PER_MICRO_BATCH, EVICT = "shared", "per_micro_batch", "evict"


@dataclasses.dataclass(frozen=True)
class Segment:
    pre: Callable[[list], None]  # its shared nodes: pre(shared)
    body: Callable[[list, list, Callable], None]  # its per-micro-batch nodes: body(shared, mine, reduce)
    post: Callable[[list], None]  # its evicts: post(shared)
    draws: bool  # the body draws random numbers
    frees: tuple[int, ...]  # shared slots dead after the segment
    nodes: int  # per-micro-batch nodes in the body (for the schedule)


class Lockstep:
    """``gm`` cut into segments, ready to run on N lists of inputs (see the module docstring).

    ``per_micro_batch``: the placeholder positions whose inputs differ between micro-batches (the
    rest are the same objects in every list). ``is_evict(node)`` tells an evict; ``draws(node)``
    whether a node takes random numbers. ``reduce``: the outputs are summed over the micro-batches
    instead of returned per micro-batch.
    """

    def __init__(self, gm: fx.GraphModule, per_micro_batch: frozenset[int], *, is_evict: Callable[[fx.Node], bool],
                 draws: Callable[[fx.Node], bool], reduce: bool = False) -> None:
        graph = gm.graph
        nodes = list(graph.nodes)
        output = next(n for n in nodes if n.op == "output")
        self.reduce = reduce
        self.slot = {n: i for i, n in enumerate(nodes)}
        self.kind: dict[fx.Node, str] = {}
        self.inputs: list[tuple[int, int, bool]] = []  # (slot, position, per micro-batch)
        consts: list[Any] = []
        position = 0
        for n in nodes:
            if n.op == "placeholder":
                self.kind[n] = PER_MICRO_BATCH if position in per_micro_batch else SHARED
                self.inputs.append((self.slot[n], position, position in per_micro_batch))
                position += 1
            elif n.op == "get_attr":
                self.kind[n] = SHARED
            elif n.op == "call_function":
                if is_evict(n):
                    if any(self.kind[a] != SHARED for a in n.all_input_nodes):
                        raise AssertionError(f"{n.name} evicts a value computed per micro-batch")
                    self.kind[n] = EVICT
                elif draws(n) or any(self.kind[a] != SHARED for a in n.all_input_nodes):
                    self.kind[n] = PER_MICRO_BATCH
                else:
                    self.kind[n] = SHARED
            elif n.op != "output":
                raise ValueError(f"lockstep runs call_function graphs; {n.name} is a {n.op}")
        self.num_inputs = position
        self.size = len(nodes)
        # the output's elements; in reduce mode the output does not keep its values alive (each is
        # summed as soon as it is made)
        self.outputs = list(output.args[0])
        order = {n: i for i, n in enumerate(nodes)}
        last = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if n is not output or not reduce:
                    last[a] = order[n]

        # segments: cut after each run of evicts
        groups: list[list[fx.Node]] = [[]]
        closing = False
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            if closing and self.kind[n] != EVICT:
                groups.append([])
            closing = self.kind[n] == EVICT
            groups[-1].append(n)
        segment_of = {n: k for k, group in enumerate(groups) for n in group}
        for n in nodes:  # inputs belong to the first segment
            if n.op == "placeholder":
                segment_of[n] = 0
        reduce_at: dict[fx.Node, list[int]] = {}
        if reduce:
            for p, value in enumerate(self.outputs):
                if isinstance(value, fx.Node):
                    reduce_at.setdefault(value, []).append(p)
                elif value is not None:
                    raise ValueError(f"output {p} of a reduced graph is {value!r}, not a tensor or None")

        def ref(node: fx.Node) -> str:
            return f"{'v' if self.kind[node] == PER_MICRO_BATCH else 's'}[{self.slot[node]}]"

        def render(value: Any) -> str:
            if isinstance(value, fx.Node):
                return ref(value)
            if isinstance(value, list):
                return "[" + ", ".join(render(x) for x in value) + "]"
            if isinstance(value, tuple):
                return "(" + "".join(render(x) + ", " for x in value) + ")"
            if value is None or isinstance(value, (bool, int, str)):
                return repr(value)
            consts.append(value)
            return f"c[{len(consts) - 1}]"

        fns: list[Any] = []

        def call(node: fx.Node) -> str:
            if node.op == "get_attr":
                consts.append(_attr(gm, node.target))
                return f"{ref(node)} = c[{len(consts) - 1}]"
            if node.target is operator.getitem and not node.kwargs:
                return f"{ref(node)} = {render(node.args[0])}[{render(node.args[1])}]"
            fns.append(node.target)
            args = [render(a) for a in node.args] + [f"{k}={render(v)}" for k, v in node.kwargs.items()]
            return f"{ref(node)} = f[{len(fns) - 1}]({', '.join(args)})"

        self.segments: list[Segment] = []
        for k, group in enumerate(groups):
            pre = [call(n) for n in group if self.kind[n] == SHARED]
            post = [call(n) for n in group if self.kind[n] == EVICT]
            body: list[str] = []
            produced_here = [n for n in nodes if n.op == "placeholder" and k == 0] + group
            for n in produced_here:  # shared values and inputs of this segment that are outputs: summed first
                if n in reduce_at and self.kind[n] != PER_MICRO_BATCH:
                    body += [f"r({p}, {ref(n)})" for p in reduce_at[n]]
            for n in produced_here:
                if n in reduce_at and self.kind[n] == PER_MICRO_BATCH and n.op == "placeholder":
                    body += [f"r({p}, {ref(n)})" for p in reduce_at[n]]
            body_nodes = [n for n in group if self.kind[n] == PER_MICRO_BATCH]
            for n in body_nodes:
                body.append(call(n))
                body += [f"r({p}, {ref(n)})" for p in reduce_at.get(n, ())]
                # per-micro-batch values whose last reader is this node: gone for this micro-batch
                for a in n.all_input_nodes:
                    if self.kind[a] == PER_MICRO_BATCH and last.get(a) == order[n]:
                        body.append(f"v[{self.slot[a]}] = None")
                if self.kind[n] == PER_MICRO_BATCH and n not in last:
                    body.append(f"v[{self.slot[n]}] = None")  # never read (or only summed)
            if k == 0:  # inputs nobody reads (or only summed)
                body += [f"v[{slot}] = None" for slot, _, mine in self.inputs
                         if mine and nodes[slot] not in last]
            # shared values whose last reader is in this segment (a value the output keeps is never freed)
            frees = tuple(self.slot[a] for a in nodes if self.kind.get(a) in (SHARED, EVICT) and a in last
                          and segment_of.get(nodes[last[a]]) == k)
            self.segments.append(Segment(
                pre=_function("pre", ["s"], pre, fns, consts), body=_function("body", ["s", "v", "r"], body, fns, consts),
                post=_function("post", ["s"], post, fns, consts), draws=any(draws(n) for n in body_nodes),
                frees=frees + tuple(self.slot[n] for n in group if self.kind[n] in (SHARED, EVICT) and n not in last),
                nodes=len(body_nodes)))
        self._collect = None if reduce else _function(
            "collect", ["s", "v"], [f"return [{', '.join(render(x) for x in self.outputs)}]"], fns, consts)

    def run(self, arg_lists: Sequence[list], *, switch: Callable[[int], None] | None = None,
            switched: Callable[[int], None] | None = None, initial: Sequence[Any] | None = None) -> list:
        """The graph on each of ``arg_lists`` (their shared positions hold the same objects): a list of
        output lists, one per micro-batch, or with ``reduce`` one list of outputs summed over them in
        list order, starting from ``initial`` (per output, or ``None``). ``switch(i)`` runs before and
        ``switched(i)`` after a segment's drawing nodes run for micro-batch ``i``. The lists are cleared."""
        shared: list[Any] = [None] * self.size
        mine: list[list[Any]] = [[None] * self.size for _ in arg_lists]
        first = arg_lists[0]
        for slot, position, per in self.inputs:
            if per:
                for values, args in zip(mine, arg_lists):
                    values[slot] = args[position]
            else:
                shared[slot] = first[position]
        for args in arg_lists:
            args.clear()
        sums: list[Any] = list(initial) if initial is not None else [None] * len(self.outputs)

        def add(p: int, value: Any) -> None:
            sums[p] = value if sums[p] is None else sums[p] + value

        for segment in self.segments:
            segment.pre(shared)
            for i, values in enumerate(mine):
                if segment.draws and switch is not None:
                    switch(i)
                segment.body(shared, values, add)
                if segment.draws and switched is not None:
                    switched(i)
            segment.post(shared)
            for slot in segment.frees:
                shared[slot] = None
        if self.reduce:
            return sums
        return [self._collect(shared, values) for values in mine]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _function(name: str, params: list[str], lines: list[str], fns: list[Any], consts: list[Any]) -> Callable:
    """``lines`` as the body of a function ``name(*params)`` that sees ``f`` (the nodes' targets) and
    ``c`` (constants)."""
    source = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines or ["pass"])
    scope: dict[str, Any] = {"f": fns, "c": consts}
    exec(compile(source, f"<poros lockstep {name}>", "exec"), scope)
    return scope[name]
