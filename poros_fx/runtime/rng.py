"""The RNG wrappers' device implementations as plain functions (``passes/lower_rng.py`` calls them).

Each function is, line for line, the CPU or CUDA implementation that
``torch._prims.rng_prims.run_and_save_rng_state`` / ``run_with_rng_state`` dispatch to: the same
generator calls around the same op, so the saved states and the masks drawn are the same. One
difference: the CUDA ones name the op's device, where torch's read the current device's generator. What they
skip is the higher-order op's dispatch (key set, pytree flattening, the autograd-key wrapper), about
30 us a call on the CPU machine against a step bound by the host; a 32B step makes ~900 such calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

SAVE, RESTORE = "save", "restore"  # what a lowered wrapper node does (its meta["poros_rng"], passes/lower_rng.py)


def run_and_save_rng_state_cpu(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    return torch.get_rng_state(), op(*args, **kwargs)


def run_with_rng_state_cpu(rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    current_state = torch.get_rng_state()
    torch.set_rng_state(rng_state)
    out = op(*args, **kwargs)
    torch.set_rng_state(current_state)
    return out


def save_on(device: torch.device) -> Callable[..., tuple[torch.Tensor, Any]]:
    """``run_and_save_rng_state`` for ``device``. torch's CUDA implementation reads the *current*
    device's generator; the op's tensors may live on another (``prepare(device="cuda:1")`` while the
    step runs with device 0 current), so this one names the op's device."""
    if device.type == "cpu":
        return run_and_save_rng_state_cpu
    index = device.index if device.index is not None else torch.cuda.current_device()

    def run_and_save_rng_state_cuda(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        return torch.cuda.get_rng_state(index), op(*args, **kwargs)

    run_and_save_rng_state_cuda.__name__ = run_and_save_rng_state_cuda.__qualname__ = f"run_and_save_rng_state_cuda{index}"
    return run_and_save_rng_state_cuda


def restore_on(device: torch.device) -> Callable[..., Any]:
    """``run_with_rng_state`` for ``device`` (the backward runs on autograd's thread for the device,
    whose current device need not be the one the forward saved from; see ``save_on``)."""
    if device.type == "cpu":
        return run_with_rng_state_cpu
    index = device.index if device.index is not None else torch.cuda.current_device()

    def run_with_rng_state_cuda(rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
        current_state = torch.cuda.get_rng_state(index)
        torch.cuda.set_rng_state(rng_state.cpu(), index)
        out = op(*args, **kwargs)
        torch.cuda.set_rng_state(current_state, index)
        return out

    run_with_rng_state_cuda.__name__ = run_with_rng_state_cuda.__qualname__ = f"run_with_rng_state_cuda{index}"
    return run_with_rng_state_cuda


@dataclasses.dataclass(frozen=True)
class Generators:
    """The default random generators of ``devices`` (the CPU's, a CUDA device's), read and set together."""

    devices: tuple[torch.device, ...]

    def get(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.get_rng_state() if d.type == "cpu" else torch.cuda.get_rng_state(_index(d))
                     for d in self.devices)

    def set(self, states: Sequence[torch.Tensor]) -> None:
        for d, state in zip(self.devices, states):
            if d.type == "cpu":
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state, _index(d))

    @staticmethod
    def same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
