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
then its per-micro-batch nodes for micro-batch 0, 1, ... N-1, then its evicts. Each of the three is a
small ``fx.GraphModule`` of its own (copies of the graph's nodes, boxed like the graph itself) whose
inputs are the values it reads from earlier parts and whose outputs are the values later parts read;
``Lockstep.readable()`` prints them and the dumps write it (``NN_lockstep_<phase>.py``). Values are
freed at their last use (a micro-batch's value after its last reader in that micro-batch, a shared
value after the segment of its last reader), so memory holds what the single-micro-batch graph holds,
plus one set of boundary values per micro-batch.

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
    book_evict = book_evict(load)                         # evict: ends segment 0
    run_and_save_rng_state_1 = ..._region_r0_forward([getitem_1, ..., load_1], ...)
    book_evict_1 = book_evict(load_1)                     # ends segment 1

runs as: segment 0: the two loads; gather, region 0 for micro-batch 0, then for micro-batch 1 ...;
evict. Segment 1: region 1 for micro-batch 0, 1, ...; evict. Segment 0's per-micro-batch part, as
the dump prints it::

    class segment_0_per_micro_batch(torch.nn.Module):
        def forward(self, args_list):
            args_iter = iter(args_list)
            primals_2 = next(args_iter)   # shared: the embedding table
            primals_1 = next(args_iter)   # this micro-batch's input_ids (taken: nothing later reads it)
            load = next(args_iter)        # shared: the loaded block
            args_list.clear()
            gather = poros_gather(primals_2, primals_1, cpu);  primals_1 = None
            run_and_save_rng_state = ..._region_r0_forward([gather, ..., load], ...)
            getitem = run_and_save_rng_state[0]
            return (getitem, ...)         # what segment 1 reads for this micro-batch
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

SHARED, PER_MICRO_BATCH, EVICT = "shared", "per_micro_batch", "evict"
SHARED_SLOTS, BATCH_SLOTS, REDUCED = "s", "v", "r"  # where a part's inputs come from and its outputs go


@dataclasses.dataclass(frozen=True)
class Part:
    """Some nodes of the graph as a graph of their own: ``inputs`` (where each input is read: shared or
    this micro-batch's slots, and whether the read takes it out of the slot, its last reader) and
    ``outputs`` (the slot each output goes to, or ``REDUCED`` and the output position it is summed into)."""

    gm: fx.GraphModule
    inputs: tuple[tuple[str, int, bool], ...]
    outputs: tuple[tuple[str, int], ...]

    def run(self, shared: list, values: list | None, add: Callable[[int, Any], None] | None) -> None:
        args = []
        for space, slot, take in self.inputs:
            held = shared if space == SHARED_SLOTS else values
            args.append(held[slot])
            if take:
                held[slot] = None
        results = self.gm.forward(args)  # boxed: frees each input at its last use; no nn.Module call overhead
        for (space, slot), value in zip(self.outputs, results):
            if space == REDUCED:
                add(slot, value)
            elif space == SHARED_SLOTS:
                shared[slot] = value
            else:
                values[slot] = value
        del results


@dataclasses.dataclass(frozen=True)
class Segment:
    shared: Part | None  # its shared nodes: run once
    body: Part | None  # its per-micro-batch nodes: run for each micro-batch
    evicts: Part | None  # its evicts: run once, after the last micro-batch
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
        # summed as soon as its micro-batch's segment made it)
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
        segment_of[output] = len(groups)  # after every segment
        reduce_at: dict[fx.Node, list[int]] = {}
        if reduce:
            for p, value in enumerate(self.outputs):
                if isinstance(value, fx.Node):
                    reduce_at.setdefault(value, []).append(p)
                elif value is not None:
                    raise ValueError(f"output {p} of a reduced graph is {value!r}, not a tensor or None")
        # a per-micro-batch input nobody reads (or that is only summed) is never kept
        self.unread_inputs = frozenset(slot for slot, _, per in self.inputs if per and nodes[slot] not in last
                                       and nodes[slot] not in reduce_at)

        def last_read_in(node: fx.Node, k: int) -> bool:
            return node not in last or segment_of[nodes[last[node]]] == k

        def part(name: str, group: list[fx.Node], extra_inputs: Sequence[fx.Node], k: int) -> Part | None:
            """``group`` as a boxed graph module; ``extra_inputs``: values it only passes on (summed)."""
            produced = set(group)
            reduced = [(n, p) for n in (*group, *extra_inputs) for p in reduce_at.get(n, ())] if name == "body" else []
            kept = [n for n in group if n in last and segment_of[nodes[last[n]]] > k] if name == "body" else \
                [n for n in group if n in last]
            if not group and not reduced:
                return None
            g = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            inputs: list[tuple[str, int, bool]] = []

            def read(a: fx.Node) -> fx.Node:
                if a not in env:
                    env[a] = g.placeholder(a.name)
                    per = self.kind[a] == PER_MICRO_BATCH
                    inputs.append((BATCH_SLOTS if per else SHARED_SLOTS, self.slot[a], per and last_read_in(a, k)))
                return env[a]

            for n in group:
                for a in n.all_input_nodes:
                    if a not in produced:
                        read(a)
                env[n] = g.node_copy(n, lambda a: env[a])
            outputs = [(SHARED_SLOTS if self.kind[n] != PER_MICRO_BATCH else BATCH_SLOTS, self.slot[n]) for n in kept]
            results = [env[n] for n in kept]
            for n, p in reduced:
                results.append(env[n] if n in env else read(n))
                outputs.append((REDUCED, p))
            g.output(tuple(results))
            g.set_codegen(_BoxedCodeGen())
            return Part(fx.GraphModule(gm, g, class_name=f"segment_{k}_{name}"), tuple(inputs), tuple(outputs))

        self.segments: list[Segment] = []
        for k, group in enumerate(groups):
            body_nodes = [n for n in group if self.kind[n] == PER_MICRO_BATCH]
            # shared values and inputs made before the body that are outputs: summed for every micro-batch
            passed = [n for n in (*(n for n in nodes if n.op == "placeholder" and k == 0), *group)
                      if n in reduce_at and n not in body_nodes]
            # shared values whose last reader is in this segment (a value the output keeps is never freed)
            frees = tuple(self.slot[a] for a in nodes if self.kind.get(a) in (SHARED, EVICT) and a in last
                          and segment_of.get(nodes[last[a]]) == k)
            self.segments.append(Segment(
                shared=part("shared", [n for n in group if self.kind[n] == SHARED], (), k),
                body=part("body", body_nodes, passed, k),
                evicts=part("evicts", [n for n in group if self.kind[n] == EVICT], (), k),
                draws=any(draws(n) for n in body_nodes),
                frees=frees + tuple(self.slot[n] for n in group if self.kind[n] in (SHARED, EVICT) and n not in last),
                nodes=len(body_nodes)))

    def run(self, arg_lists: Sequence[list], *, switch: Callable[[int], None] | None = None,
            switched: Callable[[int], None] | None = None, initial: Sequence[Any] | None = None) -> list:
        """The graph on each of ``arg_lists`` (their shared positions hold the same objects): a list of
        output lists, one per micro-batch, or with ``reduce`` one list of outputs summed over them in
        list order, starting from ``initial`` (per output, or ``None``). ``switch(i)`` runs before and
        ``switched(i)`` after a segment's drawing nodes run for micro-batch ``i``. The lists are cleared."""
        shared: list[Any] = [None] * self.size
        per_batch_values: list[list[Any]] = [[None] * self.size for _ in arg_lists]
        first = arg_lists[0]
        for slot, position, per in self.inputs:
            if per:
                if slot not in self.unread_inputs:
                    for values, args in zip(per_batch_values, arg_lists):
                        values[slot] = args[position]
            else:
                shared[slot] = first[position]
        for args in arg_lists:
            args.clear()
        sums: list[Any] = list(initial) if initial is not None else [None] * len(self.outputs)

        def add(p: int, value: Any) -> None:
            sums[p] = value if sums[p] is None else sums[p] + value

        for segment in self.segments:
            if segment.shared is not None:
                segment.shared.run(shared, None, None)
            for i, values in enumerate(per_batch_values):
                if segment.draws and switch is not None:
                    switch(i)
                if segment.body is not None:
                    segment.body.run(shared, values, add)
                if segment.draws and switched is not None:
                    switched(i)
            if segment.evicts is not None:
                segment.evicts.run(shared, None, None)
            for slot in segment.frees:
                shared[slot] = None
        if self.reduce:
            return sums
        return [[self._value(x, shared, values) for x in self.outputs] for values in per_batch_values]

    def _value(self, x: Any, shared: list, values: list) -> Any:
        if isinstance(x, fx.Node):
            return (values if self.kind[x] == PER_MICRO_BATCH else shared)[self.slot[x]]
        return x

    def readable(self) -> str:
        """Every segment's graphs as readable Python (what the dumps write)."""
        out = [f"# lockstep: {len(self.segments)} segments, {'outputs summed over' if self.reduce else 'run for'} "
               "every micro-batch; per segment its shared nodes (once), its per-micro-batch nodes (for each "
               "micro-batch, in order) and its evicts (once)\n"]
        for k, segment in enumerate(self.segments):
            out.append(f"# segment {k}: {segment.nodes} per-micro-batch nodes{' (draws)' if segment.draws else ''}\n")
            for part in (segment.shared, segment.body, segment.evicts):
                if part is not None:
                    out.append(part.gm.print_readable(print_output=False, include_stride=True, include_device=True))
        return "\n".join(out)
