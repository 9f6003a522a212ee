"""One compile for every sequence length: a batch's sizes marked dynamic before the compiled model sees it.

Dynamo compiles a graph for the sizes of the first call and, when a later call brings other sizes,
compiles once more with those sizes as symbols (its "automatic dynamic shapes"); from then on every
length runs that graph. The regions inside are symbolic from their first trace (``compiler/regions``),
so that second compile re-traces no layer, but it is still a second capture of the whole step.
``mark_dynamic`` asks Dynamo for symbolic sizes from the first call: every dimension of every tensor
in the batch (sizes 0 and 1 stay numbers, Dynamo's rule; a dimension the model fixes, such as a
hidden size, is specialized without a recompile). ``@poros_fx.step``, ``PorosTrainer``,
``poros_fx.block_major`` and ``poros-fx train`` do it for you; call it on your own batches before a
plain ``torch.compile(model, backend="poros")`` call to skip the second compile::

    batch = poros_fx.mark_dynamic({"input_ids": ids, "labels": ids})
    loss = step_model(**batch).loss
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

B = TypeVar("B")


def mark_dynamic(batch: B) -> B:
    """``batch`` (a tensor, or mappings / lists / tuples of them) with every tensor's dimensions marked
    dynamic for Dynamo (``torch._dynamo.maybe_mark_dynamic``); returns ``batch`` itself."""
    if isinstance(batch, torch.Tensor):
        for dim in range(batch.dim()):
            torch._dynamo.maybe_mark_dynamic(batch, dim)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            mark_dynamic(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            mark_dynamic(value)
    return batch


# the longest packed sequence's length, as TRL's padding-free collator adds it: read by flash attention's
# variable-length kernels only
FLASH_LENGTHS = ("max_length_q", "max_length_k")


def without_flash_lengths(batch: Mapping, config: object) -> Mapping:
    """``batch`` without ``FLASH_LENGTHS`` unless the model (``config``) runs flash attention; else ``batch``
    itself. They are Python ints: Dynamo compiles the step again for each new value, and after a few makes
    them symbolic, which a region's call cannot take (the layer would leave the region). The attention
    poros runs reads the sequence boundaries from the position ids."""
    implementation = getattr(config, "_attn_implementation", None) or ""
    if implementation.startswith("flash") or not any(k in batch for k in FLASH_LENGTHS):
        return batch
    return {k: v for k, v in batch.items() if k not in FLASH_LENGTHS}
