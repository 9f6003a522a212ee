"""Regions: every decoder layer runs as one compiled region, traced and compiled once per structure.

Under ``torch.compile`` a prepared decoder layer does not let Dynamo trace its body. Its forward
(``layer_forward``) loads the layer's base tensors (``poros::load`` of the one arena span that holds
them, see ``Packing``) and calls one op, ``poros::region``, with everything the layer reads: the
tensors of its call, its own tensors (the adapter) and that load. Dynamo and AOTAutograd see one node
per layer, not a few hundred, and the op's autograd is ``poros::region_backward``. The first time
the op meets a layer structure (``RegionTable.region``: the layer's classes and plain attributes, the
call, the inputs' shapes), its fake implementation traces that one layer's joint forward+backward
graph (``aot_function``, the path the backend's own graphs take) and partitions it once: the region's
forward returns the layer's output *and* what its backward needs (``saved``), its backward takes them.
Layers of one structure share the region, so tracing and compiling cost does not grow with depth.

Outer joint graph, two identical layers, before the partition (``table`` is the model's handle)::

    load = poros.load(primals_3, cuda)                                        # layers.0's span (uint8)
    region = poros.region([embedding, cos, sin, ..., lora_A, ..., load], table, 0, call, "1001...")
    getitem = region[0]                  # the layer's output
    getitem_1 = region[1]   ...          # saved for its backward
    region_1 = poros.region([getitem, ..., load_1], table, 1, call, "1001...")   # the same region
    ...
    region_backward_1 = poros.region_backward([getitem, cos, sin, load_1, getitem_55, ..., tangent], table, 0)
    region_backward = poros.region_backward([embedding, cos, sin, load, getitem_1, ..., getitem_110], table, 0)

Streamed, the recompute pass tags each ``poros.region`` like any other node of its block, so the
min-cut partitioner runs it again in the backward, where its saved outputs are needed; the op is
tagged ``nondeterministic_seeded``, so the partitioner wraps the two calls in
``run_and_save_rng_state`` / ``run_with_rng_state`` and the rerun draws the forward's random numbers.
With ``stream=False`` the saved outputs are kept instead. Both call one compiled artifact per region
with the same inputs and generator state, so they compute the same bits by construction.
``passes/lower_regions.py`` compiles each region for the graph's ``codegen`` (Inductor, or the aten
graph as it is) and points the graph's nodes at the compiled code.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import logging
import re
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..errors import PorosConfigError
from .ops import LOAD

logger = logging.getLogger("poros_fx")

TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
SEP = "\x1f"  # between the entries of a call string (a string constant holding it is not taken)

# Custom ops take tensors, ints and strings, not Python objects: ``poros::region`` names the table of
# its prepared model by a handle. This weak map is the one place a handle is resolved; a table lives
# as long as its host store.
_TABLES: weakref.WeakValueDictionary[int, RegionTable] = weakref.WeakValueDictionary()


def table_of(handle: int) -> "RegionTable":
    table = _TABLES.get(handle)
    if table is None:
        raise PorosConfigError("a compiled graph refers to a prepared model that no longer exists (it was "
                               "unprepared or freed); compile the model again")
    return table


def meta_of(t: torch.Tensor) -> TensorMeta:
    """Shape, stride, dtype and device of ``t``. A region is traced for fixed shapes: a symbolic size
    (Dynamo's second compile of a step whose inputs changed shape) is specialized to the value it has
    now, so each shape gets its own graph and regions instead of one graph for every shape."""
    return tuple(int(d) for d in t.shape), tuple(int(d) for d in t.stride()), t.dtype, t.device


# -- the call of a layer, as a string and a list of tensors ----------------------------------------------

def flatten_call(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], str] | None:
    """The tensors of a layer call and a string that gives the rest (``None``: a value a region cannot
    take, such as a cache object; the layer then runs inline). Traced by Dynamo, so plain Python."""
    tensors: list[torch.Tensor] = []
    entries: list[str] = []
    named = [(f"#{i}", a) for i, a in enumerate(args)] + [(k, kwargs[k]) for k in sorted(kwargs)]
    for name, value in named:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            entries.append(f"{name}:T")
        elif isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value):
            tensors.extend(value)
            entries.append(f"{name}:{'(' if isinstance(value, tuple) else '['}{len(value)}")
        elif value is None or isinstance(value, (bool, int, float, str)):
            text = repr(value)
            if SEP in text:
                return None
            entries.append(f"{name}={text}")
        else:
            return None
    return tensors, SEP.join(entries)


def rebuild_call(call: str, tensors: Sequence[Any]) -> tuple[tuple, dict]:
    """``flatten_call``'s inverse: the args and kwargs, with ``tensors`` in the tensor places."""
    it = iter(tensors)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for entry in call.split(SEP) if call else ():
        cut = min(i for i in (entry.find(":"), entry.find("=")) if i >= 0)
        name, kind, payload = entry[:cut], entry[cut], entry[cut + 1:]
        if kind == "=":
            value = ast.literal_eval(payload)
        elif payload == "T":
            value = next(it)
        else:
            items = [next(it) for _ in range(int(payload[1:]))]
            value = tuple(items) if payload[0] == "(" else items
        if name.startswith("#"):
            args.append(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs


# -- what makes two layers one region --------------------------------------------------------------------

_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_poros_layer", "_poros_own", "_poros_hosts",
                         "_poros_block",
                         # the layer's index: read only to index a KV cache, which a region never gets
                         "layer_idx"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_LAYER_PATH = re.compile(r"(\.)\d+(\.|$)")  # "model.layers.3.self_attn" -> "model.layers.#.self_attn"


def _plain(value: Any, memo: dict[int, Any], objects: dict[int, tuple[Any, Any]], depth: int = 0) -> Any:
    """A hashable description of an attribute value: plain values as they are, containers and
    objects by their plain contents (a few levels deep), tensors by shape and dtype. A module path
    names its layer by index (PEFT keeps ``target_name``): the index is left out. An object that is
    not a container (a model config, a bitsandbytes quant state) is described once and the
    description kept in ``objects``: walking a config's hundred fields for every layer at every
    lookup cost seconds of a deep model's compile."""
    if isinstance(value, str):
        return _LAYER_PATH.sub(r"\1#\2", value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    key = id(value)
    if key in memo:
        return memo[key]
    if depth >= 3:
        out: Any = ("deep", type(value).__qualname__)
    elif isinstance(value, (tuple, list)):
        out = (type(value).__name__, tuple(_plain(v, memo, objects, depth + 1) for v in value))
    elif isinstance(value, (set, frozenset)):
        out = ("set", tuple(sorted(repr(_plain(v, memo, objects, depth + 1)) for v in value)))
    elif isinstance(value, dict):
        # integer keys are hook handles (different in every layer); string keys are names (adapters)
        out = ("dict", tuple((k if isinstance(k, str) else "#", _plain(v, memo, objects, depth + 1)) for k, v in value.items()))
    elif isinstance(value, type) or callable(value) and not hasattr(value, "__dict__"):
        out = ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    elif callable(value) and hasattr(value, "__func__"):  # a bound method
        out = ("method", value.__func__.__qualname__)
    elif hasattr(value, "__dict__"):
        known = objects.get(key)
        if known is not None and known[0] is value:
            return known[1]
        memo[key] = ("cycle", type(value).__qualname__)
        out = (type(value).__qualname__, tuple((k, _plain(v, memo, objects, depth + 1))
                                               for k, v in sorted(vars(value).items()) if not isinstance(v, nn.Module)))
        objects[key] = (value, out)
    else:
        out = ("object", type(value).__qualname__)
    memo[key] = out
    return out


def fingerprint(layer: nn.Module, objects: dict[int, tuple[Any, Any]] | None = None) -> tuple:
    """What a traced region of ``layer`` depends on besides its inputs: the classes of its modules,
    their plain attributes (training flags, dropout rates, LoRA scalings, attention kinds, ...) and
    their tensors' shapes and dtypes. Two layers with equal fingerprints trace to the same graph.
    ``objects``: descriptions of non-container objects already walked (``_plain``)."""
    memo: dict[int, Any] = {}
    objects = {} if objects is None else objects
    parts = []
    for name, mod in layer.named_modules(remove_duplicate=False):
        attrs = tuple((k, _plain(v, memo, objects)) for k, v in sorted(vars(mod).items()) if k not in _SKIP_ATTRS)
        tensors = tuple((k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in
                        (*mod._parameters.items(), *mod._buffers.items()) if t is not None)
        parts.append((name, type(mod), attrs, tensors))
    return tuple(parts)


# -- a region ------------------------------------------------------------------------------------------

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
    """One traced layer structure, shared by every layer that has it.

    ``forward``: ``(*graph inputs) -> (*outputs, *saved)``, its inputs the op's inputs expanded by
    ``packing``. ``backward`` (``None`` for an inference region) is called with the op inputs
    ``backward_inputs``, then the saved tensors, then the outputs' gradients; ``backward_args`` says
    what each of its placeholders is (``("input", p)``: the ``p``-th of those op inputs, ``("view", p,
    spec)``: a host tensor inside it, ``("saved", j)``, ``("tangent", k)``). It returns the gradients of
    the op inputs ``grad_inputs``."""

    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    joint: fx.GraphModule | None
    packing: Packing
    num_outputs: int
    output_meta: list[TensorMeta]  # outputs, then saved
    backward_inputs: tuple[int, ...]
    backward_args: list[tuple]
    grad_inputs: tuple[int, ...]
    grad_meta: list[TensorMeta]
    input_meta: list[TensorMeta]  # the graph's (expanded) inputs
    trace_seconds: float
    layers: list[int] = dataclasses.field(default_factory=list)
    compiled: dict[str, tuple[Callable, Callable | None]] = dataclasses.field(default_factory=dict)
    # per codegen: what the compiled forward takes from the random generators (runtime/draws.py)
    draws: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    compile_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    lowered: bool = False  # the region passes ran on its graphs

    @property
    def name(self) -> str:
        return f"r{self.index}"

    def backward_graph_args(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The backward graph's arguments from the backward op's inputs."""
        count, saved = len(self.backward_inputs), len(self.output_meta) - self.num_outputs
        out = []
        for arg in self.backward_args:
            kind, i = arg[0], arg[1]
            if kind == "input":
                out.append(inputs[i])
            elif kind == "view":
                out.append(block_view(inputs[i], arg[2]))
            elif kind == "saved":
                out.append(inputs[count + i])
            else:
                out.append(inputs[count + saved + i])
        return out

    def runners(self, codegen: str) -> tuple[Callable, Callable | None]:
        """The forward and backward with the ops' signatures, running the code compiled for ``codegen``."""
        fw, bw = self.compiled[codegen]
        name, expand, backward_args = self.name, self.packing.expand, self.backward_graph_args

        def forward(inputs: list, table: int, layer: int, call: str, grads: str) -> list:
            return list(fw(expand(inputs)))

        def backward(inputs: list, table: int, region: int) -> list:
            return list(bw(backward_args(inputs)))

        forward.__name__ = forward.__qualname__ = f"region_{name}_forward"
        backward.__name__ = backward.__qualname__ = f"region_{name}_backward"
        forward.poros_region = (self, "forward")  # type: ignore[attr-defined]
        backward.poros_region = (self, "backward")  # type: ignore[attr-defined]
        forward.poros_draws = tuple(self.draws[codegen])  # type: ignore[attr-defined]
        return forward, (backward if bw is not None else None)


def called_region(node: fx.Node) -> tuple[Region, str] | None:
    """``(region, "forward" | "backward")`` when ``node`` calls a compiled region (directly or through an
    RNG wrapper; ``passes/lower_regions.py`` points them there), else ``None``."""
    return getattr(node.target, "poros_region", None) if node.op == "call_function" else None


def expanded_targets(gm: fx.GraphModule) -> list[str]:
    """The ops ``gm`` runs, in order, with every region call replaced by its region graph's ops."""
    out: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        found = called_region(n)
        if found is None:
            out.append(str(n.target))
        else:
            region, phase = found
            inner = region.forward if phase == "forward" else region.backward
            out += [str(m.target) for m in inner.graph.nodes if m.op == "call_function"]
    return out


class RegionTable:
    """The regions of one prepared model's decoder layers, keyed by structure; ``handle`` names it in
    the region ops' arguments."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.by_key: dict[Any, Region] = {}
        self.objects: dict[int, tuple[Any, Any]] = {}  # fingerprint's object descriptions
        self.fingerprints: dict[tuple, int] = {}  # fingerprint -> its number (the keys hold the number)
        self._memo: tuple[Any, dict[int, int]] = (None, {})  # (the compile's TracingContext, layer -> fingerprint no.)
        self.regions: list[Region] = []
        self.handle = id(self)
        _TABLES[self.handle] = self

    def _fingerprint(self, layer: int) -> int:
        """``fingerprint`` of layer ``layer``, worked out once per compile: Dynamo, AOTAutograd and the
        passes each ask for every layer, and nothing changes a module while a frame compiles (one
        ``TracingContext``)."""
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        if context is None:
            return self._intern(layer)
        if self._memo[0] is not context:
            self._memo = (context, {})
        known = self._memo[1]
        if layer not in known:
            known[layer] = self._intern(layer)
        return known[layer]

    def _intern(self, layer: int) -> int:
        """A small number for the layer's fingerprint (a large tuple, slow to hash at every lookup)."""
        check_state(self.layers[layer], layer)
        return self.fingerprints.setdefault(fingerprint(self.layers[layer], self.objects), len(self.fingerprints))

    def region(self, layer: int, call: str, grads: str, inputs: Sequence[Any]) -> Region:
        """The region for this call of layer ``layer`` (traced now if its structure is new)."""
        module = self.layers[layer]
        metas = tuple(meta_of(t) for t in inputs)
        before = self._fingerprint(layer)
        key = (before, call, grads, metas)
        region = self.by_key.get(key)
        if region is None:
            from ..distributed import check_ddp_optimizer

            check_ddp_optimizer()  # under it, the trace's own frames (poros_sdpa's torch.cond) fail to compile
            region = trace_region(module, call, grads, list(metas), index=len(self.regions))
            self.regions.append(region)
            self.by_key[key] = region
            # a first forward may cache plain attributes (bitsandbytes' compute dtype): file the region
            # under what the layer looks like now as well
            after = self._intern(layer)
            self.by_key[(after, call, grads, metas)] = region
            if self._memo[0] is not None:
                self._memo[1][layer] = after
            logger.info("poros: traced region %s (layer %d: forward %d nodes, backward %d nodes, %d saved) in %.1f s",
                        region.name, layer, len(region.forward.graph.nodes),
                        len(region.backward.graph.nodes) if region.backward is not None else 0,
                        len(region.output_meta) - region.num_outputs, region.trace_seconds)
        if layer not in region.layers:
            region.layers.append(layer)
        return region


# -- tracing ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """Out of whatever tracing called us (Dynamo's fake mode, AOTAutograd's proxy and functional
    modes), into a clean one for a region of its own."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    # a custom op's fake impl runs below the autograd dispatch keys; a joint trace needs them back
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with (unset_fake_temporarily(), disable_proxy_modes_tracing(), disable_functional_mode(), tracing(None),
          torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)):
        yield


def _fakes(mode: Any, metas: Sequence[TensorMeta], grads: str | None = None) -> list[torch.Tensor]:
    with mode:
        out = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]
    if grads is not None:
        out = [t.requires_grad_(g == "1") for t, g in zip(out, grads)]
    return out


def state(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The layer's tensors in the order ``call_region`` passes them: parameters, then buffers."""
    return [*layer.named_parameters(), *layer.named_buffers()]


def state_names(layer: nn.Module) -> list[str]:
    return [n for n, _ in state(layer)]


MERGE_ERROR = ("merging a LoRA adapter into a prepared (streamed) base is not supported: the base weights live in "
               "the poros host store and PEFT's merge changes a temporary copy of them, so the model would run "
               "without the adapter. Merge offline instead (`poros-fx export ADAPTER --base MODEL -o OUT`), or call "
               "poros_fx.unprepare(model) first")


def check_not_merged(layer: nn.Module) -> None:
    """PEFT's ``merge_adapter`` on a prepared model adds the adapter to a loaded copy of the base weight
    (lost) and marks the LoRA layer merged, which then skips its adapter: refuse to run it."""
    if any(getattr(m, "merged", False) is True for m in layer.modules()):
        raise PorosConfigError(MERGE_ERROR)


def check_state(layer: nn.Module, index: int) -> None:
    """The tensors ``prepare`` listed for the layer are still its tensors (an adapter removed after
    ``prepare`` changes them, which no hook sees; a region traced from the old list would read the
    wrong ones), and no adapter of it is merged."""
    check_not_merged(layer)
    current = state(layer)
    listed = [(layer._poros_own if kind == "own" else layer._poros_hosts)[k] for kind, k in layer._poros_layout]
    if len(current) != len(listed) or any(t is not u for (_, t), u in zip(current, listed)):
        raise PorosConfigError(f"decoder layer {index}'s parameters or buffers changed after poros_fx.prepare (an adapter "
                               "added, removed or replaced?); call poros_fx.unprepare(model) and prepare it again")


def trace_region(layer: nn.Module, call: str, grads: str, metas: list[TensorMeta], index: int) -> Region:
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    names = state_names(layer)
    layout = layer._poros_layout
    views = layer._poros_block_views if layer._poros_block is not None else None
    packed_state = sum(kind == "own" for kind, _ in layout) + (1 if views is not None else len(layer._poros_hosts))
    packing = Packing(num_activations=len(metas) - packed_state, layout=layout, host_views=views)
    packed_metas, packed_grads = metas, grads
    metas = packing.expand_metas(packed_metas)
    grads = "".join(packed_grads[s] if isinstance(s, int) else "0" for s in packing.sources)
    num_activations = packing.num_activations
    layer_class = type(layer)._poros_layer_class  # the layer's class before prepare made it a region

    def fn(*flat: torch.Tensor) -> tuple[torch.Tensor]:
        args, kwargs = rebuild_call(call, flat[:num_activations])
        state = dict(zip(names, flat[num_activations:]))
        with torch.nn.utils.stateless._reparametrize_module(layer, state):
            out = layer_class.forward(layer, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise PorosConfigError(f"decoder layer {type(layer).__name__} returned {type(out).__name__}; a region "
                                   "takes layers that return their hidden states as one tensor (transformers 5)")
        return (out,)

    training = "1" in grads
    # Dynamo propagates fake values with grad mode off; the joint trace needs it on
    with _isolated(), torch.set_grad_enabled(training):
        inputs = _fakes(FakeTensorMode(allow_non_fake_inputs=True), metas, grads)
        joint, fw, bw = _capture(fn, inputs)
    if not training:
        return Region(index=index, forward=fw, backward=None, joint=None, packing=packing, num_outputs=1,
                      output_meta=[_meta(n) for n in _outputs(fw)], backward_inputs=(), backward_args=[],
                      grad_inputs=(), grad_meta=[], input_meta=metas, trace_seconds=time.perf_counter() - started)
    return _region_from_partition(index, joint, fw, bw, packing, metas, time.perf_counter() - started)


def _capture(fn: Callable, inputs: list[torch.Tensor]) -> tuple[Any, fx.GraphModule, Any]:
    """The joint graph of ``fn`` on ``inputs`` and its min-cut partition, through ``aot_function`` (the
    path the backend's own graphs take, so the aten ops are the ones eager autograd runs), or the
    inference graph when no input requires grad. The loads of prepared modules are stripped first."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, Any] = {"joint": None, "backward": None}

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        _strip_loads(joint)
        graphs["joint"] = joint
        with functorch_config.patch(cse=False):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        graphs["backward"] = bw
        return fw, bw

    def forward_compiler(gm: fx.GraphModule, _inputs: Any) -> fx.GraphModule:
        if graphs["joint"] is None:  # an inference graph: no partition ran
            _strip_loads(gm)
        graphs["forward"] = gm
        return gm

    aot_function(fn, fw_compiler=forward_compiler, bw_compiler=forward_compiler, partition_fn=partition)(*inputs)
    return graphs["joint"], graphs["forward"], graphs["backward"]


def _outputs(gm: fx.GraphModule) -> list[Any]:
    return list(next(iter(gm.graph.find_nodes(op="output"))).args[0])


def _meta(node: fx.Node) -> TensorMeta:
    return meta_of(node.meta["val"])


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
                           packing: Packing, metas: list[TensorMeta], seconds: float) -> Region:
    """Saved inputs come from the op's inputs in the backward (the outer graph has them: a host tensor
    as its layer's block), not through the forward's outputs; the backward returns only the gradients
    that exist."""
    primals = {n.name: i for i, n in enumerate(fw.graph.find_nodes(op="placeholder"))}
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(fw_out.args[0])
    if any(not isinstance(o, fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor) for o in outs):
        raise PorosConfigError("a region's forward saves a non-tensor (a symbolic size) for its backward; "
                               "regions need static shapes")
    kept = outs[:1] + [o for o in outs[1:] if o.op != "placeholder"]
    fw_out.args = (tuple(kept),)
    fw.graph.lint()
    fw.recompile()
    saved_index = {o.name: j for j, o in enumerate(kept[1:])}
    sources = packing.sources
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    needed = sorted({packing.block_index if not isinstance(sources[primals[p.name]], int) else sources[primals[p.name]]
                     for p in placeholders if p.name in primals and p.name not in saved_index})
    position = {packed: k for k, packed in enumerate(needed)}
    backward_args: list[tuple] = []
    tangents = 0
    for p in placeholders:
        if p.name.startswith("tangents"):
            backward_args.append(("tangent", tangents))
            tangents += 1
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
    return Region(index=index, forward=fw, backward=bw, joint=joint, packing=packing, num_outputs=1,
                  output_meta=[_meta(n) for n in kept], backward_inputs=tuple(needed), backward_args=backward_args,
                  grad_inputs=tuple(sources[i] for i in with_grad), grad_meta=[_meta(grads[i]) for i in with_grad],
                  input_meta=metas, trace_seconds=seconds)


# -- compiling -------------------------------------------------------------------------------------------

CODEGENS = ("inductor", "eager")


def compile_region(region: Region, codegen: str) -> None:
    """``region.compiled[codegen]``: boxed callables of its forward and backward."""
    if codegen in region.compiled:
        return
    from ..runtime.draws import graph_draws

    started = time.perf_counter()
    fw_metas = region.input_meta
    if codegen == "eager":
        compiled = (_boxed(region.forward), _boxed(region.backward) if region.backward is not None else None)
        draws = graph_draws(region.forward.graph)
    elif codegen == "inductor":
        fw, draws = _inductor(region.forward, fw_metas, is_backward=False, inference=region.backward is None)
        bw = None
        if region.backward is not None:
            bw_metas = [_meta(p) for p in region.backward.graph.find_nodes(op="placeholder")]
            bw, _ = _inductor(region.backward, bw_metas, is_backward=True, inference=False)
        compiled = (fw, bw)
    else:
        raise PorosConfigError(f"codegen must be one of {CODEGENS}, got {codegen!r}")
    region.compiled[codegen] = compiled
    region.draws[codegen] = draws
    region.compile_seconds[codegen] = time.perf_counter() - started
    logger.info("poros: compiled region %s (%s) in %.1f s", region.name, codegen, region.compile_seconds[codegen])


def _boxed(gm: fx.GraphModule) -> Callable:
    from torch.fx.graph import _BoxedCodeGen

    boxed = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    boxed.graph.set_codegen(_BoxedCodeGen())
    boxed.recompile()
    return boxed


def _inductor(gm: fx.GraphModule, metas: list[TensorMeta], *, is_backward: bool,
              inference: bool) -> tuple[Callable, list[Any]]:
    """``gm`` through Inductor the way ``torch.compile`` takes a graph: decomposed with Inductor's
    table, Inductor's joint-graph passes (canonicalization, patterns, its own random ops), then
    ``compile_fx_inner`` (the entry point AOTAutograd calls for each graph it compiles). Returns the
    compiled code and its draws (``runtime/draws.py``: the random ops of the graph Inductor lowers,
    its seeds and any random op it leaves as a call, are what the code takes from the generators)."""
    from ..runtime.draws import graph_draws

    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with _isolated():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = _fakes(mode, metas)
        with tracing(TracingContext(mode)), V.set_fake_mode(mode):
            with mode:
                decomposed = make_fx(gm, decomposition_table=select_decomp_table())(*inputs)
            decomposed = joint_graph_passes(decomposed)
            draws = graph_draws(decomposed.graph)  # before compile_fx_inner, which changes the graph
            return compile_fx_inner(decomposed, inputs, is_backward=is_backward, is_inference=inference), draws


# -- the ops ---------------------------------------------------------------------------------------------

@torch.library.custom_op("poros::region", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def region_op(inputs: list[torch.Tensor], table: int, layer: int, call: str, grads: str) -> list[torch.Tensor]:
    """Decoder layer ``layer`` of the model ``table`` on ``inputs`` (``call_region``'s list): its output,
    then what its backward needs. Outside a compiled graph (which calls the compiled region directly)
    this runs the region's aten graph."""
    region = table_of(table).region(layer, call, grads, inputs)
    compile_region(region, "eager")
    return region.runners("eager")[0](inputs, table, layer, call, grads)


@region_op.register_fake
def _(inputs, table, layer, call, grads):
    region = table_of(table).region(layer, call, grads, inputs)
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in region.output_meta]


@torch.library.custom_op("poros::region_backward", mutates_args=())
def region_backward_op(inputs: list[torch.Tensor], table: int, region: int) -> list[torch.Tensor]:
    """The backward of region ``region`` of the model ``table``: gradients of its ``grad_inputs``."""
    found = table_of(table).regions[region]
    compile_region(found, "eager")
    return found.runners("eager")[1](inputs, table, region)


@region_backward_op.register_fake
def _(inputs, table, region):
    found = table_of(table).regions[region]
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in found.grad_meta]


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    tensors, table, layer, call, grads = inputs
    region = table_of(table).region(layer, call, grads, tensors)
    saved = output[region.num_outputs:]
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*(tensors[i] for i in region.backward_inputs), *saved)
    ctx.region = (table, region.index)
    ctx.num_inputs = len(tensors)
    ctx.wanted = [t.requires_grad for t in tensors]


def _backward(ctx: Any, grad_outputs: list[torch.Tensor | None]) -> tuple:
    table, index = ctx.region
    region = table_of(table).regions[index]
    tangents = []
    for i, g in enumerate(grad_outputs[:region.num_outputs]):  # its backward was traced with contiguous tangents
        if g is None:
            shape, _, dtype, device = region.output_meta[i]
            g = torch.zeros(shape, dtype=dtype, device=device)
        tangents.append(g.contiguous())
    grads = REGION_BACKWARD([*ctx.saved_tensors, *tangents], table, index)
    out: list[torch.Tensor | None] = [None] * ctx.num_inputs
    for i, g in zip(region.grad_inputs, grads):
        if ctx.wanted[i]:  # not the first layer's input gradient, computed only to share the region
            out[i] = g
    return out, None, None, None, None


region_op.register_autograd(_backward, setup_context=_setup_context)

REGION = torch.ops.poros.region.default
REGION_BACKWARD = torch.ops.poros.region_backward.default


# -- the prepared layer's forward (traced by Dynamo) -----------------------------------------------------

def layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A prepared decoder layer's forward: under ``torch.compile`` one ``poros::region`` call, else the
    layer's own forward."""
    if torch.compiler.is_compiling() and self._poros_table is not None:
        flat = flatten_call(args, kwargs)
        if flat is not None:
            return call_region(self, *flat)
    elif not torch.compiler.is_compiling():
        check_not_merged(self)
    return type(self)._poros_layer_class.forward(self, *args, **kwargs)


def call_region(layer: nn.Module, activations: list[torch.Tensor], call: str) -> torch.Tensor:
    """Load the layer's base tensors and run it as one region. The layer's tensors come from the list
    ``prepare`` made (``_poros_own``, ``_poros_hosts``, ``_poros_block``; ``Packing`` says how they map
    to the layer's tensors): Dynamo walking ``named_parameters()`` generators cost ~0.5 s per layer,
    most of a deep model's compile, and every tensor it reads becomes a graph input of its own."""
    device, block = layer._poros_device, layer._poros_block
    tensors = [*activations, *layer._poros_own]
    if block is not None:  # all host tensors in one load (Packing)
        tensors.append(LOAD(block, device))
    else:  # not side by side in the arena: one load each
        tensors.extend(LOAD(t, device) for t in layer._poros_hosts)
    grad = torch.is_grad_enabled()
    grads = "".join(["1" if grad and t.requires_grad else "0" for t in tensors])
    # the first layer's hidden states come from a frozen embedding and need no gradient; asking for one
    # anyway (autograd drops it) gives it the same region as every later layer: one compile, not two
    if grad and "1" in grads and activations and activations[0].is_floating_point():
        grads = "1" + grads[1:]
    return REGION(tensors, layer._poros_table, layer._poros_layer, call, grads)[0]
