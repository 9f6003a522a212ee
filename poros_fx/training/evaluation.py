"""Streamed evaluation (``poros-fx eval``): mean token loss and perplexity of a model on a dataset.

Apart from the command so that it can be called on any model, compiled with the poros backend or not:
the tests hold a streamed run against an unprepared fp32 one through this same function.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Callable, Optional

from ..io.data import eval_batches

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..io.data import TokenDataset


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What ``evaluate`` measured: the mean token loss over every supervised token, and its perplexity."""

    loss: float
    perplexity: float
    tokens: int
    rows: int
    batches: int
    batch_losses: list[float]  # the model's loss per batch (mean over that batch's supervised tokens)
    seconds: float


def evaluate(model: "nn.Module", dataset: "TokenDataset", batch_size: int, device: "torch.device | str",
             progress: Optional[Callable[[int, float], None]] = None) -> EvalResult:
    """Every row of ``dataset`` once, in order, through ``model`` under ``torch.no_grad()``: the loss is the
    mean over all supervised tokens (each batch's mean loss weighted by its token count, summed in float64),
    perplexity ``exp(loss)``. ``progress(batches_done, running_loss)`` after each batch."""
    import torch

    started = time.perf_counter()
    total, tokens, losses = 0.0, 0, []
    with torch.no_grad():
        for index, (batch, count) in enumerate(eval_batches(dataset, batch_size), 1):
            loss = float(model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss)
            losses.append(loss)
            total += loss * count
            tokens += count
            if progress is not None:
                progress(index, total / tokens)
    mean = total / tokens
    return EvalResult(loss=mean, perplexity=math.exp(mean) if mean < 700 else float("inf"), tokens=tokens,
                      rows=dataset.rows, batches=len(losses), batch_losses=losses, seconds=time.perf_counter() - started)
