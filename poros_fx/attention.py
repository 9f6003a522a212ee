"""SDPA attention under ``torch.compile`` that calls the kernel the eager model calls.

Eager, transformers' ``sdpa_mask`` looks at the padding mask's *values*: with no padding (no mask,
or a mask of ones) it returns no mask, and the attention runs SDPA with ``is_causal=True`` (and, for
grouped-query heads, ``enable_gqa=True``); with padding it builds a boolean mask and SDPA runs with
``attn_mask`` over repeated key/value heads. Under Dynamo (torch < 2.14) ``sdpa_mask`` cannot read
values, so it always builds the mask: a compiled step runs another SDPA kernel than the user's eager
loop, and the two part by a few ulps from seq ~40 on (CPU fp32) and ~1e-3 in NF4 on the GPU.

``prepare`` switches a model whose attention is ``"sdpa"`` to ``"poros_sdpa"`` (registered here through
transformers' ``AttentionInterface`` / ``AttentionMaskInterface``; nothing of torch or transformers is
patched). Eager, both functions are transformers' own. Compiled, the mask function returns the mask
*and* eager's decision as a tensor, ``(mask, no_mask_needed)``, and the attention function branches
on it with ``torch.cond``: the ``is_causal`` kernel when eager would have skipped the mask, the masked
kernel otherwise. The decision is computed once per forward and moved to the host, so the branch
costs no device sync per layer. With no padding mask (transformers then composes a packed-sequence mask
from the position ids, which it cannot read under compile) the pair is ``(sequence numbers, one
sequence per row)``: each token's sequence, ``[batch, length]``, read off one diagonal of the mask
function, and the masked branch builds the mask from them, so a step whose rows hold one sequence each
never makes the ``[batch, 1, length, length]`` mask (4.3 GB at 65536 tokens). A call that passes no
position ids, padding mask or cache at all (the prepared causal LM then adds ``ONE_SEQUENCE_PER_ROW``
to the layers' keywords) has one sequence per row by construction: its attention calls the
``is_causal`` kernel directly, with no cond (and none of the masked kernel's tracing). Graph, per attention (``q`` query, ``pred`` on the CPU)::

    before:  sdpa = aten.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
    after:   cond = higher_order.cond(pred, true_graph, false_graph, (q, k, v, mask))
             #  true_graph:  aten.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
             #  false_graph: aten.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._higher_order_ops.cond import cond_op
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .errors import PorosConfigError
from .handles import text_config

ATTENTION_DROPOUT_MESSAGE = (
    "attention dropout ({key}={dropout}) while training: the SDPA kernel draws its dropout mask inside the kernel "
    "eager's mask decision branches to, and a branch's backward runs it again with fresh numbers, so the "
    "gradients would not be exact. Set model.config.{key} = 0.0, or load the model with "
    "attn_implementation='eager' (its attention dropout is an op of its own, replayed exactly)")
OVERLAY_MESSAGE = ("poros_sdpa: this model's causal mask lets a token attend to a later one (a bidirectional "
                   "block overlay); train it with attn_implementation='eager'")
NAME = "poros_sdpa"  # the attention implementation a prepared model's config names
# a layer-call keyword the prepared causal LM adds when its call gave no position ids, padding mask or
# cache: the model then numbers each row's tokens 0..n-1 itself, so every row is one sequence and eager
# runs the ``is_causal`` kernel; the attention calls it directly instead of tracing both kernels in a cond
ONE_SEQUENCE_PER_ROW = "poros_one_sequence_per_row"
WRAPS = "sdpa"  # the implementation it stands in for


def register() -> None:
    """Make ``"poros_sdpa"`` known to transformers (idempotent; ``GeneralInterface.register``)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")  # transformers' names


def check_no_dropout(config: Any) -> None:
    """Refuse attention dropout on a model whose attention is ``"sdpa"`` (``ATTENTION_DROPOUT_MESSAGE``)."""
    if getattr(config, "_attn_implementation", None) not in (WRAPS, NAME):
        return
    text = text_config(config)
    for key in ATTENTION_DROPOUT_KEYS:
        dropout = getattr(text, key, 0.0) or 0.0
        if dropout:
            raise PorosConfigError(ATTENTION_DROPOUT_MESSAGE.format(key=key, dropout=dropout))


def use(config: Any) -> Callable[[], None] | None:
    """Switch ``config`` (and its sub-configs) from ``"sdpa"`` to ``"poros_sdpa"``; returns the undo,
    or ``None`` when the model does not use SDPA (eager attention already matches)."""
    if getattr(config, "_attn_implementation", None) != WRAPS:
        return None
    register()
    config._attn_implementation = NAME

    def undo() -> None:
        if config._attn_implementation == NAME:
            config._attn_implementation = WRAPS

    return undo


class MaskPair(tuple):
    """``(mask, no_mask_needed)``, as ``mask`` returns it under compile. Gemma 4 indexes its masks before
    its KV-shared layers (``mask[:, :, slice(-logits_to_keep, None), :]``, every query row in training:
    ``logits_to_keep=0``); such an index reaches the mask itself. An index that drops query rows would
    change eager's kernel decision: refused."""

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return tuple.__getitem__(self, key)
        if any(not isinstance(k, slice) or k != slice(None) and k != slice(0, None) for k in key):
            raise NotImplementedError("poros_sdpa: a mask indexed to fewer query rows (logits_to_keep > 0 before "
                                      "KV-shared layers) is not supported while training")
        mask_or_sequences = tuple.__getitem__(self, 0)
        if mask_or_sequences.dim() == 2:  # sequence numbers (every query row kept: the same mask)
            return self
        return MaskPair((mask_or_sequences[key], tuple.__getitem__(self, 1)))


def _static_skip(q_length: int, kv_length: int, q_offset: Any, local_size: int | None) -> tuple[bool, bool]:
    """The parts of transformers' ``_ignore_causal_mask_sdpa`` that depend on sizes only: whether the
    mask may be skipped when the padding mask is all ones (first), and when its first ``q_length``
    entries are ones and the rest zeros (second)."""
    if isinstance(q_offset, torch.Tensor) or (local_size is not None and kv_length >= local_size):
        return False, False
    return q_length == 1 or kv_length == q_length, q_offset == 0


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
         mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
         local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    """``sdpa_mask``, with eager's value-dependent skip kept under ``torch.compile`` (see module doc)."""
    from transformers.masking_utils import causal_mask_function, fast_all, prepare_padding_mask, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                local_size=local_size, **kwargs)
    if not torch.compiler.is_compiling():
        return sdpa_mask(allow_is_causal_skip=allow_is_causal_skip, **args)
    all_ones_ok, prefix_ok = _static_skip(q_length, kv_length, q_offset, local_size)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if not allow_is_causal_skip:
        if padding is None and not kwargs.get("use_vmap", False) and all_ones_ok:
            # Without a padding mask, create_causal_mask looks for packed sequences in the position ids;
            # it cannot read them under compile, so it composes a packed-sequence mask and forbids the
            # skip. Eager skips when each row holds one sequence, i.e. when the mask is plain causal.
            if q_offset == 0 and kv_offset == 0 and q_length == kv_length:
                segments, one_sequence = _sequence_indices(mask_function, batch_size, q_length, kwargs.get("device"))
                return MaskPair((segments, one_sequence.cpu()))
            full = sdpa_mask(allow_is_causal_skip=False, **args)
            causal = torch.ones(q_length, kv_length, dtype=torch.bool, device=full.device).tril()
            return MaskPair((full, (full == causal).all().cpu()))
        return sdpa_mask(allow_is_causal_skip=False, **args)  # eager materializes it too
    if padding is None:
        if all_ones_ok or prefix_ok:
            return None  # what eager returns: SDPA's is_causal path
        return sdpa_mask(allow_is_causal_skip=False, **args)
    if not (all_ones_ok or prefix_ok):
        return sdpa_mask(allow_is_causal_skip=False, **args)
    if padding.shape[-1] > kv_length:
        padding = padding[:, torch.arange(kv_length, device=padding.device) + kv_offset]
    skip = torch.zeros((), dtype=torch.bool, device=padding.device)
    if all_ones_ok:
        skip = skip | fast_all(padding)
    if prefix_ok:
        skip = skip | (fast_all(padding[:, :q_length]) & fast_all(~padding[:, q_length:]))
    # one copy to the host per forward: every layer's branch then reads a CPU scalar, no device sync
    return MaskPair((sdpa_mask(allow_is_causal_skip=False, **args), skip.cpu()))


def _sequence_indices(mask_function: Callable, batch_size: Any, length: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """For a causal mask within packed sequences (``create_causal_mask``'s composition from the position
    ids): each token's sequence number ``[batch, length]`` and whether every row is one sequence. Token
    ``q`` starts a sequence where it does not see token ``q - 1``; read off the mask function on that
    diagonal only, O(batch * length), where the full mask is O(length^2)."""
    rows = torch.arange(batch_size, device=device)[:, None]
    after = torch.arange(1, length, device=device)[None, :]
    sees_previous = mask_function(rows, 0, after, after - 1).expand(batch_size, length - 1)
    # a bidirectional overlay (blocks of image tokens, ``or_masks``) lets a token see the next one: such a
    # mask is more than sequences, and is refused rather than rebuilt wrong
    torch._assert_async(~mask_function(rows, 0, after - 1, after).any(), OVERLAY_MESSAGE)
    starts = (~sees_previous).to(torch.long).cumsum(-1)
    segments = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=-1)
    return segments, sees_previous.all()


def _mask_of_sequences(segments: torch.Tensor) -> torch.Tensor:
    """The mask ``sdpa_mask`` builds for causal attention within the packed sequences ``segments``
    (``_sequence_indices``): the same function, so the same tensor."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function, sdpa_mask

    batch_size, length = segments.shape
    return sdpa_mask(batch_size=batch_size, q_length=length, kv_length=length, allow_is_causal_skip=False,
                     mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(segments)),
                     device=segments.device)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``; given ``(mask, skip)`` from ``mask``, it runs the kernel
    eager would have run, chosen by ``torch.cond`` on ``skip``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    one_sequence_per_row = kwargs.pop(ONE_SEQUENCE_PER_ROW, False)
    if not isinstance(attention_mask, tuple):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    full_mask, skip = attention_mask
    if one_sequence_per_row and full_mask.dim() == 2:  # sequence numbers of the model's own positions
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    # cond wants both branches' gradients in one layout; the kernels give theirs in their own (the
    # masked one's come back contiguous through repeat_kv), so each branch hands them over as
    # [batch, seq, heads, dim] in memory (a copy only where a kernel gave another layout)
    def unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        q, k, v = (_GradSeqMajor.apply(t) for t in (q, k, v))
        return _standard_strides(sdpa_attention_forward(module, q, k, v, None, **kwargs)[0])

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        q, k, v = (_GradSeqMajor.apply(t) for t in (q, k, v))
        if m.dim() == 2:  # sequence numbers: the mask is built in this branch only
            m = _mask_of_sequences(m)
        return _standard_strides(sdpa_attention_forward(module, q, k, v, m, **kwargs)[0])

    if torch.compiler.is_dynamo_compiling():  # a layer traced inline into the step's graph
        return torch.cond(skip, unmasked, masked, (query, key, value, full_mask)), None
    # a region's own trace (compiler/regions): the higher-order op itself (its branches return tuples),
    # which make_fx traces branch by branch; torch.cond would compile a wrapper with Dynamo here, whose
    # frame cache (and its automatic dynamic shapes) would then be shared by every region traced after it
    return cond_op(skip, lambda *a: (unmasked(*a),), lambda *a: (masked(*a),), (query, key, value, full_mask))[0], None


def _standard_strides(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) with the strides a fresh tensor of its shape has. A dimension of one has no
    stride of its own, and the kernels leave different ones there (CUDA's flash and memory-efficient
    kernels: one KV head gave (90, 10, 90, 1) against the math kernel's (90, 10, 10, 1)), which
    ``torch.cond`` refuses between its branches. The same values."""
    if any(guard_or_false(size == 1) for size in x.shape):
        return x.clone(memory_format=torch.contiguous_format)
    return x


class _GradSeqMajor(torch.autograd.Function):
    """Identity on a [batch, heads, seq, dim] tensor whose gradient is laid out as [batch, seq, heads,
    dim] in memory (the layout of the projections' outputs it came from): same values, fixed strides."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        seq_major = grad.transpose(1, 2)
        if any(guard_or_false(size == 1) for size in seq_major.shape):
            # a dimension of one (one KV head, a batch of one row) has no stride of its own, and contiguous()
            # keeps whatever the kernel gave it: a fresh tensor gives both branches the same strides
            return seq_major.clone(memory_format=torch.contiguous_format).transpose(1, 2)
        return seq_major.contiguous().transpose(1, 2)
