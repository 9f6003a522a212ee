"""Draws: what a graph takes from the random generators, replayed without running the graph.

Block-major accumulation (``runtime/accumulate.py``) runs micro-batch 1's first layer before
micro-batch 0's second one, but each micro-batch must get the dropout masks it would have drawn in
micro-batch order, where micro-batch ``i``'s forward starts from the generator state micro-batch
``i - 1``'s forward left behind. No generator can skip ahead (the CPU's Mersenne twister has no
jump), so that state is found by making the same generator calls: a graph's *draws* are its random
ops alone, each called with inputs of the right shape, dtype and device (ones, so a probability
input is valid) and its other arguments as in the graph. How much a random op takes from its
generator depends on those, not on the values. A region compiled by Inductor draws once, the
``aten.randint.low_out`` of its seeds (``torch/_inductor/ir.py``: ``RandomSeeds``), and turns the
seeds into masks on the device; its draws are that call. The caller checks every replay against the
real run (the states after each micro-batch's forward must equal the replayed ones), so a draw this
module gets wrong raises instead of changing a mask.

Before (a region's forward, eager codegen), the draws taken from it::

    native_dropout = aten.native_dropout.default(mul_1, 0.1, True)     # mul_1: f32[2, 32, 64]
    ...
    draws: [aten.native_dropout.default(ones(2, 32, 64), 0.1, True), ...]

Inductor's forward of the same region::

    inductor_seeds_default = prims.inductor_seeds.default(7, device(type='cuda', index=0))
    draws: [aten.randint.low_out(-2**63, 2**63 - 1, [7], out=empty(7, int64, cuda:0))]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

SEEDED = torch.Tag.nondeterministic_seeded


def is_random(target: Any) -> bool:
    """An op that takes numbers from a random generator."""
    return isinstance(target, torch._ops.OpOverload) and SEEDED in target.tags


@dataclasses.dataclass(frozen=True)
class Draw:
    """One generator call, replayable: ``op(*args, **kwargs)`` with tensors made from ``(shape,
    stride, dtype, device)`` descriptions at each call."""

    op: Any
    args: tuple
    kwargs: dict
    device: torch.device  # whose generator it draws from

    def __call__(self) -> None:
        self.op(*_materialize(self.args), **_materialize(self.kwargs))

    def __repr__(self) -> str:
        return f"{self.op}({', '.join(map(_show, self.args))})"


@dataclasses.dataclass(frozen=True)
class _Like:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self) -> torch.Tensor:
        fill = 1 if self.dtype.is_floating_point or self.dtype.is_complex else 0
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).fill_(fill)


def _materialize(value: Any) -> Any:
    if isinstance(value, _Like):
        return value.make()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    return f"ones{list(value.shape)}" if isinstance(value, _Like) else repr(value)


def _describe(value: Any) -> Any:
    """A node argument as a replayable description (tensors by their metadata)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{value.name} has no tensor metadata")
        return _Like(tuple(int(d) for d in val.shape), tuple(int(d) for d in val.stride()), val.dtype, val.device)
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(v) for v in value)
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
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
                {"out": _Like((count,), (1,), torch.int64, device)}, device)


def graph_draws(graph: fx.Graph) -> list[Draw]:
    """Every random op of ``graph``, in order, as a replay."""
    return [node_draw(n) for n in graph.nodes if n.op == "call_function" and is_random(n.target)]


def replay(draws: Sequence[Draw | Callable[[], None]]) -> None:
    for draw in draws:
        draw()
