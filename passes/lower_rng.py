"""Lower the partitioner's RNG wrappers to plain calls of their device implementation.

``run_and_save_rng_state`` (forward) and ``run_with_rng_state`` (backward) are higher-order ops:
each call goes through the dispatcher in Python (key set, pytree flattening, the autograd-key
wrapper) before it reaches the few lines that save or set the generator state — ~30 us a call on
the CPU machine, ~900 calls in a 32B step that is bound by the host launching work. This pass points
each wrapper at the function in ``poros_fx/runtime/rng.py`` that is, line for line, the
implementation the dispatcher would pick (CPU or CUDA, decided the way the dispatcher decides: a
CUDA tensor argument, else all-CPU tensor arguments, else the ``device`` keyword). The node keeps its
name, so the schedule's RNG slots (``passes/rng.py``, which runs first) still name it. A wrapper on
another device is left as it is.

Forward, before / after::

    run_and_save_rng_state = torch.ops.higher_order.run_and_save_rng_state(aten.native_dropout.default, view, 0.1, True)
    run_and_save_rng_state = poros_fx_runtime_rng_run_and_save_rng_state_cuda(aten.native_dropout.default, view, 0.1, True)

Backward::

    run_with_rng_state = torch.ops.higher_order.run_with_rng_state(rng_state_output_0, aten.native_dropout.default, view, 0.1, True)
    run_with_rng_state = poros_fx_runtime_rng_run_with_rng_state_cuda(rng_state_output_0, aten.native_dropout.default, view, 0.1, True)
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from poros_fx.runtime.rng import RESTORE, SAVE
from poros_fx.compiler.schedule import Schedule


def _device_type(args: tuple, kwargs: dict) -> str | None:
    # a region's inputs are one list argument
    values = [a.meta.get("val") for a in pytree.tree_leaves(list(args)) if isinstance(a, fx.Node)]
    types = {v.device.type for v in values if isinstance(v, torch.Tensor)}
    if "cuda" in types:
        return "cuda"
    if types:
        return "cpu" if types == {"cpu"} else None
    device = kwargs.get("device")
    return torch.device(device).type if device is not None else None


def lower_rng(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    # no recompile here: the backend generates the graph's code once, after the last pass
    for n in gm.graph.find_nodes(op="call_function", target=run_and_save_rng_state):
        impl = SAVE.get(_device_type(n.args[1:], n.kwargs))
        if impl is not None:
            n.target = impl
    for n in gm.graph.find_nodes(op="call_function", target=run_with_rng_state):
        impl = RESTORE.get(_device_type(n.args[2:], n.kwargs))
        if impl is not None:
            n.target = impl
    return gm

