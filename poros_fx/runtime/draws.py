"""Draws: where a graph's random ops are, and what they take from the generators, replayable without
running the graph. The one module that looks for random ops: the RNG pass, the region compiler and
block-major accumulation all ask it.

Block-major accumulation (``runtime/accumulate.py``) runs micro-batch 1's first layer before
micro-batch 0's second one, but each micro-batch must get the dropout masks it would have drawn in
micro-batch order, where micro-batch ``i``'s forward starts from the generator state micro-batch
``i - 1``'s forward left behind. No generator can skip ahead (the CPU's Mersenne twister has no
jump), so that state is found by making the same generator calls: a graph's *draws* are its random
ops alone, each called with inputs of the right shape, dtype and device (ones, so a probability
input is valid) and its other arguments as in the graph. How much a random op takes from its
generator depends on those, not on the values. A region compiled by Inductor draws once, the
``aten.randint.low_out`` of its seeds (``torch/_inductor/ir.py``: ``RandomSeeds``), and turns the
seeds into masks on the device; its draws are that call. Sizes may be symbolic (a region traced for
every sequence length, a step compiled for every length): a draw keeps them as expressions, and
``Draw.at`` gives the draw at a call's sizes. A random op inside a higher-order op's subgraph (a
``torch.cond`` branch) is not replayable from the outside (``Unreplayable``): block-major refuses
such a graph up front. The caller checks every replay against the real run (the states after each
micro-batch's forward must equal the replayed ones), so a draw this module gets wrong raises instead
of changing a mask.

Before (a region's forward, eager codegen), the draws taken from it::

    native_dropout = aten.native_dropout.default(mul_1, 0.1, True)     # mul_1: f32[s0, s1, 64]
    ...
    draws: [aten.native_dropout.default(ones(s0, s1, 64), 0.1, True), ...]

Inductor's forward of the same region::

    inductor_seeds_default = prims.inductor_seeds.default(7, device(type='cuda', index=0))
    draws: [aten.randint.low_out(-2**63, 2**63 - 1, [7], out=empty(7, int64, cuda:0))]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.fx as fx

SEEDED = torch.Tag.nondeterministic_seeded
# node.meta of a node that calls a compiled region: its draws (``CalledDraws``), set by passes/lower_regions.py
REGION_DRAWS = "poros_region_draws"
# node.meta of an RNG wrapper lowered by passes/lower_rng.py: "save" (forward) or "restore" (recompute)
RNG_ROLE = "poros_rng"


def is_random(target: Any) -> bool:
    """An op that takes numbers from a random generator."""
    return isinstance(target, torch._ops.OpOverload) and SEEDED in target.tags


def random_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The random ops of ``graph`` itself (not inside subgraphs)."""
    return [n for n in graph.nodes if n.op == "call_function" and is_random(n.target)]


def draws_numbers(node: fx.Node) -> bool:
    """Whether random op ``node`` takes numbers from a generator: not when its dropout probability is
    a constant 0 (an attention kernel without dropout carries the tag all the same)."""
    schema = node.target._schema
    for position, argument in enumerate(schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name,
                                                                                           argument.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def nested_random(gm: fx.GraphModule) -> list[str]:
    """Random ops that draw, inside the subgraphs ``gm``'s higher-order ops call (``torch.cond`` branches)."""
    found = []
    for name, sub in gm.named_modules():
        if sub is gm or not isinstance(sub, fx.GraphModule):
            continue
        found += [f"{n.target} in {name}" for n in random_nodes(sub.graph) if draws_numbers(n)]
    return found


def size_of(value: Any) -> Any:
    """A size as an int, or as an expression of its shape environment's symbols."""
    if isinstance(value, torch.SymInt):
        node = value.node
        expr = node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr
        return int(expr) if expr.is_Integer else expr
    return int(value)


@dataclasses.dataclass(frozen=True)
class Like:
    """A tensor of ones (zeros for integer dtypes) with this shape, stride, dtype and device."""

    shape: tuple[Any, ...]  # ints, or expressions of symbols
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self) -> torch.Tensor:
        fill = 1 if self.dtype.is_floating_point or self.dtype.is_complex else 0
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).fill_(fill)

    def at(self, values: Mapping[Any, Any]) -> "Like":
        return dataclasses.replace(self, shape=tuple(_at(s, values) for s in self.shape),
                                   stride=tuple(_at(s, values) for s in self.stride))


def _at(size: Any, values: Mapping[Any, Any]) -> Any:
    if not isinstance(size, sympy.Expr):
        return size
    out = size.xreplace({k: sympy.sympify(v) for k, v in values.items()})
    return int(out) if out.is_Integer else out


@dataclasses.dataclass(frozen=True)
class Draw:
    """One generator call, replayable: ``op(*args, **kwargs)`` with tensors made from ``Like``
    descriptions at each call."""

    op: Any
    args: tuple
    kwargs: dict
    device: torch.device  # whose generator it draws from

    def __call__(self) -> None:
        self.op(*_materialize(self.args), **_materialize(self.kwargs))

    def at(self, values: Mapping[Any, Any]) -> "Draw":
        """This draw with its symbols replaced by ``values`` (ints, or other symbols' expressions)."""
        return dataclasses.replace(self, args=_map_like(self.args, values), kwargs=_map_like(self.kwargs, values))

    def __repr__(self) -> str:
        return f"{self.op}({', '.join(map(_show, self.args))})"


@dataclasses.dataclass(frozen=True)
class Unreplayable:
    """Random numbers drawn where a replay cannot follow (inside a higher-order op's subgraph)."""

    reason: str

    def __call__(self) -> None:
        raise ValueError(self.reason)

    def at(self, values: Mapping[Any, Any]) -> "Unreplayable":
        return self


def _map_like(value: Any, values: Mapping[Any, Any]) -> Any:
    if isinstance(value, Like):
        return value.at(values)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_like(v, values) for v in value)
    if isinstance(value, dict):
        return {k: _map_like(v, values) for k, v in value.items()}
    return _at(value, values)


def _materialize(value: Any) -> Any:
    if isinstance(value, Like):
        return value.make()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    return f"ones{list(value.shape)}" if isinstance(value, Like) else repr(value)


def _describe(value: Any) -> Any:
    """A node argument as a replayable description (tensors by their metadata)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.SymInt):
            return size_of(val)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{value.name} has no tensor metadata")
        return Like(tuple(size_of(d) for d in val.shape), tuple(size_of(d) for d in val.stride()), val.dtype, val.device)
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(v) for v in value)
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, torch.SymInt):
        return size_of(value)
    return value


def _device_of(val: Any, kwargs: dict) -> torch.device:
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    if isinstance(first, torch.Tensor):
        return first.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def node_draw(node: fx.Node) -> Draw:
    """The replay of random op ``node``."""
    return op_draw(node.target, node.args, dict(node.kwargs), node.meta.get("val"))


def op_draw(op: Any, args: tuple, kwargs: dict, val: Any) -> Draw:
    """The replay of random ``op`` called with graph arguments ``args`` / ``kwargs`` (nodes or constants);
    ``val``: its result's metadata (the device it draws on)."""
    if op is torch.ops.prims.inductor_seeds.default:
        count, device = args
        return inductor_seeds(count, torch.device(device))
    if "out" in kwargs:
        raise ValueError(f"{op}: an out= random op")
    described = _describe(kwargs)
    return Draw(op, _describe(tuple(args)), described, _device_of(val, described))


def inductor_seeds(count: int, device: torch.device) -> Draw:
    """The call Inductor's compiled code makes for ``inductor_seeds(count, device)``."""
    limits = torch.iinfo(torch.int64)
    return Draw(torch.ops.aten.randint.low_out, (limits.min, limits.max, [count]),
                {"out": Like((count,), (1,), torch.int64, device)}, device)


def graph_draws(gm: fx.GraphModule) -> list[Draw | Unreplayable]:
    """Every random op of ``gm``, in order, as a replay (one that ``run_and_save_rng_state`` wraps too);
    random ops inside its subgraphs make it ``Unreplayable``."""
    nested = nested_random(gm)
    if nested:
        return [Unreplayable(f"random op {nested[0]} inside a higher-order op's subgraph (a torch.cond branch: "
                             "attention dropout on a padded batch?)")]
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch._prims.rng_prims.run_and_save_rng_state and is_random(n.args[0]):
            # a random op whose result a backward recomputes from the state saved here (sequence_chunks)
            val = n.meta.get("val")
            out.append(op_draw(n.args[0], n.args[1:], dict(n.kwargs), val[1] if isinstance(val, tuple) else None))
        elif is_random(n.target):
            out.append(node_draw(n))
    return out


def replay(draws: Sequence[Draw | Unreplayable | Callable[[], None]]) -> None:
    for draw in draws:
        draw()


# -- a compiled step's draws (the forward graph after the passes) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class CalledDraws:
    """The draws of the compiled region a node calls, in the calling graph's own symbols (the region's
    sizes bound to the node's inputs when the node was pointed at the region)."""

    draws: tuple[Draw | Unreplayable, ...]

    @classmethod
    def bound(cls, draws: Sequence[Draw | Unreplayable], symbols: Sequence[Any], values: Sequence[Any]) -> "CalledDraws":
        """``draws`` in a region's ``symbols``, at ``values`` (the calling graph's sizes: ints or SymInts)."""
        mapping = {s: size_of(v) for s, v in zip(symbols, values)}
        return cls(tuple(d.at(mapping) for d in draws))


def step_draws(gm: fx.GraphModule) -> list[Draw | Unreplayable]:
    """The draws of one micro-batch's run of a forward graph after the passes, in the graph's own
    symbols: compiled regions' draws, RNG-saving wrappers' ops, and plain random ops. A node whose
    draws cannot be replayed raises ``ValueError``."""
    out: list[Draw | Unreplayable] = []
    for n in gm.graph.nodes:
        found = node_draws(n)
        if found is not None:
            out.extend(found)
    for d in out:
        if isinstance(d, Unreplayable):
            raise ValueError(d.reason)
    return out


def node_draws(node: fx.Node) -> list[Draw | Unreplayable] | None:
    """What ``node`` draws (``None``: it draws nothing), in the graph's symbols."""
    if node.op != "call_function":
        return None
    role = node.meta.get(RNG_ROLE)
    if role == "restore":  # a recompute: it sets the state it saved and puts the current one back
        return None
    called = node.meta.get(REGION_DRAWS)
    if called is not None:
        return list(called.draws)
    if role == "save":
        op = node.args[0]
        if not is_random(op):
            raise ValueError(f"{node.name} saves the RNG state around {op}, which is neither random nor a region")
        val = node.meta.get("val")  # (the saved state, the op's result)
        return [op_draw(op, node.args[1:], dict(node.kwargs), val[1] if isinstance(val, tuple) else None)]
    if is_random(node.target):
        return [node_draw(node)]
    if isinstance(node.target, torch._ops.HigherOrderOperator) and "rng" in node.target.name():
        raise ValueError(f"{node.name} is an RNG wrapper on a device poros does not lower ({node.target.name()})")
    return None


def graph_symbols(gm: fx.GraphModule) -> Callable[[Sequence[Any]], dict[Any, int]]:
    """A function of a run's arguments that gives the values of ``gm``'s size symbols (from its int
    inputs and its tensors' sizes)."""
    reads: list[tuple[Any, int, int | None]] = []  # (symbol, argument, dimension or None for an int)
    seen: set[Any] = set()
    for position, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = p.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = size_of(val)
            if isinstance(expr, sympy.Symbol) and expr not in seen:
                seen.add(expr)
                reads.append((expr, position, None))
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                expr = size_of(size)
                if isinstance(expr, sympy.Symbol) and expr not in seen:
                    seen.add(expr)
                    reads.append((expr, position, d))

    def values(args: Sequence[Any]) -> dict[Any, int]:
        return {s: int(args[i]) if d is None else int(args[i].shape[d]) for s, i, d in reads}

    return values
