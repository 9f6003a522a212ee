"""The LM head and the causal-LM loss in vocabulary chunks: never the whole logits at once.

A causal LM's training step computes ``logits = hidden @ lm_head.weight.T`` (``[tokens, vocab]`` in
the model's dtype), and transformers' ``ForCausalLMLoss`` then makes an fp32 copy of all of it for
the cross-entropy: at seq 8192 and a 152k vocabulary that is 2.5 GB of bf16 logits and 5 GB in fp32,
and autograd saves them for the backward. ``chunked_causal_lm_loss`` computes the same loss one
slice of the head's rows (vocabulary entries) at a time:

    for each row chunk r:   logits_r = linear(hidden, W[r])        # [tokens, rows of r], model dtype
                            f_r = logits_r.float()
                            lse_r = logsumexp(f_r, -1)             # [tokens]   (a copy saved for the backward)
                            tgt_r = f_r[target] where the target is in r, else 0   # [tokens]
    lse = logsumexp(stack(lse_r), 0);  loss = sum over labelled tokens of (lse - sum_r tgt_r) / count

Under poros the head block's forward nodes are recomputed in the backward (``passes/recompute.py``)
except a copy of each ``lse_r`` (marked with ``torch.fx.traceback.annotate``, ``SAVE``): each chunk's
logits are recomputed from its reloaded rows right before that chunk's gradient, so the backward
holds one chunk's logits at a time and nothing of size ``tokens x vocab`` is saved. Streamed and
``stream=False`` run the same graph, so they are equal bit for bit.

The value is the cross-entropy ``ForCausalLMLoss`` computes (labels shifted by one, ``ignore_index``
-100, ``num_items_in_batch`` or the count of labelled tokens as the denominator, ``shift_labels``), but
not its bits: the softmax's normaliser is combined from per-chunk ``logsumexp``s and the tokens' losses
are summed in another order than ``nll_loss``'s. A model's eager loop equals the streamed one only when
it computes the loss with this same function (``tests/test_chunked_loss.py`` does).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import attention
from .errors import PorosConfigError

Rows = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor | None]"]

CHUNK = "poros_loss"  # meta["custom"] key on every node of the chunked head + loss
SAVE = "save"  # its value on the per-chunk results the backward reads (the rest is recomputed)
LOSS_CHUNK_ROWS = 8192  # automatic chunks: at most this many vocabulary rows each
IGNORE_INDEX = -100
ROW_ALIGN = 64  # vocabulary chunk boundaries fall on multiples of this many rows


def row_chunks(rows: int, count: int) -> tuple[tuple[int, int], ...]:
    """``count`` contiguous ``(start, stop)`` ranges covering ``rows`` rows, as even as they go, each
    boundary on a multiple of ``ROW_ALIGN`` rows where that leaves no range empty: a chunk's logits
    ``[tokens, stop - start]`` then have a row stride cuBLAS's aligned kernels take (152064 rows in 19
    chunks of 8003-8004 rows ran on its unaligned kernels, several times slower)."""
    even = [round(i * rows / count) for i in range(count + 1)]
    aligned = [round(b / ROW_ALIGN) * ROW_ALIGN for b in even[:-1]] + [rows]
    bounds = aligned if all(a < b for a, b in zip(aligned, aligned[1:])) else even
    return tuple(zip(bounds[:-1], bounds[1:]))


def loss_chunk_count(rows: int, head_chunks: int) -> int:
    """Vocabulary chunks of the chunked loss: the head's row chunks (its loading unit), or more when
    those hold over ``LOSS_CHUNK_ROWS`` rows each (one chunk's fp32 logits are tokens x rows x 4 bytes)."""
    return max(head_chunks, -(-rows // LOSS_CHUNK_ROWS))


def shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None = None,
                    ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The flat next-token targets ``ForCausalLMLoss`` scores (``labels`` shifted left, padded with
    ``ignore_index``), or ``shift_labels`` as given."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    return shift_labels.reshape(-1)


def chunked_causal_lm_loss(hidden: torch.Tensor, rows: Rows,
                           chunks: tuple[tuple[int, int], ...], labels: torch.Tensor, *,
                           num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                           shift_labels: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """The causal-LM cross-entropy of ``hidden`` (``[..., hidden_size]``, the final norm's output) under
    the head whose rows ``start:stop`` ``rows(start, stop)`` returns as ``(weight, bias or None)`` on
    ``hidden``'s device, one ``chunks`` range at a time (see the module docstring). ``softcap``: Gemma's
    ``final_logit_softcapping``, applied to each chunk's logits as the model applies it to all."""
    target = shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    lses, tgts = [], []
    for start, stop in chunks:
        with fx_traceback.annotate({CHUNK: start}):
            weight, bias = rows(start, stop)
            logits = nn.functional.linear(flat, weight, bias)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            f = logits.float()
            index = target - start
            inside = (index >= 0) & (index < stop - start)
            picked = f.gather(-1, index.clamp(0, stop - start - 1).unsqueeze(-1)).squeeze(-1)
            tgts.append(torch.where(inside, picked, torch.zeros_like(picked)))
            lse = torch.logsumexp(f, dim=-1)
        with fx_traceback.annotate({CHUNK: SAVE}):  # [tokens]: what the backward keeps of the chunk
            lses.append(lse.clone())
    with fx_traceback.annotate({CHUNK: "total"}):
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        picked = tgts[0]
        for t in tgts[1:]:
            picked = picked + t
        labelled = target != ignore_index
        total = torch.where(labelled, lse - picked, torch.zeros_like(lse)).sum()
        if num_items_in_batch is None:
            return total / labelled.sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def eager_rows(head: nn.Linear) -> Rows:
    """``rows`` for a plain (unprepared) ``nn.Linear`` head: slices of its weight and bias."""
    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return head.weight[start:stop], None if head.bias is None else head.bias[start:stop]

    return rows


# -- the prepared causal LM's forward --------------------------------------------------------------

PARAMETER_LORA_ATTR = "_poros_parameter_lora"  # set by prepare: a decoder layer has LoRA on a parameter
LM_ATTRS = ("_poros_chunked_loss", "_poros_loss_chunks", "_poros_loss_rows", "_poros_lm_class", "_poros_lm_params",
            "_poros_decoder", "_poros_no_training_cache", "_poros_lm_keywords", PARAMETER_LORA_ATTR)
# what a call may carry and still number each row's tokens 0..n-1 as one sequence (attention.ONE_SEQUENCE_PER_ROW)
ONE_SEQUENCE_KEYS = frozenset({"input_ids", "inputs_embeds", "labels", "use_cache", "num_items_in_batch",
                               "logits_to_keep", "return_dict", "shift_labels"})


def chunkable_head(head: nn.Module | None) -> bool:
    """Whether the chunked loss can read ``head`` a row range at a time: a frozen plain ``nn.Linear``."""
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and not head.weight.requires_grad)


def install(lm: nn.Module, decoder: str, rows: Rows | None,
            chunks: tuple[tuple[int, int], ...], chunked_loss: bool, no_training_cache: bool) -> Callable[[], None]:
    """Give the ``*ForCausalLM`` module ``lm`` a class whose forward, while gradients are on and labels
    are given and ``lm._poros_chunked_loss`` is set, runs its ``decoder`` submodule and
    ``chunked_causal_lm_loss`` over ``chunks`` with ``rows`` (``None``: the head cannot be chunked, and
    asking for it raises), and returns ``logits=None``; otherwise its own forward. While gradients are
    on, a call that asks for no cache (``use_cache`` and ``past_key_values`` not given) builds none when
    ``no_training_cache`` (a validated family: its layers fit regions without one). Returns the undo."""
    original = type(lm)

    @functools.wraps(original.forward)  # its signature: the Trainer keeps the dataset columns it names
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _causal_lm_forward(self, *args, **kwargs)

    lm.__class__ = type(original.__name__, (original,), {"__module__": original.__module__, "forward": forward})
    lm._poros_lm_class = original
    lm._poros_lm_params = tuple(inspect.signature(original.forward).parameters)[1:]  # positional names, self dropped
    lm._poros_decoder = decoder
    lm._poros_loss_rows = rows
    lm._poros_loss_chunks = chunks
    lm._poros_chunked_loss = False
    lm._poros_no_training_cache = no_training_cache
    lm._poros_lm_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD
                                for p in inspect.signature(original.forward).parameters.values())
    set_chunked_loss(lm, chunked_loss)

    def undo() -> None:
        lm.__class__ = original
        for attr in LM_ATTRS:
            lm.__dict__.pop(attr, None)

    return undo


def set_chunked_loss(lm: nn.Module, on: bool) -> None:
    """Switch the prepared ``lm``'s chunked loss on or off (Dynamo guards the flag: the next compiled
    call retraces the step when it changes)."""
    if not isinstance(on, bool):
        raise PorosConfigError(f"chunked_loss must be True or False, got {on!r}")
    if on and lm.__dict__.get("_poros_loss_rows") is None:
        raise PorosConfigError("chunked_loss=True: this model's output layer is not a frozen nn.Linear (a trainable "
                               "or quantized head, or none), so its logits cannot be computed a row range at a time")
    lm._poros_chunked_loss = on


def _causal_lm_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``*ForCausalLM.forward`` with the head and loss chunked (see ``install``)."""
    original = self._poros_lm_class.forward
    kwargs = {**dict(zip(self._poros_lm_params, args)), **kwargs}
    if (self._poros_no_training_cache and (torch.is_grad_enabled() or self.__dict__.get(PARAMETER_LORA_ATTR, False))
            and "use_cache" in self._poros_lm_params
            and kwargs.get("use_cache") is None and kwargs.get("past_key_values") is None):
        # a training step reads no cache; building one (transformers' default) breaks Dynamo's graph at
        # a sliding-window layer and keeps the decoder layers from running as regions (which LoRA on a
        # parameter needs in an evaluation without gradients too)
        kwargs["use_cache"] = False
    if (self._poros_lm_keywords and getattr(self.config, "_attn_implementation", None) == attention.NAME
            and all(value is None or key in ONE_SEQUENCE_KEYS for key, value in kwargs.items())):
        kwargs[attention.ONE_SEQUENCE_PER_ROW] = True
    if not self._poros_chunked_loss or not torch.is_grad_enabled() or kwargs.get("logits_to_keep", 0) != 0:
        return original(self, **kwargs)
    labels = kwargs.pop("labels", None)
    if labels is None:
        return original(self, **kwargs)
    kwargs.pop("logits_to_keep", None)
    outputs = self.get_submodule(self._poros_decoder)(**kwargs)
    loss = chunked_causal_lm_loss(outputs[0], self._poros_loss_rows, self._poros_loss_chunks, labels,
                                  num_items_in_batch=kwargs.get("num_items_in_batch"),
                                  shift_labels=kwargs.get("shift_labels"),
                                  softcap=getattr(self.config, "final_logit_softcapping", None))
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))
