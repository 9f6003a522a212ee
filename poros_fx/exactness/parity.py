"""Train the same recipe two ways and compare every surface with ``torch.equal``.

``train(model, batches, ...)`` runs AdamW steps (with gradient accumulation) on ``model`` as given
(eager, or compiled through the poros backend) and records, per optimizer step: the loss of each
micro-batch, the adapter gradient norm, the adapter weights and the full optimizer state.
``compare(a, b)`` gives the largest absolute difference per surface (0.0 means bit-identical,
checked with ``torch.equal``, never a tolerance).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from ..prepare import prepare
from ..runtime.accumulate import block_major as block_major_step


@dataclasses.dataclass
class Trace:
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # one per micro-batch
    grad_norms: list[torch.Tensor] = dataclasses.field(default_factory=list)  # one per optimizer step
    weights: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)  # adapter, after each step
    optimizer: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)  # exp_avg, exp_avg_sq, step


SURFACES = ("loss", "weights", "grad_norms", "optimizer")


def adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.AdamW:
    """The optimizer ``train`` uses: AdamW over the trainable (adapter) parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)


def train(model: nn.Module, step_model: Callable, batches: Sequence[dict], *, accumulate: int = 1, lr: float = 1e-3,
          seed: int | None = 1234, optimizer: torch.optim.Optimizer | None = None, block_major: bool = False) -> Trace:
    """``len(batches) // accumulate`` AdamW steps; ``step_model`` is ``model`` or its compiled form.

    ``seed`` seeds the global generator the dropout masks come from (``None``: leave it as it is, to
    continue a run); ``optimizer`` continues with a given optimizer instead of a fresh ``adamw(model)``;
    ``block_major``: each optimizer step's micro-batches run inside ``poros_fx.block_major`` (a prepared
    model; ``runtime/accumulate.py``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer if optimizer is not None else adamw(model, lr)
    if seed is not None:
        torch.manual_seed(seed)
    trace = Trace()
    for start in range(0, len(batches) - accumulate + 1, accumulate):
        micro_batches = list(batches[start:start + accumulate])
        with block_major_step(model, micro_batches) if block_major else contextlib.nullcontext():
            for batch in micro_batches:
                loss = step_model(**batch, use_cache=False).loss / accumulate
                loss.backward()
                trace.losses.append(loss.detach().clone())
        optimizer_step(trace, params, opt)
    return trace


def train_as(model: nn.Module, mode: str, batches: Sequence[dict], *, accumulate: int = 1,
             device: str | torch.device = "cpu", codegen: str = "eager") -> Trace:
    """Train ``model`` as ``mode`` runs it: ``"eager"`` (the plain loop on the model itself), ``"stream"``
    (prepared and compiled, block-major) or ``"resident"`` (prepared and compiled with ``stream=False``)."""
    step_model: Callable = model
    if mode != "eager":
        prepare(model, device=device, codegen=codegen)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    return train(model, step_model, batches, accumulate=accumulate, block_major=mode == "stream")


def optimizer_step(trace: Trace, params: Sequence[torch.Tensor], opt: torch.optim.Optimizer) -> None:
    """Record the gradient norm, step the (Adam-family) optimizer, then record weights and its state."""
    trace.grad_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
    opt.step()
    opt.zero_grad(set_to_none=True)
    trace.weights.append([p.detach().clone() for p in params])
    trace.optimizer.append([t.detach().clone() for p in params for t in (opt.state[p]["exp_avg"],
                            opt.state[p]["exp_avg_sq"], opt.state[p]["step"])])


def steps(trace: Trace, start: int, stop: int | None = None, *, accumulate: int = 1) -> Trace:
    """Optimizer steps ``start`` to ``stop`` (exclusive; ``None``: to the end) of ``trace``."""
    cut = slice(start, stop)
    micro = slice(start * accumulate, None if stop is None else stop * accumulate)
    return Trace(losses=trace.losses[micro], grad_norms=trace.grad_norms[cut], weights=trace.weights[cut],
                 optimizer=trace.optimizer[cut])


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if torch.equal(x, y):
            continue
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, (x.double() - y.double()).abs().max().item(), float.fromhex("0x1p-1074"))
    return worst


def compare(a: Trace, b: Trace) -> dict[str, float]:
    """Largest absolute difference per surface; 0.0 only when every tensor is ``torch.equal``."""
    return {
        "loss": _max_diff(a.losses, b.losses),
        "weights": max((_max_diff(x, y) for x, y in zip(a.weights, b.weights)), default=0.0)
        if len(a.weights) == len(b.weights) else float("inf"),
        "grad_norms": _max_diff(a.grad_norms, b.grad_norms),
        "optimizer": max((_max_diff(x, y) for x, y in zip(a.optimizer, b.optimizer)), default=0.0)
        if len(a.optimizer) == len(b.optimizer) else float("inf"),
    }


def mode_toggles(model: nn.Module, step_model: Callable, batches: Sequence[dict]
                 ) -> tuple[list[torch.Tensor], Callable[..., None]]:
    """A user's mode changes over ``batches[:4]``: a training step, eval with grad, eval under
    ``no_grad``, the adapter switched off; returns the losses and gradients recorded (in order) and the
    ``step(batch, backward=True)`` that recorded them, for the caller to go on."""
    params = [p for p in model.parameters() if p.requires_grad]
    out: list[torch.Tensor] = []
    torch.manual_seed(7)

    def step(batch: dict, backward: bool = True) -> None:
        loss = step_model(**batch, use_cache=False).loss
        out.append(loss.detach())
        if backward:
            loss.backward()
            out.extend(p.grad.clone() for p in params if p.grad is not None)
            model.zero_grad(set_to_none=True)

    model.train()
    step(batches[0])
    model.eval()
    step(batches[1])
    with torch.no_grad():
        step(batches[2], backward=False)
    model.train()
    with model.disable_adapter():
        step(batches[3], backward=False)
    return out, step


def format_diffs(label: str, diffs: dict[str, float]) -> str:
    return f"{label:<28} " + "  ".join(f"{k}={v:.2e}" for k, v in diffs.items())
