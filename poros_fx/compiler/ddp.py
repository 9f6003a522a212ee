"""Dynamo's DDPOptimizer and poros graphs: the check the backend makes, and the switch that turns it off.

Inside a ``DistributedDataParallel`` forward, Dynamo's DDPOptimizer takes over every frame Dynamo
converts, and it converts them without leaving the fake-tensor mode of the graph being traced; the
``torch.cond`` of ``poros_sdpa`` that a region traces inside the op's fake implementation then fails. It
would split nothing useful anyway: a region takes its adapter as one list argument, which the bucket
count does not see, and a split that did happen would fall between a block's load and its use. The
adapter's gradients are all-reduced once at the end of the backward instead (LoRA gradients are a few
MB). ``poros_fx.distributed`` re-exports these names for users.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import PorosConfigError

DDP_OPTIMIZER_MESSAGE = (
    "Dynamo's DDPOptimizer is on (torch._dynamo.config.optimize_ddp, True by default) while a "
    "DistributedDataParallel forward is being compiled with backend='poros': it converts the frames of the "
    "decoder-layer regions inside the fake-tensor mode of the outer trace and fails on their torch.cond, and a graph "
    "split at its bucket boundaries would cut a block from its load. Turn it off for poros graphs: set "
    "torch._dynamo.config.optimize_ddp = False before the first step, or call the compiled model inside "
    "`with poros_fx.distributed.no_ddp_optimizer():` (every call: a new sequence length compiles again). The adapter's "
    "gradients are then all-reduced once at the end of the backward.")


def ddp_optimizer_active() -> bool:
    """Whether Dynamo's DDPOptimizer would take over a frame converted now: ``optimize_ddp`` is in its
    ``ddp_optimizer`` mode and a DistributedDataParallel forward is running."""
    mode = torch._dynamo.config.optimize_ddp  # True and "ddp_optimizer" are the same mode
    return mode in (True, "ddp_optimizer") and DistributedDataParallel._get_active_ddp_module() is not None


def check_ddp_optimizer() -> None:
    """Raise ``PorosConfigError`` (saying how to turn it off) when Dynamo's DDPOptimizer is in charge of
    the graph being compiled now (see the module docstring for why poros graphs need it off)."""
    if ddp_optimizer_active():
        raise PorosConfigError(DDP_OPTIMIZER_MESSAGE)


@contextlib.contextmanager
def no_ddp_optimizer() -> Iterator[None]:
    """Dynamo's DDPOptimizer off inside the block (``torch._dynamo.config.optimize_ddp = False``), the
    setting restored after. Wrap every call of a compiled DDP model in it: Dynamo reads the setting each
    time it compiles, and a new input shape compiles again."""
    with torch._dynamo.config.patch(optimize_ddp=False):
        yield
