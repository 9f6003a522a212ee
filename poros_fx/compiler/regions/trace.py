"""Tracing a region: one decoder layer's joint forward+backward graph, partitioned once, for every size.

``trace_region`` traces the layer's forward and backward through ``aot_function`` (the path the
backend's own graphs take, so the aten ops are the ones eager autograd runs) on fake inputs whose
activation sizes are symbols (``shapes.py``), and partitions the joint graph with the min-cut
partitioner: the region's forward returns the layer's output and what its backward needs, its
backward takes them. Sizes the partitioner would save as ints are not saved (a custom op returns
tensors only): the backward reads them off its tensor inputs (``Region.backward_sizes``). A layer the
symbolic trace cannot take (code that needs a size's value) is traced at its sizes instead, with a
warning: it then traces again for every new size.

The region's forward, Qwen2 layer, symbolic (``s0`` batch, ``s1`` sequence)::

    def forward(primals_1: f32[s0, s1, 64], primals_2: b8[s0, 1, s1, s1], ..., primals_32: f32[64]):
        ...
        return (add_12, rsqrt, mul_1, view_3, ...)      # the output, then what the backward needs
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import time
from typing import Any, Callable, Iterator, Sequence

import sympy
import torch
import torch.fx as fx
from torch import nn

from ...errors import PorosConfigError
from ..graph_metadata import forget_module_classes
from ..ops import LOAD
from .call import rebuild_call, state_mapping
from .dequantized import tag_dequantized_recompute
from .key import autocast_of, state_names
from .parameter_lora import with_parameter_lora
from .recorded import RECORDED, recorded_chunks_error, recorded_keys, recording
from .sequence_chunks import chunked_layer, static_rng_states, tag_recompute
from .shapes import Expressions, Signature, contiguous, TensorMeta, TensorSpec, new_env, read, read_plan, trace_inputs

logger = logging.getLogger("poros_fx")

ViewSpec = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]  # byte offset in a block, dtype, shape, stride


def block_view(block: torch.Tensor, spec: ViewSpec) -> torch.Tensor:
    """One host tensor's bytes inside its layer's loaded block (a uint8 buffer), as that tensor."""
    offset, dtype, shape, stride = spec
    span = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * dtype.itemsize if all(shape) else 0
    return block[offset:offset + span].view(dtype).as_strided(shape, stride)


@dataclasses.dataclass(frozen=True)
class Packing:
    """How the op's inputs become the region graph's inputs. The op gets the call's tensors, then the
    layer's own tensors that are not in the host store (the adapter), then its host tensors: one
    loaded ``block`` (a uint8 buffer over all of them, which the arena keeps side by side; the graph
    gets each as a view of it, ``host_views``) or, where they are not side by side, one load each.
    One load per layer instead of one per tensor: Dynamo, AOTAutograd and the runtime each handle a
    fraction of the tensors. ``layout`` gives the layer's tensors in ``state`` order, each
    ``("own", k)`` or ``("host", k)``."""

    num_activations: int
    layout: tuple[tuple[str, int], ...]
    host_views: tuple[ViewSpec, ...] | None  # None: host tensors are op inputs of their own

    @property
    def num_own(self) -> int:
        return sum(kind == "own" for kind, _ in self.layout)

    @property
    def block_index(self) -> int:
        return self.num_activations + self.num_own

    @property
    def sources(self) -> list[int | ViewSpec]:
        """Per graph input: the op input it is (an index), or the view of the block it is."""
        out: list[int | ViewSpec] = list(range(self.num_activations))
        for kind, k in self.layout:
            if kind == "own":
                out.append(self.num_activations + k)
            elif self.host_views is None:
                out.append(self.block_index + k)
            else:
                out.append(self.host_views[k])
        return out

    def expand(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.host_views is None:
            return [inputs[s] for s in self.sources]  # type: ignore[index]
        block = inputs[self.block_index]
        return [inputs[s] if isinstance(s, int) else block_view(block, s) for s in self.sources]

    def expand_metas(self, metas: Sequence[TensorMeta]) -> list[TensorMeta]:
        device = metas[self.block_index][3] if self.host_views is not None else None
        return [metas[s] if isinstance(s, int) else (s[2], s[3], s[1], device) for s in self.sources]


@dataclasses.dataclass(eq=False)
class Region:
    """One traced layer structure, shared by every layer that has it, at every size its ``signature``
    takes.

    ``forward``: ``(*graph inputs) -> (*outputs, *saved)``, its inputs the op's inputs expanded by
    ``packing``. ``backward`` (``None`` for an inference region) is called with the op inputs
    ``backward_inputs``, then the saved tensors, then the outputs' gradients; ``backward_args`` says
    what each of its placeholders is (``("input", p)``: the ``p``-th of those op inputs, ``("view", p,
    spec)``: a host tensor inside it, ``("saved", j)``, ``("tangent", k)``, ``("size", k)``: the ``k``-th
    of ``backward_sizes``). It returns the gradients of the op inputs ``grad_inputs``. Sizes are
    expressions of the signature's symbols: ``outputs`` gives the outputs' (and saved tensors') sizes
    and strides for a binding, ``gradients`` the gradients'."""

    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    joint: fx.GraphModule | None
    packing: Packing
    num_outputs: int
    signature: Signature  # the op's inputs
    output_specs: list[TensorSpec]  # outputs, then saved
    backward_inputs: tuple[int, ...]
    backward_args: list[tuple]
    backward_sizes: Expressions | None  # the backward's int inputs, in ``backward_symbols``
    backward_symbols: tuple[Any, ...]  # the symbols the backward needs (its ints, its gradients' sizes)
    backward_plan: tuple[tuple[int, int], ...]  # where the backward op's inputs hold them
    grad_inputs: tuple[int, ...]
    grad_specs: list[TensorSpec]
    mode: Any  # the trace's FakeTensorMode (its ShapeEnv holds the symbols; Inductor compiles in it)
    trace_seconds: float
    layers: list[int] = dataclasses.field(default_factory=list)
    compiled: dict[str, tuple[Callable, Callable | None]] = dataclasses.field(default_factory=dict)
    # per codegen, where the forward is split (``split.py``): a forward that computes the saved tensors alone,
    # for the step's backward, which reruns the region for them and reads none of its outputs
    saved_only: dict[str, Callable] = dataclasses.field(default_factory=dict)
    # per codegen: what the compiled forward takes from the random generators (runtime/draws.py)
    draws: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    compile_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # the codegens the region passes ran on its graphs for (a pass may do one codegen's work only; a
    # region shared by two models, or compiled with another codegen by an option, may serve both)
    lowered: set[str] = dataclasses.field(default_factory=set)
    # state the layer writes for later layers (``call.py``), then what transformers' hooks recorded inside it
    # (``recorded.py``: names starting with ``@``): (name, tensors) per entry; its tensors are the outputs
    # after the first, in this order
    writes: tuple[tuple[str, int], ...] = ()
    # the outputs' gradients as the backward was traced with them (AOTAutograd may make a transposed
    # output's tangent contiguous); empty: laid out as the outputs are
    tangent_specs: list[TensorSpec] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        symbols = self.signature.symbols
        self._outputs = _meta_expressions(symbols, self.output_specs)
        self._gradients = _meta_expressions(self.backward_symbols, self.grad_specs)
        tangents = self.tangent_specs or self.output_specs[:self.num_outputs]
        self._tangents = _meta_expressions(symbols, tangents)
        # per output: its gradient handed to the backward contiguous (``.contiguous()``, no copy when it is)
        self.contiguous_tangents = tuple(contiguous(spec.sizes, spec.strides) for spec in tangents)

    @property
    def name(self) -> str:
        return f"r{self.index}"

    def output_meta(self, values: Sequence[Any]) -> list[TensorMeta]:
        """Sizes, strides, dtypes and devices of the outputs, then the saved tensors, at ``values``."""
        return self._outputs(values)

    def tangent_meta(self, values: Sequence[Any]) -> list[TensorMeta]:
        """Sizes, strides, dtypes and devices the backward expects the outputs' gradients in, at ``values``."""
        return self._tangents(values)

    def grad_meta(self, values: Sequence[Any]) -> list[TensorMeta]:
        """The gradients' metadata at ``values`` of ``backward_symbols``."""
        return self._gradients(values)

    def backward_values(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """The values of ``backward_symbols``, read off the backward op's inputs."""
        return read(self.backward_plan, inputs)

    def backward_graph_args(self, inputs: Sequence[torch.Tensor]) -> list[Any]:
        """The backward graph's arguments from the backward op's inputs."""
        count, saved = len(self.backward_inputs), len(self.output_specs) - self.num_outputs
        sizes = self.backward_sizes(self.backward_values(inputs)) if self.backward_sizes is not None else ()
        out: list[Any] = []
        for arg in self.backward_args:
            kind, i = arg[0], arg[1]
            if kind == "input":
                out.append(inputs[i])
            elif kind == "view":
                out.append(block_view(inputs[i], arg[2]))
            elif kind == "saved":
                out.append(inputs[count + i])
            elif kind == "tangent":
                out.append(inputs[count + saved + i])
            else:
                out.append(sizes[i])
        return out


class _MetaExpressions:
    """``TensorSpec``s evaluated at a binding, as ``TensorMeta``s."""

    def __init__(self, symbols: Sequence[Any], specs: Sequence[TensorSpec]) -> None:
        self.specs = list(specs)
        flat = [e for spec in self.specs for e in (*spec.sizes, *spec.strides)]
        self.values = Expressions(symbols, flat) if flat else None

    def __call__(self, values: Sequence[Any]) -> list[TensorMeta]:
        flat = self.values(values) if self.values is not None else ()
        out, k = [], 0
        for spec in self.specs:
            n = len(spec.sizes)
            out.append((tuple(flat[k:k + n]), tuple(flat[k + n:k + 2 * n]), spec.dtype, spec.device))
            k += 2 * n
        return out


def _meta_expressions(symbols: Sequence[Any], specs: Sequence[TensorSpec]) -> _MetaExpressions:
    return _MetaExpressions(symbols, specs)


# -- tracing ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Out of whatever tracing called us (Dynamo's fake mode, AOTAutograd's proxy and functional
    modes), into a clean one for a region of its own."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    # a custom op's fake impl runs below the autograd dispatch keys; a joint trace needs them back
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    # (ADInplaceOrView too: an in-place write into a view, e.g. a chunked scan filling its output, must
    # rebase the view's autograd history)
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    # autocast off: a region's graph follows its call (key.autocast_of), not whoever traces or compiles it
    with (unset_fake_temporarily(), disable_proxy_modes_tracing(), disable_functional_mode(), tracing(None),
          torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude),
          torch._C._DisableAutocast()):
        yield


def _fakes(mode: Any, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    with mode:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]


def trace_region(layer: nn.Module, call: str, grads: str, metas: list[TensorMeta], index: int) -> Region:
    """The region of ``layer`` for a call ``call`` on op inputs described by ``metas`` (``grads``: which
    of them require grad), symbolic in the activations' sizes, or at these sizes when the layer's code
    needs their values (``SymbolicTraceError`` says why)."""
    try:
        return _trace(layer, call, grads, metas, index, symbolic=True)
    except SymbolicTraceError as e:
        logger.warning("poros: decoder layer %d of this structure cannot be traced for every sequence length (%s); "
                       "it is traced at its sizes, and every new size traces and compiles it again",
                       layer._poros_layer, e)
    try:
        return _trace(layer, call, grads, metas, index, symbolic=False)
    except PorosConfigError:
        raise
    except Exception as e:  # one clear error (Dynamo wraps it; its last line is ours)
        name = type(layer)._poros_layer_class.__name__
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise PorosConfigError(
            f"decoder layer {layer._poros_layer} ({name}) does not fit a poros region: tracing its forward and "
            f"backward failed with {reason}. A region takes a layer that returns its hidden states as one tensor, "
            "passes tensors, tuples of tensors, plain values or a mapping of tuples of tensors, and attends "
            "through transformers' attention interface. prepare(..., regions=False) traces such layers into the "
            "step's graph instead (streamed, no region reuse); a validated family needs neither") from e


class SymbolicTraceError(Exception):
    """A layer's code needed the value of a size the region keeps symbolic."""


def _trace(layer: nn.Module, call: str, grads: str, metas: list[TensorMeta], index: int, *, symbolic: bool) -> Region:
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    names = state_names(layer)
    layout = layer._poros_layout
    views = layer._poros_block_views if layer._poros_block is not None else None
    packed_state = sum(kind == "own" for kind, _ in layout) + (1 if views is not None else len(layer._poros_hosts))
    packing = Packing(num_activations=len(metas) - packed_state, layout=layout, host_views=views)
    num_activations = packing.num_activations
    layer_class = type(layer)._poros_layer_class  # the layer's class before prepare made it a region

    found_writes: list[tuple[tuple[str, int], ...]] = []

    def fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild_call(call, flat[:num_activations])
        state = dict(zip(names, flat[num_activations:]))
        carried = state_mapping(args, kwargs)
        before = dict(carried) if carried is not None else {}
        unchunked = with_parameter_lora(layer)
        view = chunked_layer(unchunked)
        with torch.nn.utils.stateless._reparametrize_module(layer, state), recording(recorded_keys(call)) as recorded:
            out = layer_class.forward(view, *args, **kwargs)
        if any(recorded.values()) and view is not unchunked:
            raise PorosConfigError(recorded_chunks_error([k for k, v in recorded.items() if v]))
        if not isinstance(out, torch.Tensor):
            raise PorosConfigError(f"decoder layer {type(layer).__name__} returned {type(out).__name__}; a region "
                                   "takes layers that return their hidden states as one tensor (transformers 5)")
        written = written_state(carried, before) + [(RECORDED + k, tuple(v)) for k, v in recorded.items() if v]
        found_writes[:] = [tuple((k, len(v)) for k, v in written)]
        return (out, *(t for _, v in written for t in v))

    training = "1" in grads
    mode = FakeTensorMode(shape_env=new_env(), allow_non_fake_inputs=True)
    # Dynamo propagates fake values with grad mode off; the joint trace needs it on
    with isolated(), torch.set_grad_enabled(training), autocast_of(call):
        dynamic = [symbolic and i < num_activations for i in range(len(metas))]
        op_inputs = trace_inputs(mode, metas, dynamic)
        expanded = packing.expand_metas(metas)
        inputs = [op_inputs[s] if isinstance(s, int) and s < num_activations else None
                  for s in packing.sources]
        fresh = _fakes(mode, [m for m, t in zip(expanded, inputs) if t is None])
        inputs = [t if t is not None else fresh.pop(0) for t in inputs]
        expanded_grads = "".join(grads[s] if isinstance(s, int) else "0" for s in packing.sources)
        inputs = [t.requires_grad_(g == "1") for t, g in zip(inputs, expanded_grads)]
        try:
            with mode:  # the traced graph runs once on its inputs: a factory op (arange of a size) makes fakes too
                joint, fw, bw = _capture(fn, inputs)
            signature = Signature(mode.shape_env, op_inputs)
        except PorosConfigError:
            raise
        except Exception as e:
            if not symbolic:
                raise
            raise SymbolicTraceError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    seconds = time.perf_counter() - started
    try:
        writes = found_writes[0] if found_writes else ()
        num_outputs = 1 + sum(n for _, n in writes)
        if not training:
            output_specs = [TensorSpec.of(mode.shape_env, n.meta["val"]) for n in _outputs(fw)]
            _check_symbols(signature, output_specs)
            return Region(index=index, forward=fw, backward=None, joint=None, packing=packing, num_outputs=num_outputs,
                          writes=writes,
                          signature=signature, output_specs=output_specs, backward_inputs=(), backward_args=[],
                          backward_sizes=None, backward_symbols=(), backward_plan=(), grad_inputs=(), grad_specs=[],
                          mode=mode,
                          trace_seconds=seconds)
        return _region_from_partition(index, joint, fw, bw, packing, signature, mode, seconds, writes)
    except ValueError as e:
        if not symbolic:
            raise
        raise SymbolicTraceError(str(e)) from e


def _capture(fn: Callable, inputs: list[torch.Tensor]) -> tuple[Any, fx.GraphModule, Any]:
    """The joint graph of ``fn`` on ``inputs`` and its min-cut partition, or the inference graph when
    no input requires grad. The loads of prepared modules are stripped first."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, Any] = {"joint": None, "backward": None}

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        _strip_loads(joint)
        tag_recompute(joint)
        tag_dequantized_recompute(joint, inputs)
        graphs["joint"] = joint
        # a recomputed dropout saves its generator state as a tensor (graph-safe states would be new inputs)
        with functorch_config.patch(cse=False, graphsafe_rng_functionalization=False):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        static_rng_states(fw, bw)
        graphs["backward"] = bw
        return fw, bw

    def forward_compiler(gm: fx.GraphModule, _inputs: Any) -> fx.GraphModule:
        if graphs["joint"] is None:  # an inference graph: no partition ran
            _strip_loads(gm)
        # the first graph compiled is the forward (with symbolic sizes AOTAutograd compiles the backward
        # right after it, not at the first backward)
        graphs.setdefault("forward", gm)
        return gm

    aot_function(fn, fw_compiler=forward_compiler, bw_compiler=forward_compiler, partition_fn=partition)(*inputs)
    for graph in graphs.values():
        if graph is not None:
            forget_module_classes(graph)  # a region outlives no model (graph_metadata.py)
    return graphs["joint"], graphs["forward"], graphs["backward"]


def _outputs(gm: fx.GraphModule) -> list[Any]:
    return list(next(iter(gm.graph.find_nodes(op="output"))).args[0])


def _strip_loads(gm: fx.GraphModule) -> None:
    """A prepared module's ``weight`` reads through ``poros::load``; in a region its tensor is already
    the loaded device copy (an op input), so each such load is the input itself."""
    for n in list(gm.graph.find_nodes(op="call_function", target=LOAD)):
        src, device = n.args
        if src.op == "placeholder" and src.meta["val"].device == torch.device(device):
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
    gm.recompile()


def _region_from_partition(index: int, joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule,
                           packing: Packing, signature: Signature, mode: Any, seconds: float,
                           writes: tuple[tuple[str, int], ...] = ()) -> Region:
    """Saved inputs come from the op's inputs in the backward (the outer graph has them: a host tensor
    as its layer's block), not through the forward's outputs; saved sizes are read off the backward's
    tensors; the backward returns only the gradients that exist."""
    env = mode.shape_env
    primals = {n.name: i for i, n in enumerate(fw.graph.find_nodes(op="placeholder"))}
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(fw_out.args[0])
    num_outputs = 1 + sum(n for _, n in writes)
    if any(not isinstance(o, fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor) for o in outs[:num_outputs]):
        raise ValueError("a region's forward returns a non-tensor")
    kept = outs[:num_outputs] + [o for o in outs[num_outputs:] if isinstance(o, fx.Node) and o.op != "placeholder"
                                 and isinstance(o.meta.get("val"), torch.Tensor)]
    fw_out.args = (tuple(kept),)
    fw.graph.eliminate_dead_code()
    fw.graph.lint()
    fw.recompile()
    saved_index = {o.name: j for j, o in enumerate(kept[num_outputs:])}
    # a dropout the partitioner recomputes (sequence_chunks) saves its random state; the backward's input
    # for the k-th is named rng_state_output_k
    states = [o for o in kept[num_outputs:] if o.target is operator.getitem and o.args[1] == 0
              and getattr(o.args[0], "target", None) is torch._prims.rng_prims.run_and_save_rng_state]
    saved_index.update({f"rng_state_output_{k}": saved_index[o.name] for k, o in enumerate(states)})
    sources = packing.sources
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    needed = sorted({packing.block_index if not isinstance(sources[primals[p.name]], int) else sources[primals[p.name]]
                     for p in placeholders if p.name in primals and p.name not in saved_index})
    position = {packed: k for k, packed in enumerate(needed)}
    backward_args: list[tuple] = []
    size_exprs: list[Any] = []
    tangents = 0
    for p in placeholders:
        val = p.meta.get("val")
        if p.name.startswith("tangents"):
            backward_args.append(("tangent", tangents))
            tangents += 1
        elif not isinstance(val, torch.Tensor):  # a size the partitioner saved
            backward_args.append(("size", len(size_exprs)))
            size_exprs.append(env.replace(val.node.expr) if isinstance(val, torch.SymInt) else int(val))
        elif p.name in saved_index:
            backward_args.append(("saved", saved_index[p.name]))
        else:
            source = sources[primals[p.name]]
            backward_args.append(("input", position[source]) if isinstance(source, int)
                                 else ("view", position[packing.block_index], source))
    bw_out = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(bw_out.args[0])
    with_grad = [i for i, g in enumerate(grads) if g is not None]
    if any(not isinstance(sources[i], int) for i in with_grad):
        raise AssertionError("a region's backward computes a gradient for a host tensor of the frozen base")
    bw_out.args = (tuple(grads[i] for i in with_grad),)
    bw.graph.lint()
    bw.recompile()
    output_specs = [TensorSpec.of(env, n.meta["val"]) for n in kept]
    tangent_vals = [p.meta["val"] for p in placeholders if p.name.startswith("tangents")]
    tangent_specs = [TensorSpec.of(env, t) for t in tangent_vals] if len(tangent_vals) == num_outputs else []
    grad_specs = [TensorSpec.of(env, grads[i].meta["val"]) for i in with_grad]
    _check_symbols(signature, [*output_specs, *grad_specs], size_exprs)
    # the symbols the backward needs, and where the backward op's inputs (the op inputs it needs, the
    # saved tensors, the outputs' gradients) hold them
    used = set().union(*(sympy.sympify(e).free_symbols for e in size_exprs),
                       *(e.free_symbols for spec in grad_specs for e in (*spec.sizes, *spec.strides)))
    symbols = tuple(s for s in signature.symbols if s in used)
    specs = [signature.inputs[i] for i in needed] + output_specs[num_outputs:] + output_specs[:num_outputs]
    plan = read_plan(symbols, specs)
    return Region(index=index, forward=fw, backward=bw, joint=joint, packing=packing, num_outputs=num_outputs,
                  writes=writes,
                  signature=signature, output_specs=output_specs, backward_inputs=tuple(needed),
                  backward_args=backward_args,
                  backward_sizes=Expressions(symbols, size_exprs) if size_exprs else None, backward_symbols=symbols,
                  backward_plan=plan, grad_inputs=tuple(sources[i] for i in with_grad),
                  grad_specs=grad_specs, mode=mode, tangent_specs=tangent_specs,
                  trace_seconds=seconds)


def written_state(carried: Any, before: dict) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """What a layer put into the mapping it was called with (entries new or replaced), sorted by name;
    each must be a tuple of tensors (a region hands back tensors only)."""
    if carried is None:
        return []
    out = []
    for key in sorted(carried):
        value = carried[key]
        if key in before and value is before[key]:
            continue
        if not (isinstance(key, str) and isinstance(value, tuple) and value
                and all(isinstance(t, torch.Tensor) for t in value)):
            raise PorosConfigError(f"a decoder layer wrote {key!r} = {type(value).__name__} into the state it passes to "
                                   "later layers; a region carries tuples of tensors under string names only")
        out.append((key, value))
    return out


def _check_symbols(signature: Signature, specs: Sequence[TensorSpec], exprs: Sequence[Any] = ()) -> None:
    """Every size the region hands back is an expression of symbols a call binds."""
    known = set(signature.symbols)
    found = set().union(*(sympy.sympify(e).free_symbols for spec in specs for e in (*spec.sizes, *spec.strides)),
                        *(sympy.sympify(e).free_symbols for e in exprs))
    if found - known:
        raise ValueError(f"the region's outputs have sizes {sorted(map(str, found - known))} no input gives")
