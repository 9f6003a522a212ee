"""Offload: the hidden states saved between blocks wait for the backward in host memory.

With ``offload_boundaries`` (``prepare``, ``options=``) a streamed training graph keeps no block
output on the device between its forward and its backward: what the partitioner saves at a block
boundary (the ``clone`` ``recompute`` marks ``MUST_SAVE`` and ``poros_boundary``, and any other saved activation of that
shape and dtype, e.g. the embedding's output) is copied to host memory right after it is made, and
the forward hands the backward the host copy. The backward copies it back to the device when the
block that reads it is loaded (its ``load_group``, one block ahead) and waits for it before its first
reader. The values are the same bytes, so the result is exact; what it costs is one device-to-host
and one host-to-device copy of one hidden state per block (on the copy stream, beside the weights).

Before (forward graph, saved tensors at the end of the output)::

    clone_default = aten.clone(getitem)                       # layer 0's output, saved
    ...
    return [loss, ..., clone_default, ...]

After::

    clone_default = aten.clone(getitem)
    offload = runtime.offload(clone_default)                  # host copy (CPU: a separate tensor)
    ...
    return [loss, ..., offload, ...]

Backward (its input keeps the name ``clone_default``)::

    load_group_3 = runtime.load_group([primals_4], cuda, 1)   # layer 0, prefetched
    reload = runtime.reload(clone_default, cuda)              # issued with it
    ...
    wait = runtime.wait(reload)                               # before the first reader
    region = ...(wait, ...)
"""

from __future__ import annotations

import torch
import torch.fx as fx
from poros_fx.compiler.schedule import Schedule

from .block_partition import BLOCK
from .recompute import BOUNDARY
from .rng import PHASE


def offload(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    if not (schedule.stream and schedule.offload_boundaries) or not schedule.blocks:
        return gm
    if gm.meta[PHASE] == "forward":
        _offload_saved(gm, schedule)
    else:
        _reload_saved(gm, schedule)
    gm.graph.lint()
    return gm


def _offload_saved(gm: fx.GraphModule, schedule: Schedule) -> None:
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    saved = [n for n in outputs[schedule.num_fwd_outputs:] if isinstance(n, fx.Node) and n.op != "placeholder"]
    marked = [n for n in saved if n.meta.get(BOUNDARY) and _tensor(n) is not None]
    kinds = {_kind(n) for n in marked}
    boundaries = [n for n in saved if _tensor(n) is not None and _tensor(n).dtype.is_floating_point
                  and _kind(n) in kinds]
    replaced: dict[fx.Node, fx.Node] = {}
    for n in boundaries:
        with graph.inserting_after(n):
            host = graph.call_function(schedule.runtime.offload, (n,))
        host.meta = {"val": n.meta.get("val"), BLOCK: n.meta.get(BLOCK)}
        replaced[n] = host
    schedule.offloaded = [n.name for n in boundaries]
    output.args = ([replaced.get(n, n) if i >= schedule.num_fwd_outputs else n for i, n in enumerate(outputs)],)


def _reload_saved(gm: fx.GraphModule, schedule: Schedule) -> None:
    graph = gm.graph
    names = set(schedule.offloaded)
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    groups = [n for n in nodes if getattr(n.target, "__name__", "") == "load_group"]
    for placeholder in [n for n in graph.find_nodes(op="placeholder") if n.name in names]:
        if not placeholder.users:
            continue
        first = min(placeholder.users, key=position.__getitem__)
        # issued with the group of the block that reads it (one block ahead), else right before it
        issued = [g for g in groups if g.args[2] == first.meta.get(BLOCK) and position[g] < position[first]]
        anchor = issued[-1].next if issued else first
        with graph.inserting_before(anchor):
            reload = graph.call_function(schedule.runtime.reload, (placeholder, _device(schedule)))
        reload.meta = {"val": placeholder.meta.get("val"), BLOCK: first.meta.get(BLOCK)}
        value = reload
        if schedule.runtime.overlap:
            with graph.inserting_before(first):
                value = graph.call_function(schedule.runtime.wait, (reload,))
            value.meta = dict(reload.meta)
        placeholder.replace_all_uses_with(value, delete_user_cb=lambda user: user is not reload)


def _tensor(n: fx.Node) -> torch.Tensor | None:
    val = n.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _kind(n: fx.Node) -> tuple[str, torch.dtype]:
    """Shape (its symbols as text: sizes may be symbolic) and dtype of a node's tensor."""
    return str(tuple(_tensor(n).shape)), _tensor(n).dtype


def _device(schedule: Schedule) -> torch.device:
    return schedule.device
