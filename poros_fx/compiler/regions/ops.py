"""The region ops: a prepared decoder layer under ``torch.compile`` is one ``poros::region`` call.

A prepared layer's forward (``layer_forward``) does not let Dynamo trace its body under
``torch.compile``: it loads the layer's base tensors (``poros::load`` of the one arena span that
holds them, see ``Packing``) and calls one op with everything the layer reads: the tensors of its
call, its own tensors (the adapter) and that load. The op's fake implementation asks the table for
the region (tracing it the first time a structure comes) and gives back the output and saved
tensors at the call's sizes; its autograd is ``poros::region_backward``. Outer joint graph, two
identical layers, before the partition (``table`` is the model's handle)::

    load = poros.load(primals_3, cuda)                                        # layers.0's span (uint8)
    region = poros.region([embedding, mask, skip, cos, sin, ..., lora_A, ..., load], table, 0, call, "1001...")
    getitem = region[0]                  # the layer's output
    getitem_1 = region[1]   ...          # saved for its backward
    region_1 = poros.region([getitem, ..., load_1], table, 1, call, "1001...")   # the same region
    ...
    region_backward_1 = poros.region_backward([getitem, cos, sin, load_1, getitem_55, ..., tangent], table, 0)

Streamed, the recompute pass tags each ``poros.region`` like any other node of its block, so the
min-cut partitioner runs it again in the backward; the op is tagged ``nondeterministic_seeded``, so
the partitioner wraps the two calls in ``run_and_save_rng_state`` / ``run_with_rng_state`` and the
rerun draws the forward's random numbers. ``passes/lower_regions.py`` points every call at the
region's compiled code (``runners``) and marks the node with ``ROLE``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..ops import LOAD
from .call import SEP, flatten_call, state_mapping
from .compile import compile_region
from .key import autocast_entry, check_not_merged, mode_entry
from .recorded import RECORDED, append_recorded, record_entry
from .table import quiet_compile_events, table_of
from .trace import Region
from ...runtime.draws import graph_draws

ROLE = "poros_region"  # node.meta: (region, "forward" | "backward") of a node that calls a compiled region


def compile_for(region: Region, codegen: str) -> None:
    """Compile ``region`` for ``codegen`` (once), with its random draws."""
    if codegen not in region.compiled:
        with quiet_compile_events():
            compile_region(region, codegen, graph_draws)


def runners(region: Region, codegen: str) -> tuple[Callable, Callable | None]:
    """The forward and backward with the ops' signatures, running the code compiled for ``codegen``."""
    fw, bw = region.compiled[codegen]
    name, expand, backward_args = region.name, region.packing.expand, region.backward_graph_args

    def forward(inputs: list, table: int, layer: int, call: str, grads: str) -> list:
        return list(fw(expand(inputs)))

    def backward(inputs: list, table: int, index: int) -> list:
        return list(bw(backward_args(inputs)))

    forward.__name__ = forward.__qualname__ = f"region_{name}_forward"
    backward.__name__ = backward.__qualname__ = f"region_{name}_backward"
    return forward, (backward if bw is not None else None)


def saved_only_runner(region: Region, codegen: str) -> Callable | None:
    """A forward with the op's signature that computes the region's saved tensors alone (``None`` in its
    outputs' places), where its forward is split (``split.py``); else ``None``."""
    fw = region.saved_only.get(codegen)
    if fw is None:
        return None
    expand = region.packing.expand

    def saved_only(inputs: list, table: int, layer: int, call: str, grads: str) -> list:
        return list(fw(expand(inputs)))

    saved_only.__name__ = saved_only.__qualname__ = f"region_{region.name}_saved_only"
    return saved_only


@torch.library.custom_op("poros::region", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def region_op(inputs: list[torch.Tensor], table: int, layer: int, call: str, grads: str) -> list[torch.Tensor]:
    """Decoder layer ``layer`` of the model ``table`` on ``inputs`` (``call_region``'s list): its output,
    then what its backward needs. Outside a compiled graph (which calls the compiled region directly)
    this runs the region's aten graph."""
    region, _ = table_of(table).region(layer, call, grads, inputs)
    compile_for(region, "eager")
    return runners(region, "eager")[0](inputs, table, layer, call, grads)


@region_op.register_fake
def _(inputs, table, layer, call, grads):
    region, values = table_of(table).region(layer, call, grads, inputs)
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in region.output_meta(values)]


@torch.library.custom_op("poros::region_backward", mutates_args=())
def region_backward_op(inputs: list[torch.Tensor], table: int, region: int) -> list[torch.Tensor]:
    """The backward of region ``region`` of the model ``table``: gradients of its ``grad_inputs``."""
    found = table_of(table).regions[region]
    compile_for(found, "eager")
    return runners(found, "eager")[1](inputs, table, region)


@region_backward_op.register_fake
def _(inputs, table, region):
    found = table_of(table).regions[region]
    metas = found.grad_meta(found.backward_values(inputs))
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in metas]


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    tensors, table, layer, call, grads = inputs
    region, values = table_of(table).region(layer, call, grads, tensors)
    saved = output[region.num_outputs:]
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*(tensors[i] for i in region.backward_inputs), *saved)
    ctx.region = (table, region.index)
    ctx.values = values
    ctx.num_inputs = len(tensors)
    ctx.wanted = [t.requires_grad for t in tensors]


def _backward(ctx: Any, grad_outputs: list[torch.Tensor | None]) -> tuple:
    table, index = ctx.region
    region = table_of(table).regions[index]
    metas = region.tangent_meta(ctx.values)
    tangents = []
    for i, g in enumerate(grad_outputs[:region.num_outputs]):
        # laid out as the backward's trace had them: contiguous (the hidden states; also a transposed key
        # written for later layers, whose tangent AOTAutograd made contiguous), or as traced; decided
        # from the region's expressions, so no size of the call is compared (no guard on a symbolic length)
        shape, stride, dtype, device = metas[i]
        if region.contiguous_tangents[i]:
            tangents.append(g.contiguous() if g is not None else torch.zeros(shape, dtype=dtype, device=device))
            continue
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        tangents.append(out.zero_() if g is None else out.copy_(g))
    grads = REGION_BACKWARD([*ctx.saved_tensors, *tangents], table, index)
    out: list[torch.Tensor | None] = [None] * ctx.num_inputs
    for i, g in zip(region.grad_inputs, grads):
        if ctx.wanted[i]:  # not the first layer's input gradient, computed only to share the region
            out[i] = g
    return out, None, None, None, None


region_op.register_autograd(_backward, setup_context=_setup_context)

REGION = torch.ops.poros.region.default
REGION_BACKWARD = torch.ops.poros.region_backward.default


def called_region(node: fx.Node) -> tuple[Region, str] | None:
    """``(region, "forward" | "backward")`` when ``node`` calls a compiled region (directly or through an
    RNG wrapper; ``passes/lower_regions.py`` marks them), else ``None``."""
    return node.meta.get(ROLE) if node.op == "call_function" else None


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


# -- the prepared layer's forward (traced by Dynamo) -----------------------------------------------------

def layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A prepared decoder layer's forward: under ``torch.compile`` one ``poros::region`` call, else the
    layer's own forward."""
    if torch.compiler.is_compiling() and self._poros_table is not None:
        flat = flatten_call(args, kwargs)
        if flat is not None:
            return call_region(self, *flat, carried=state_mapping(args, kwargs))
    elif not torch.compiler.is_compiling():
        check_not_merged(self)
    return type(self)._poros_layer_class.forward(self, *args, **kwargs)


def call_region(layer: nn.Module, activations: list[torch.Tensor], call: str, carried: Any = None) -> torch.Tensor:
    """Load the layer's base tensors and run it as one region. The layer's tensors come from the list
    ``prepare`` made (``_poros_own``, ``_poros_hosts``, ``_poros_block``; ``Packing`` says how they map
    to the layer's tensors): Dynamo walking ``named_parameters()`` generators cost ~0.5 s per layer,
    most of a deep model's compile, and every tensor it reads becomes a graph input of its own. The
    layer's mode and the caller's autocast join the call string, so Dynamo guards them
    (``key.mode_entry``, ``key.autocast_entry``). What the layer writes into ``carried`` (the state it
    passes to later layers, ``call.py``) are the region's further outputs, put back into it here
    (``_poros_writes``: the table set it when it found the region), and after them what transformers'
    hooks recorded inside the layer (``recorded.py``), appended to the caller's collector."""
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
    call = SEP.join(e for e in (call, autocast_entry(device), mode_entry(layer), record_entry()) if e)
    outputs = REGION(tensors, layer._poros_table, layer._poros_layer, call, grads)
    k = 1
    for key, count in layer._poros_writes:
        if key.startswith(RECORDED):
            append_recorded(key, tuple(outputs[k:k + count]))
        else:
            carried[key] = tuple(outputs[k:k + count])
        k += count
    return outputs[0]
