"""Several GPUs on one host: data parallelism on ``torch.distributed``, one host copy of the frozen base.

Each rank (one process per GPU, started by ``torchrun``) trains the same adapter on its share of the
data; ``DistributedDataParallel`` all-reduces the adapter's gradients as usual. What must not be
copied N times is the frozen base, so:

* **One host store per host** (``HostShare``, ``runtime/share.py``): the ranks of a host (those that
  see one ``/dev/shm``) agree over a gloo group on one shared arena; its leader fills it and the others
  map it. Each rank page-locks its own mapping for its own GPU (``prepare``).
* **DDP around a prepared model** (``data_parallel``, ``ignore_host_store``): the host-store tensors
  are CPU tensors while the adapter is on the GPU; DDP refuses a module on two device types and
  would broadcast every parameter and buffer from rank 0 at start-up and every buffer before each
  forward. The host-store parameters and buffers go on DDP's ignore list: only the adapter is
  checked, broadcast and all-reduced.
* **Dynamo's DDPOptimizer off for poros graphs** (``no_ddp_optimizer``, ``check_ddp_optimizer``,
  ``compiler/ddp.py``): inside a DDP forward it would convert the regions' frames inside the outer
  trace's fake mode, and split nothing useful.

This module is the users' surface: it also re-exports the names of those two modules.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .compiler.ddp import DDP_OPTIMIZER_MESSAGE, check_ddp_optimizer, ddp_optimizer_active, no_ddp_optimizer
from .errors import PorosConfigError
from .handles import ENTRY_ATTR, get_store
from .runtime.share import SHARE_TIMEOUT, HostShare, Ranks, host_key, launched_ranks, wants_share

__all__ = ["DDP_OPTIMIZER_MESSAGE", "SHARE_TIMEOUT", "HostShare", "Ranks", "check_ddp_optimizer", "data_parallel",
           "ddp_optimizer_active", "host_key", "host_store_names", "ignore_host_store", "init_process_group",
           "launched_ranks", "no_ddp_optimizer", "rank_device", "wants_share"]


def rank_device(ranks: Ranks | None = None) -> torch.device:
    """The compute device of this rank: ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU."""
    ranks = launched_ranks() if ranks is None else ranks
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        raise PorosConfigError(f"local rank {ranks.local_rank} has no GPU of its own: torch sees {count} GPU(s) on "
                               f"this host; start at most {count} processes per host (torchrun --nproc-per-node "
                               f"{count}) or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", ranks.local_rank)


def init_process_group(timeout: datetime.timedelta | None = None) -> Ranks:
    """``torch.distributed.init_process_group`` from torchrun's environment, unless it is initialized
    already: NCCL with this rank's GPU selected when CUDA is there, gloo otherwise. Returns the ranks."""
    ranks = launched_ranks()
    if not dist.is_available():
        raise PorosConfigError("this torch build has no torch.distributed; several GPUs need it")
    if dist.is_initialized():
        return ranks
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        raise PorosConfigError("no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...): start the job with "
                               "`torchrun --nproc-per-node N ...` (or call torch.distributed.init_process_group "
                               "yourself before poros-fx)")
    device = rank_device(ranks)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return ranks


# -- DDP around a prepared model ----------------------------------------------------------------------

def host_store_names(model: nn.Module) -> list[str]:
    """Qualified names (as ``model.named_parameters()`` / ``named_buffers()`` give them) of every
    parameter and buffer of ``model`` that lives in a poros host store."""
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, ENTRY_ATTR)]
    names += [n for n, b in model.named_buffers(remove_duplicate=False) if hasattr(b, ENTRY_ATTR)]
    return names


def ignore_host_store(model: nn.Module) -> list[str]:
    """Put the host-store tensors of a prepared ``model`` on DDP's ignore list (before wrapping it):
    DDP then checks, broadcasts and all-reduces the adapter only. Returns the names ignored."""
    if get_store(model) is None:
        raise PorosConfigError("the model is not prepared: call poros_fx.prepare(model) (or load it with "
                               "poros_fx.load_pretrained / from_config) before wrapping it in DistributedDataParallel; "
                               "DDP would otherwise see the whole frozen base as its parameters")
    if hasattr(model, "_orig_mod"):
        raise PorosConfigError("wrap the prepared model itself in DistributedDataParallel and torch.compile the DDP "
                               "module (torch.compile(DDP(model), backend='poros')), not the other way around")
    names = host_store_names(model)
    known = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(known | set(names)))
    return names


def data_parallel(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(model, ...)`` for a prepared ``model``: host-store tensors ignored
    (``ignore_host_store``), ``device_ids`` set to the adapter's GPU on CUDA. Compile the result with
    ``torch.compile(ddp, backend="poros")`` and run it with Dynamo's DDPOptimizer off
    (``no_ddp_optimizer``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise PorosConfigError("torch.distributed is not initialized: start the job with torchrun and call "
                               "poros_fx.distributed.init_process_group() (or torch.distributed.init_process_group) "
                               "before data_parallel")
    ignore_host_store(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise PorosConfigError("the prepared model has no trainable parameters (no adapter, or a frozen one): there "
                               "is nothing for DistributedDataParallel to all-reduce")
    device = trainable[0].device
    if device.type == "cuda" and "device_ids" not in ddp_kwargs:
        ddp_kwargs["device_ids"] = [device.index]
    return DistributedDataParallel(model, **ddp_kwargs)



