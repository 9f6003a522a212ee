"""Lower the partitioner's RNG wrappers to plain calls of their device implementation.

``run_and_save_rng_state`` (forward) and ``run_with_rng_state`` (backward) are higher-order ops:
each call goes through the dispatcher in Python (key set, pytree flattening, the autograd-key
wrapper) before it reaches the few lines that save or set the generator state — ~30 us a call on
the CPU machine, ~900 calls in a 32B step that is bound by the host launching work. This pass points
each wrapper at the function in ``poros_fx/runtime/rng.py`` that is, line for line, the
implementation the dispatcher would pick (CPU or CUDA, decided the way the dispatcher decides: a
CUDA tensor argument, else all-CPU tensor arguments, else the ``device`` keyword), with one change:
on CUDA it reads and sets the generator of the op's own device (``cuda:1`` in the example below),
where torch's reads the current device's, which on autograd's backward thread or under
``prepare(device="cuda:1")`` need not be the same. The node keeps its
name, so the schedule's RNG slots (``passes/rng.py``, which runs first) still name it, and says in
``meta["poros_rng"]`` whether it saves or restores the state. A wrapper on another device is left as it is.

Forward, before / after::

    run_and_save_rng_state = torch.ops.higher_order.run_and_save_rng_state(aten.native_dropout.default, view, 0.1, True)
    run_and_save_rng_state = run_and_save_rng_state_cuda1(aten.native_dropout.default, view, 0.1, True)

Backward::

    run_with_rng_state = torch.ops.higher_order.run_with_rng_state(rng_state_output_0, aten.native_dropout.default, view, 0.1, True)
    run_with_rng_state = run_with_rng_state_cuda1(rng_state_output_0, aten.native_dropout.default, view, 0.1, True)
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from poros_fx.runtime.draws import RNG_ROLE
from poros_fx.runtime.rng import RESTORE, SAVE, restore_on, save_on
from poros_fx.compiler.schedule import Schedule


def _device(args: tuple, kwargs: dict) -> torch.device | None:
    # a region's inputs are one list argument
    values = [a.meta.get("val") for a in pytree.tree_leaves(list(args)) if isinstance(a, fx.Node)]
    devices = {v.device for v in values if isinstance(v, torch.Tensor)}
    cuda = {d for d in devices if d.type == "cuda"}
    if cuda:
        return next(iter(cuda)) if len(cuda) == 1 else None
    if devices:
        return torch.device("cpu") if all(d.type == "cpu" for d in devices) else None
    device = kwargs.get("device")
    return torch.device(device) if device is not None else None


def lower_rng(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    # no recompile here: the backend generates the graph's code once, after the last pass
    for n in gm.graph.find_nodes(op="call_function", target=run_and_save_rng_state):
        device = _device(n.args[1:], n.kwargs)
        if device is not None and device.type in ("cpu", "cuda"):
            n.target = save_on(device)
            n.meta[RNG_ROLE] = SAVE  # block-major's draws read it (runtime/draws.py)
    for n in gm.graph.find_nodes(op="call_function", target=run_with_rng_state):
        device = _device(n.args[2:], n.kwargs)
        if device is not None and device.type in ("cpu", "cuda"):
            n.target = restore_on(device)
            n.meta[RNG_ROLE] = RESTORE
    return gm
