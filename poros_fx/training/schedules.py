"""The learning rate of each optimizer step: warmup, then constant, linear or cosine decay.

Transformers' own schedule functions (``transformers.get_scheduler``), so a run of ``poros-fx train``
uses the learning rates a Hugging Face ``Trainer`` with the same settings would. The rate of step ``k``
(1-based) is read from the schedule's factor at ``k - 1`` and set on the optimizer before its step:
the same value ``LambdaLR`` gives after ``k - 1`` calls of ``scheduler.step()``, without a scheduler
state to save (a resumed run computes it from the step number).
"""

from __future__ import annotations

from typing import Callable

import torch

SCHEDULES = ("constant", "linear", "cosine")
# what transformers calls them
_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_factors(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """``factor(k)``: the multiplier of the base learning rate after ``k`` optimizer steps."""
    import transformers

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = transformers.get_scheduler(_NAMES[schedule], probe, num_warmup_steps=warmup_steps,
                                           num_training_steps=total_steps)
    return scheduler.lr_lambdas[0]


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, factor: Callable[[int], float], step: int) -> float:
    """Set the learning rate of 1-based optimizer ``step`` on every parameter group; returns it."""
    lr = base_lr * factor(step - 1)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
