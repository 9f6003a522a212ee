"""A region's forward in two graphs: the part its backward reads, then the rest.

Streamed, the step's backward runs each layer's region forward again for the tensors the region's
backward reads (its saved tensors); the layer's outputs are not read there (the next layer's input
was saved). With ``sequence_chunks`` the region saves its MLP's input and its backward recomputes each
MLP chunk (``sequence_chunks.py``), so in that rerun the MLP's forward (gate, up and down matmuls:
most of a layer's matmul work) only makes the layer's output, which nothing reads. ``split_forward``
cuts the forward graph in two: ``saved_part`` computes the saved tensors and what ``rest`` reads of
its values, ``rest`` the layer's outputs. The forward runs both, one after the other; the rerun runs
``saved_part`` alone. Forward, rerun and ``stream=False`` run the same two compiled graphs, so they
compute the same bits.

A random op whose generator state the backward reads but whose result only ``rest`` reads (a dropout
inside a recomputed chunk, ``run_and_save_rng_state``) draws in ``saved_part`` on an uninitialised
tensor of its input's sizes and dtype (what a draw takes from the generator depends on those, not on
the values) and keeps the state; ``rest`` runs the op on the real input from that state
(``run_with_rng_state``): the same mask, and the generator ends where it did.

Before (``[S]``: an ancestor of a saved tensor)::

    mul_19 = aten.mul(rsqrt_1, add_11)                                 [S]   # the MLP's input
    mm = aten.mm(view(mul_19), t)                                            # gate
    ...
    run_and_save_rng_state = run_and_save_rng_state(native_dropout, _to_copy_30, 0.1, True)
    getitem_56 = run_and_save_rng_state[0]                             [S]   # its state
    getitem_57 = run_and_save_rng_state[1]
    ...
    add_19 = aten.add(add_11, cat_6)                                         # the layer's output
    return (add_19, rsqrt_1, mul_19, getitem_56)

After::

    saved_part(...):
        mul_19 = aten.mul(rsqrt_1, add_11)
        empty = aten.empty.memory_format([1, sym_size_int, 512], dtype=torch.float32, device=cpu)
        run_and_save_rng_state = run_and_save_rng_state(native_dropout, empty, 0.1, True)
        getitem_56 = run_and_save_rng_state[0]
        return (rsqrt_1, mul_19, getitem_56, add_11)        # the saved tensors, then what rest reads
    rest(mul_19, getitem_56, add_11, ...):
        mm = aten.mm(view(mul_19), t)
        ...
        getitem_57 = run_with_rng_state(getitem_56, native_dropout, _to_copy_30, 0.1, True)
        ...
        return (add_19,)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from ...runtime.draws import is_random
from .shapes import contiguous, expression

aten = torch.ops.aten
RNG_SAVE = torch._prims.rng_prims.run_and_save_rng_state
RNG_RESTORE = torch._prims.rng_prims.run_with_rng_state
MATMUL_NAMES = ("mm.", "gemm", "matmul")  # in an op's name: aten mm/bmm/addmm/_grouped_mm, the 4-bit matmuls


@dataclasses.dataclass(frozen=True)
class ForwardParts:
    """``saved_part(*forward inputs) -> (*saved, *carried)``; ``rest(*rest_inputs) -> (*outputs,)``, where
    ``rest_inputs`` names, per placeholder of ``rest``, a forward input (``("input", i)``) or one of
    ``saved_part``'s outputs (``("part", j)``)."""

    saved_part: fx.GraphModule
    rest: fx.GraphModule
    rest_inputs: tuple[tuple[str, int], ...]
    num_saved: int


def split_forward(gm: fx.GraphModule, num_outputs: int, env: Any) -> ForwardParts | None:
    """``gm`` (a region's forward: ``num_outputs`` outputs, then the saved tensors) as ``ForwardParts``,
    or ``None`` where the rest would hold no matmul (nothing worth skipping) or the cut is not safe: an op
    writes into a tensor the other part reads, a random op of the rest draws before one of the saved part,
    or a random input's sizes cannot be read off the forward's inputs."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    saved = outs[num_outputs:]
    full, state_only = _ancestors(gm.graph, [o for o in saved if isinstance(o, fx.Node)])
    for n in gm.graph.nodes:  # an element of a result the saved part computes is taken there
        if n.target is operator.getitem and n.args[0] in full:
            full.add(n)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    rest_nodes = [n for n in gm.graph.nodes
                  if n.op in ("call_function", "get_attr") and n not in full and n not in state_only]
    if not any(any(k in str(n.target) for k in MATMUL_NAMES) for n in rest_nodes):
        return None
    if _crosses_a_write(gm.graph, full | state_only) or _draws_out_of_order(gm.graph, full | state_only):
        return None
    part = fx.Graph()
    env_part: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env_part[p] = part.node_copy(p)
    sizes = _SizeSource(part, env_part, env)
    for n in gm.graph.nodes:
        if n in full and n.op in ("call_function", "get_attr"):
            env_part[n] = part.node_copy(n, lambda a: env_part[a])
        elif n in state_only:
            args = list(n.args)
            for i, a in enumerate(args[1:], start=1):
                if isinstance(a, fx.Node):
                    empty = sizes.empty_like(a.meta.get("val"))
                    if empty is None:
                        return None
                    args[i] = empty
            env_part[n] = part.call_function(RNG_SAVE, tuple(args), dict(n.kwargs))
            env_part[n].meta = dict(n.meta)
    # what the rest reads of the saved part's values: tensors it takes as inputs; sizes and other
    # non-tensor values it computes again from those
    rest = fx.Graph()
    env_rest: dict[fx.Node, fx.Node] = {}
    rest_inputs: list[tuple[str, int]] = []
    carried: list[fx.Node] = []

    def take(a: fx.Node) -> fx.Node:
        if a in env_rest:
            return env_rest[a]
        if a.op == "placeholder":
            env_rest[a] = rest.placeholder(a.name)
            rest_inputs.append(("input", placeholders.index(a)))
        elif a in state_only:
            raise _Unsafe  # only its state and its result are read, through getitem
        elif _is_view(a):  # made again here from its base (free), with the strides it has in the whole graph
            env_rest[a] = rest.node_copy(a, take)
            return env_rest[a]
        elif isinstance(a.meta.get("val"), torch.Tensor):
            env_rest[a] = rest.placeholder(a.name)
            rest_inputs.append(("part", len(saved) + len(carried)))
            carried.append(a)
        elif a.op == "get_attr" or isinstance(a.meta.get("val"), (torch.SymInt, int, float, bool)):
            # a subgraph (a cond's branch) or a size: taken or computed again here
            env_rest[a] = rest.node_copy(a, take)
            return env_rest[a]
        else:
            raise _Unsafe
        env_rest[a].meta = dict(a.meta)
        return env_rest[a]

    try:
        for n in rest_nodes:
            source = n.args[0] if n.target is operator.getitem else None
            if source in state_only and n.args[1] == 1:  # the random op's result, drawn from the saved state
                state = next(u for u in source.users if u.target is operator.getitem and u.args[1] == 0)
                op_args = tuple(take(a) if isinstance(a, fx.Node) else a for a in source.args[1:])
                env_rest[n] = rest.call_function(RNG_RESTORE, (take(state), source.args[0], *op_args),
                                                 dict(source.kwargs))
                env_rest[n].meta = dict(n.meta)
            else:
                env_rest[n] = rest.node_copy(n, take)
        rest.output(tuple(take(o) if isinstance(o, fx.Node) else o for o in outs[:num_outputs]))
    except _Unsafe:
        return None
    part.output(tuple(env_part[o] if isinstance(o, fx.Node) else o for o in saved)
                + tuple(env_part[c] for c in carried))
    saved_gm, rest_gm = fx.GraphModule(gm, part), fx.GraphModule(gm, rest)
    saved_gm.graph.eliminate_dead_code()
    rest_gm.graph.eliminate_dead_code()
    saved_gm.recompile()
    rest_gm.recompile()
    return ForwardParts(saved_gm, rest_gm, tuple(rest_inputs), len(saved))


class _Unsafe(Exception):
    pass


def _is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a view of its input (an aten op whose result aliases it; an element of one)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and _is_view(source)
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and not schema.is_mutable and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None)


def _ancestors(graph: fx.Graph, roots: list[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes ``roots`` are computed from (``full``), and the ``run_and_save_rng_state`` calls of
    which only the generator state is read on the way (``state_only``: their inputs are not followed)."""
    full: set[fx.Node] = set()
    state_only: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in full:
            continue
        source = n.args[0] if n.target is operator.getitem and n.args else None
        if isinstance(source, fx.Node) and source.target is RNG_SAVE and n.args[1] == 0 and source not in full:
            full.add(n)
            state_only.add(source)
            continue
        full.add(n)
        state_only.discard(n)
        stack.extend(n.all_input_nodes)
    return full, state_only


def _draws_out_of_order(graph: fx.Graph, part: set[fx.Node]) -> bool:
    """Whether a random op of the rest comes before one of the saved part: run part by part, they would
    take their numbers from the generators in another order than the whole graph."""
    rest_drew = False
    for node in graph.nodes:
        if node.op != "call_function" or not (is_random(node.target) or node.target is RNG_SAVE):
            continue
        if node in part and rest_drew:
            return True
        rest_drew = rest_drew or node not in part
    return False


def _crosses_a_write(graph: fx.Graph, part: set[fx.Node]) -> bool:
    """Whether an op writes into a tensor that the other part reads or made: cut there, one part
    would read it before or after the write where the whole graph read it after or before."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node) and any((u in part) != (node in part) for u in (value, *value.users)):
                return True
    return False


class _SizeSource:
    """Uninitialised tensors of a fake value's sizes and dtype in ``graph``, their sizes read off the
    graph's inputs (``aten.sym_size.int`` of a placeholder dimension of the same expression)."""

    def __init__(self, graph: fx.Graph, mapped: dict[fx.Node, fx.Node], env: Any) -> None:
        self.graph, self.env = graph, env
        self.dims: dict[sympy.Expr, tuple[fx.Node, int]] = {}
        for original, copy in mapped.items():
            val = original.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    self.dims.setdefault(expression(env, size), (copy, d))

    def empty_like(self, val: Any) -> fx.Node | None:
        if not isinstance(val, torch.Tensor) or not contiguous([expression(self.env, d) for d in val.shape],
                                                                  [expression(self.env, d) for d in val.stride()]):
            return None
        sizes: list[Any] = []
        for size in val.shape:
            expr = expression(self.env, size)
            if expr.is_number:
                sizes.append(int(expr))
                continue
            found = self._from_symbols(expr)
            if found is None:
                return None
            sizes.append(found)
        node = self.graph.call_function(aten.empty.memory_format, (sizes,),
                                        {"dtype": val.dtype, "device": val.device})
        node.meta["val"] = val  # its sizes, dtype and device: what the draw is made of
        return node

    def _from_symbols(self, expr: sympy.Expr) -> fx.Node | int | None:
        """``expr`` (sums, products, floor divisions of input sizes) as nodes of the graph."""
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if expr in self.dims:
            placeholder, d = self.dims[expr]
            node = self.graph.call_function(aten.sym_size.int, (placeholder, d))
            node.meta["val"] = placeholder.meta["val"].shape[d] if "val" in placeholder.meta else None
            return node
        ops = {sympy.Add: operator.add, sympy.Mul: operator.mul}
        name = type(expr).__name__
        if type(expr) in ops or name == "FloorDiv":
            parts = [self._from_symbols(a) for a in expr.args]
            if any(p is None for p in parts):
                return None
            combine = operator.floordiv if name == "FloorDiv" else ops[type(expr)]
            out = parts[0]
            for p in parts[1:]:
                out = self.graph.call_function(combine, (out, p))
            return out
        return None
