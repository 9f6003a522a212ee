"""Compiling a region once per codegen: Inductor's fused kernels, or its aten graph as it is.

Forward, recompute and the ``stream=False`` reference all call the one artifact ``compile_region``
makes, so they compute the same bits. Inductor compiles the region's graphs in the region's own fake
mode, with its symbolic sizes: one compile serves every sequence length. Inductor may pad the
strides of what it computes (``comprehensive_padding`` for sizes that are not multiples of the
alignment); every output of a region keeps the strides its trace gave it, because the region's
other graph (the backward, for a saved tensor) and the outer graph were made for those::

    output.meta["user_visible_output_idxs"] = [0, 1, ..., 52]     # all of them, not just the layer's output

Inductor keeps the strides of the graph it compiles, the region's graph after Inductor's
decompositions, and a decomposition may lay an output out otherwise than the aten op it replaces
(``TracedLayout``): such an output is copied back into its traced strides inside the graph.

A region's graphs go through Inductor's FX graph cache (on disk, ``TORCHINDUCTOR_CACHE_DIR``), so a
second process compiling the same layer structure loads the compiled code instead of lowering and
compiling it again. Inductor bypasses the cache for a graph holding a ``cond`` (the attention's SDPA
choice, traced as the higher-order op): ``region_inductor_config`` marks ``cond`` cacheable for the
region's compile, keyed by the torch version. Its branches are subgraphs of the graph, so the cache
key (the graph's code and its submodules') covers them; ``tests/test_compile_cache.py`` checks that a
second process hits the cache and trains the same bits. The same config turns on Inductor's
deterministic mode: no reduction kernel's block size is chosen by timing candidates on the device.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from ...errors import PorosConfigError
from ...options import CODEGENS
from .shapes import Expressions, expression
from .split import ForwardParts, split_forward
from .trace import Region, isolated

logger = logging.getLogger("poros_fx")



def region_inductor_config() -> Any:
    """Inductor's config for a region: ``cond`` (``torch.ops.higher_order.cond``) allowed in the FX graph
    cache, and Inductor's deterministic mode. Without it a reduction kernel (a norm, a softmax) picks its
    block size and warp count by timing candidates on the device the first time it runs at a size, and
    those choices change the order it sums in: two runs of one step, streamed and ``stream=False``,
    could pick differently and part by an ulp, most likely when the sequence length changes from one
    micro-batch to the next (each new size is timed again)."""
    from torch._higher_order_ops.cond import cond_op
    from torch._inductor import config as inductor_config

    name = f"{cond_op.__module__}.{cond_op.__name__}"
    return inductor_config.patch(deterministic=True, unsafe_marked_cacheable_functions={
        **inductor_config.unsafe_marked_cacheable_functions, name: torch.__version__})


def compile_region(region: Region, codegen: str, draws_of: Callable[[fx.GraphModule], list[Any]]) -> None:
    """``region.compiled[codegen]``: boxed callables of its forward and backward. ``draws_of``: what a
    graph takes from the random generators (``runtime/draws.py``), kept in ``region.draws``."""
    if codegen in region.compiled:
        return
    started = time.perf_counter()
    parts = split_forward(region.forward, region.num_outputs, region.mode.shape_env) if region.backward else None
    if codegen == "eager":
        compiled = (_boxed(region.forward), _boxed(region.backward) if region.backward is not None else None)
        draws = draws_of(region.forward)
        if parts is not None:
            saved_part, rest = _boxed(parts.saved_part), _boxed(parts.rest)
            compiled = (_forward_of(parts, saved_part, rest), compiled[1])
            region.saved_only[codegen] = _saved_only_of(parts, saved_part, region.num_outputs)
            draws = draws_of(parts.saved_part) + draws_of(parts.rest)
    elif codegen == "inductor":
        env = region.mode.shape_env
        guards_before, replacements_before = len(env.guards), dict(env.replacements)
        if parts is None:
            fw, draws = _inductor(region, region.forward, draws_of, is_backward=False, inference=region.backward is None)
        else:
            saved_part, draws = _inductor(region, parts.saved_part, draws_of, is_backward=False, inference=False)
            rest, rest_draws = _inductor(region, parts.rest, draws_of, is_backward=False, inference=False)
            fw, draws = _forward_of(parts, saved_part, rest), draws + rest_draws
            region.saved_only[codegen] = _saved_only_of(parts, saved_part, region.num_outputs)
        bw = None
        if region.backward is not None:
            bw, _ = _inductor(region, region.backward, draws_of, is_backward=True, inference=False)
        compiled = (fw, bw)
        conditions = compile_conditions(env, guards_before, replacements_before)
        fixed = [c for c in conditions if isinstance(c, sympy.Eq) and c.lhs.is_Symbol and c.rhs.is_number]
        if region.signature.restrict(conditions) and fixed:
            logger.warning("poros: Inductor compiled region %s for %s only: each other size traces and compiles "
                           "the layer, and the step, again", region.name, ", ".join(map(str, fixed)))
    else:
        raise PorosConfigError(f"codegen must be one of {CODEGENS}, got {codegen!r}")
    region.compiled[codegen] = compiled
    region.draws[codegen] = draws
    region.compile_seconds[codegen] = time.perf_counter() - started
    logger.info("poros: compiled region %s (%s) in %.1f s", region.name, codegen, region.compile_seconds[codegen])


def _forward_of(parts: ForwardParts, saved_part: Callable, rest: Callable) -> Callable:
    """A boxed forward that runs the two compiled parts of a split forward (``split.py``): its outputs,
    then its saved tensors, as the whole graph returns them."""

    def forward(args: list) -> list:
        direct = [args[i] for kind, i in parts.rest_inputs if kind == "input"]  # taken before the boxed call
        made = list(saved_part(args))                                        # clears ``args``
        taken = iter(direct)
        outputs = rest([next(taken) if kind == "input" else made[i] for kind, i in parts.rest_inputs])
        return [*outputs, *made[:parts.num_saved]]

    return forward


def _saved_only_of(parts: ForwardParts, saved_part: Callable, num_outputs: int) -> Callable:
    """A boxed forward that computes the saved tensors alone (``None`` in the outputs' places)."""

    def saved_only(args: list) -> list:
        return [None] * num_outputs + list(saved_part(args))[:parts.num_saved]

    return saved_only


def compile_conditions(env: Any, guards_before: int, replacements_before: dict) -> list[sympy.Expr]:
    """What a compile assumed about the region's sizes: the guards it added to the region's ShapeEnv
    and the sizes it specialized (Inductor's convolution backward fixes its strides, and with them the
    sequence length of Qwen3.5's Gated DeltaNet). The compiled code holds only for such sizes, so the
    region's signature takes these conditions, and the outer graph that binds it guards on them."""
    aliases = {s: e for s, e in replacements_before.items() if not e.is_number}  # the trace's unifications
    conditions = [sympy.sympify(g.expr).xreplace(aliases) for g in env.guards[guards_before:]]
    conditions += [sympy.Eq(s, e) for s, e in env.replacements.items() if replacements_before.get(s) != e]
    return list(dict.fromkeys(c for c in conditions if c is not sympy.true and c.free_symbols))


def _boxed(gm: fx.GraphModule) -> Callable:
    from torch.fx.graph import _BoxedCodeGen

    boxed = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    boxed.graph.set_codegen(_BoxedCodeGen())
    boxed.recompile()
    return boxed


def keep_output_strides(gm: fx.GraphModule) -> None:
    """Make Inductor give every output of ``gm`` the strides its fake value has (it keeps only the
    outputs it is told are visible; the others it may lay out as it likes, padded)."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = output.args[0]
    output.meta["original_output_strides"] = [
        o.meta["val"].stride() if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) else None
        for o in outs]
    output.meta["user_visible_output_idxs"] = [i for i, o in enumerate(outs) if isinstance(o, fx.Node)]


class TracedLayout(fx.Interpreter):
    """``gm`` run node by node (under ``make_fx`` with Inductor's decompositions), each output of
    ``gm`` given the strides ``gm``'s trace gave it as soon as it is computed. A decomposition may lay
    an output out otherwise than the op it replaces: Inductor's ``cat`` of one non-empty tensor is a
    ``clone`` of it, with its strides, and Phi-3's rotary ``cat([q_rot, q_pass])`` (``q_pass`` empty)
    came out [b, s, h, d]-major where the trace, and so the backward that takes it saved, had it
    [b, h, s, d]. Such an output goes through Inductor's ``inductor_force_stride_order`` to its traced
    strides, and every later user of it takes that (the attention's ``cond`` too, whose branches
    Inductor compiles for its operands' strides and does not lay out to them). The strides are
    computed from the inputs' sizes (``inputs``: ``gm``'s placeholder values, sizes of ``env``), so
    ``make_fx`` records them for every size."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Any], env: Any) -> None:
        from torch._inductor import inductor_prims

        super().__init__(gm)
        self.shape_env = env
        self.force = inductor_prims.force_stride_order
        self.where: dict[Any, tuple[int, int | None]] = {}  # a symbol: the input (and dimension) whose size it is
        for i, value in enumerate(inputs):
            for d, size in enumerate(value.shape) if isinstance(value, torch.Tensor) else [(None, value)]:
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    self.where.setdefault(size.node.expr, (i, d))
        self.wanted: dict[fx.Node, tuple[tuple[sympy.Expr, ...], Expressions]] = {}
        for o in next(iter(gm.graph.find_nodes(op="output"))).args[0]:
            if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) and o.meta["val"].dim():
                strides = tuple(expression(env, st) for st in o.meta["val"].stride())
                # strides in a symbol that is no input's size cannot be computed here: left to Inductor's assert
                if set().union(*(e.free_symbols for e in strides)) <= set(self.where):
                    self.wanted[o] = (strides, Expressions(tuple(self.where), strides))
        self.values: list[Any] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.values = [args[i] if d is None else args[i].shape[d] for i, d in self.where.values()]
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.wanted and not _same_strides(self.shape_env, out, self.wanted[n][0]):
            out = self.force(out, list(self.wanted[n][1](self.values)))
        return out


def _same_strides(env: Any, t: torch.Tensor, strides: Sequence[Any]) -> bool:
    """Whether ``t``'s strides are ``strides`` (expressions) in every dimension of a size other than 1."""
    return all(expression(env, size) == 1 or sympy.expand(expression(env, st) - want) == 0
               for size, st, want in zip(t.shape, t.stride(), strides))


def _inductor(region: Region, gm: fx.GraphModule, draws_of: Callable[[fx.GraphModule], list[Any]], *, is_backward: bool,
              inference: bool) -> tuple[Callable, list[Any]]:
    """``gm`` through Inductor the way ``torch.compile`` takes a graph: decomposed with Inductor's
    table, Inductor's joint-graph passes (canonicalization, patterns, its own random ops), then
    ``compile_fx_inner`` (the entry point AOTAutograd calls for each graph it compiles), all in the
    region's fake mode. Returns the compiled code and its draws (the random ops of the graph Inductor
    lowers, its seeds and any random op it leaves as a call, are what the code takes)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = region.mode
    inputs = [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")]
    with isolated(), tracing(TracingContext(mode)), V.set_fake_mode(mode), region_inductor_config():
        with mode:
            decomposed = make_fx(TracedLayout(gm, inputs, mode.shape_env).run, decomposition_table=select_decomp_table(),
                                 tracing_mode="symbolic" if region.signature.dynamic else "real")(*inputs)
        decomposed = joint_graph_passes(decomposed)
        draws = draws_of(decomposed)  # before compile_fx_inner, which changes the graph
        keep_output_strides(decomposed)
        # make_fx's symbolic trace leaves its ShapeEnv on the module; the FX graph cache cannot key on it (it
        # reads the fake mode's ShapeEnv, the same object) and would bypass the cache
        decomposed.__dict__["shape_env"] = None  # Inductor then takes it from the inputs' fake tensors
        return compile_fx_inner(decomposed, inputs, is_backward=is_backward, is_inference=inference), draws
