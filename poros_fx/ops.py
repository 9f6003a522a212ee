"""Custom ops that make host-resident weights traceable: ``poros::load`` and ``poros::gather``.

``poros::load(host, device)`` is the one op through which every frozen base tensor reaches the
computation. It is *pure* (its output never aliases its input), so Dynamo, AOTAutograd and the
min-cut partitioner treat it like any other functional op: it can be tagged for recompute, it is
never saved for the backward, and its fake impl puts the result on the target device so fake-tensor
propagation sees device tensors only. After partitioning, the residency pass replaces each call by
the runtime's own load (ledger, cache, copy stream), so this eager impl only runs outside compiled
graphs (for example when user code reads ``module.weight`` of a prepared model).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("poros::load", mutates_args=())
def load(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of a host-store tensor (always a new tensor, never a view of ``host``)."""
    return host.to(device, copy=True)


@load.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


LOAD = torch.ops.poros.load.default


@torch.library.custom_op("poros::gather", mutates_args=())
def gather(host: torch.Tensor, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``indices`` of the host-store table ``host`` on ``device``: an embedding lookup that copies
    only the rows a batch reads (a 72B's table is 2.5 GB; 512 rows of it are 8 MB). The values are
    the table's own bytes, as ``F.embedding`` on a device copy of the table gives them."""
    rows = host.index_select(0, indices.reshape(-1).to("cpu"))
    return rows.view(*indices.shape, host.shape[1]).to(device)


@gather.register_fake
def _(host: torch.Tensor, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.new_empty((*indices.shape, host.shape[1]), device=device)


GATHER = torch.ops.poros.gather.default
