"""The RNG wrappers' device implementations as plain functions (``passes/lower_rng.py`` calls them).

Each function is, line for line, the CPU or CUDA implementation that
``torch._prims.rng_prims.run_and_save_rng_state`` / ``run_with_rng_state`` dispatch to: the same
generator calls around the same op, so the saved states and the masks drawn are the same. What they
skip is the higher-order op's dispatch (key set, pytree flattening, the autograd-key wrapper), about
30 us a call on the CPU machine against a step bound by the host; a 32B step makes ~900 such calls.
"""

from __future__ import annotations

from typing import Any

import torch


def run_and_save_rng_state_cpu(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    return torch.get_rng_state(), op(*args, **kwargs)


def run_and_save_rng_state_cuda(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    return torch.cuda.get_rng_state(), op(*args, **kwargs)


def run_with_rng_state_cpu(rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    current_state = torch.get_rng_state()
    torch.set_rng_state(rng_state)
    out = op(*args, **kwargs)
    torch.set_rng_state(current_state)
    return out


def run_with_rng_state_cuda(rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    current_state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(rng_state.cpu())
    out = op(*args, **kwargs)
    torch.cuda.set_rng_state(current_state)
    return out


SAVE = {"cpu": run_and_save_rng_state_cpu, "cuda": run_and_save_rng_state_cuda}
RESTORE = {"cpu": run_with_rng_state_cpu, "cuda": run_with_rng_state_cuda}
