"""Symbolic shapes: one trace of a region for every sequence length and batch size.

A region is traced with its activations' sizes as symbols of a ``ShapeEnv`` of its own (every size
of 2 or more a symbol of its own, no duck sizing); the trace unifies them (``attn + mask`` makes the
mask's length the hidden states' length) and turns a size a weight fixes into its number. What is
left is the region's ``Signature``: each input's sizes and strides as expressions of the free
symbols (a batch size, a sequence length), the guards the trace added, and where each symbol can be
read. A call of the region binds the symbols (``Signature.bind``: the outer graph's fake tensors,
whose sizes are Dynamo's symbols or plain ints, or real tensors at run time) and ``Expressions``
evaluate what the region hands back at those sizes. A size the trace specializes (code that branches
on it) becomes a number in the signature: that region then matches that size only, and another size
traces another region.

A Qwen2 layer's inputs (hidden states, mask, eager's skip decision, cos, sin), before and after::

    metas:      f32[2, 16, 64]  b8[2, 1, 16, 16]  b8[]  f32[1, 16, 16]  f32[1, 16, 16]
    trace:      f32[s0, s1, s2] b8[s3, 1, s4, s5] b8[]  f32[1, s6, s7]  f32[1, s8, s9]
    signature:  f32[s3, s5, 64] b8[s3, 1, s5, s5] b8[]  f32[1, s5, 16]  f32[1, s5, 16]   (s3 >= 2, s5 >= 2)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.printers import PythonPrinter

TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def meta_of(t: torch.Tensor) -> TensorMeta:
    """Shape, stride, dtype and device of ``t``, with a symbolic size taken at its example value (the
    trace's starting point; the region's signature says which sizes it holds for)."""
    return tuple(_hint(d) for d in t.shape), tuple(_hint(d) for d in t.stride()), t.dtype, t.device


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


def new_env() -> ShapeEnv:
    """A region's own shape environment: no duck sizing (two sizes that happen to be equal stay two
    symbols until the trace relates them)."""
    return ShapeEnv(duck_shape=False)


def trace_inputs(mode: Any, metas: Sequence[TensorMeta], dynamic: Sequence[bool]) -> list[torch.Tensor]:
    """Fake tensors for a region's trace: input ``i`` with ``dynamic[i]`` gets a symbol per size >= 2
    (sizes 0 and 1 stay numbers: a size-1 batch is a region of its own) and strides that follow those
    symbols in the input's memory order; an input whose layout is not dense (a strided slice) stays
    at its numbers."""
    env = mode.shape_env
    out = []
    with mode:
        for i, (shape, stride, dtype, device) in enumerate(metas):
            sizes: list[Any] = list(shape)
            strides: list[Any] = list(stride)
            if dynamic[i] and any(v >= 2 for v in shape):
                symbolic = [_symbol(env, v, f"input{i}.size{d}") if v >= 2 else v for d, v in enumerate(shape)]
                dense = _dense_strides(shape, stride, symbolic)
                if dense is not None:
                    sizes, strides = symbolic, dense
            out.append(torch.empty_strided(sizes, strides, dtype=dtype, device=device))
    return out


def _symbol(env: ShapeEnv, value: int, name: str) -> torch.SymInt:
    from torch._dynamo.source import ConstantSource

    source = ConstantSource(name)
    symbol = env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=value, source=source)


def _dense_strides(shape: Sequence[int], stride: Sequence[int], sizes: Sequence[Any]) -> list[Any] | None:
    """Strides in terms of ``sizes`` for a tensor laid out densely in some dimension order (broadcast
    dimensions, stride 0, allowed); ``None`` when ``stride`` is not such a layout."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], -d))
    out: list[Any] = [0] * len(shape)
    expected, symbolic = 1, 1
    for d in order:
        if stride[d] == 0 and shape[d] != 1:
            continue
        if shape[d] != 1 and stride[d] != expected:
            return None
        out[d] = symbolic
        expected *= shape[d]
        symbolic = symbolic * sizes[d]
    return out


def expression(env: ShapeEnv, value: Any) -> sympy.Expr:
    """A size or stride of the trace as an expression of the region's free symbols."""
    if isinstance(value, torch.SymInt):
        return env.replace(value.node.expr)
    return sympy.Integer(int(value))


def contiguous(sizes: Sequence[sympy.Expr], strides: Sequence[sympy.Expr]) -> bool:
    """Whether ``strides`` are the contiguous strides of ``sizes`` (expressions: for every size). torch
    writes a symbolic size's factor in a stride ``Max(1, n)``: the same where there is an element."""
    expected = sympy.Integer(1)
    for size, stride in reversed(list(zip(sizes, strides))):
        stride = stride.replace(lambda e: type(e).__name__ == "Max" and len(e.args) == 2 and sympy.Integer(1) in e.args,
                                lambda e: next(a for a in e.args if a != 1))
        if sympy.simplify(size - 1) != 0 and sympy.simplify(stride - expected) != 0:
            return False
        expected = expected * size
    return True


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's sizes and strides as expressions, its dtype and device."""

    sizes: tuple[sympy.Expr, ...]
    strides: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, env: ShapeEnv, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(expression(env, s) for s in t.shape), tuple(expression(env, s) for s in t.stride()),
                   t.dtype, t.device)

    @property
    def static(self) -> bool:
        return all(e.is_Integer for e in (*self.sizes, *self.strides))

    def show(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.sizes))}]"


class Expressions:
    """Expressions of a region's symbols, compiled to one Python function of the symbols' values
    (ints at run time, Dynamo's symbolic sizes while the outer graph is traced)."""

    def __init__(self, symbols: Sequence[sympy.Symbol], exprs: Sequence[sympy.Expr]) -> None:
        self.exprs = tuple(exprs)
        names = {s: sympy.Symbol(f"v{k}", integer=True) for k, s in enumerate(symbols)}
        printer = PythonPrinter()
        body = ", ".join(printer.doprint(sympy.sympify(e).xreplace(names)) for e in self.exprs)
        params = ", ".join(f"v{k}" for k in range(len(symbols)))
        source = f"def evaluate({params}):\n    return ({body}{',' if len(self.exprs) == 1 else ''})\n"
        namespace: dict[str, Any] = {"math": math}
        exec(compile(source, "<poros region sizes>", "exec"), namespace)
        self._fn: Callable[..., tuple] = namespace["evaluate"]
        self.source = source

    def __call__(self, values: Sequence[Any]) -> tuple:
        return self._fn(*values)


class Signature:
    """What a traced region takes: ``inputs`` (one ``TensorSpec`` per graph input), its free
    ``symbols`` (in the order ``bind`` returns their values), ``where`` each one is read (input,
    dimension), and the conditions the trace left (``guards``, and each symbol's range: >= 2)."""

    def __init__(self, env: ShapeEnv, inputs: Sequence[torch.Tensor]) -> None:
        self.env = env
        self.inputs = tuple(TensorSpec.of(env, t) for t in inputs)
        where: dict[sympy.Symbol, tuple[int, int]] = {}
        for i, spec in enumerate(self.inputs):
            for d, e in enumerate(spec.sizes):
                if e.is_Symbol and e not in where:
                    where[e] = (i, d)
        free = set().union(*(e.free_symbols for spec in self.inputs for e in (*spec.sizes, *spec.strides)))
        if free - set(where):
            raise ValueError(f"symbols {sorted(map(str, free - set(where)))} are no input's size")
        self.symbols = tuple(where)
        self.where = tuple(where[s] for s in self.symbols)
        conditions: list[sympy.Expr] = []
        for guard in env.guards:
            expr = env.simplify(guard.expr)
            if expr is not sympy.true and expr.free_symbols:
                conditions.append(expr)
        for s in self.symbols:
            bounds = env.var_to_range.get(s)
            if bounds is not None:
                if bounds.lower.is_Integer:  # a number; the unbounded ends are torch's int_oo
                    conditions.append(sympy.Ge(s, int(bounds.lower)))
                if bounds.upper.is_Integer:
                    conditions.append(sympy.Le(s, int(bounds.upper)))
        self.guards = Expressions(self.symbols, conditions) if conditions else None
        # every size and stride that is not a symbol read by ``where``, to check against a call
        checks: list[tuple[int, int, int]] = []  # (input, 0 size | 1 stride, dimension)
        exprs: list[sympy.Expr] = []
        read = set(self.where)
        for i, spec in enumerate(self.inputs):
            for d, e in enumerate(spec.sizes):
                if (i, d) not in read:
                    checks.append((i, 0, d))
                    exprs.append(e)
            for d, e in enumerate(spec.strides):
                if spec.sizes[d] != 1:  # a size-1 dimension's stride is never read
                    checks.append((i, 1, d))
                    exprs.append(e)
        self._checks = checks
        self._expected = Expressions(self.symbols, exprs)

    @property
    def dynamic(self) -> bool:
        return bool(self.symbols)

    def restrict(self, conditions: Sequence[sympy.Expr]) -> bool:
        """Take only calls whose sizes also meet ``conditions`` (expressions of ``symbols``): what a
        compile of the region assumed about its sizes (Inductor may specialize a size it lowers).
        Whether that narrowed what the region takes."""
        foreign = set().union(*(c.free_symbols for c in conditions)) - set(self.symbols)
        if foreign:
            raise ValueError(f"conditions on {sorted(map(str, foreign))}, which are no input's size")
        known = self.guards.exprs if self.guards is not None else ()
        added = [c for c in conditions if c not in known]
        if added:
            self.guards = Expressions(self.symbols, (*known, *added))
        return bool(added)

    def bind(self, tensors: Sequence[Any]) -> tuple | None:
        """The symbols' values for a call on ``tensors`` (the graph inputs: fake or real tensors), or
        ``None`` when the region does not take them. With Dynamo's symbolic sizes each comparison
        that is not known adds its guard to the outer graph."""
        if len(tensors) != len(self.inputs):
            return None
        for t, spec in zip(tensors, self.inputs):
            if t.dtype != spec.dtype or t.device != spec.device or t.dim() != len(spec.sizes):
                return None
        values = tuple(tensors[i].shape[d] for i, d in self.where)
        for (i, kind, d), expected in zip(self._checks, self._expected(values)):
            t = tensors[i]
            actual = t.shape[d] if kind == 0 else t.stride()[d]
            if kind == 1 and t.shape[d] == 1:
                continue
            if not _holds(actual == expected):
                return None
        if self.guards is not None and not all(_holds(g) for g in self.guards(values)):
            return None
        return values

    def describe(self) -> str:
        text = ", ".join(spec.show() for spec in self.inputs)
        return text if not self.guards else f"{text}; {', '.join(map(str, self.guards.exprs))}"


def _holds(condition: Any) -> bool:
    return bool(condition)


def read_plan(symbols: Sequence[sympy.Symbol], specs: Sequence[TensorSpec | None]) -> tuple[tuple[int, int], ...]:
    """Where each of ``symbols`` is a size of one of ``specs`` (``None``: not a tensor): (position,
    dimension), for binding the symbols from tensors alone (a region's backward, which gets no ints)."""
    out = []
    for s in symbols:
        found = next(((i, d) for i, spec in enumerate(specs) if spec is not None
                      for d, e in enumerate(spec.sizes) if e == s), None)
        if found is None:
            raise ValueError(f"symbol {s} is no size of the backward's inputs")
        out.append(found)
    return tuple(out)


def read(plan: Sequence[tuple[int, int]], tensors: Sequence[Any]) -> tuple:
    """The symbols' values ``plan`` reads from ``tensors``."""
    return tuple(tensors[i].shape[d] for i, d in plan)
