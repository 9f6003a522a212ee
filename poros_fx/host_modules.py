"""The classes a prepared module gets: ``weight`` / ``bias`` properties that load from the host store, an
embedding that gathers its rows, an lm_head loaded in row chunks, and bitsandbytes ``Linear4bit``'s
forward over loaded tensors; and the quant-state tensors of an NF4 weight the host store keeps.

``prepare`` swaps each module that owns frozen tensors for ``poros_class(type(module), module)``, a
subclass of its own class (``isinstance`` still holds), and ``restore_class`` undoes it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .compiler import ops


QS_BUFFERS = ("absmax", "offset", "absmax2", "code2")


def is_linear4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def quant_state_tensors(qs: Any) -> dict[str, torch.Tensor]:
    """The quant-state tensors NF4/FP4 kernels read (``qs.code``, the 4-bit table, is built into them)."""
    found = {"absmax": qs.absmax}
    if qs.nested:
        found.update(offset=qs.offset, absmax2=qs.state2.absmax, code2=qs.state2.code)
    return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}


def set_quant_state(qs: Any, tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if key == "absmax2":
            qs.state2.absmax = t
        elif key == "code2":
            qs.state2.code = t
        else:
            setattr(qs, key, t)


def _load_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor | None:
        param = self._parameters.get(name)
        if param is None or param.requires_grad or self.__dict__.get("_poros_describing"):
            return param
        return ops.load(param, self._poros_device)

    return property(get, doc=f"{name}, loaded from the poros host store onto the compute device")


def _describe_without_loading(self: nn.Module) -> str:
    """The original ``extra_repr`` (``nn.Linear``'s reads ``self.bias is not None``; PEFT prints layers in
    ``disable_adapter()``), with ``weight`` / ``bias`` the host tensors: describing a module loads nothing."""
    self.__dict__["_poros_describing"] = True
    try:
        return type(self)._poros_original_class.extra_repr(self)
    finally:
        del self.__dict__["_poros_describing"]


def poros_class(original: type, module: nn.Module, chunked: bool = False,
                names: tuple[str, ...] = ("bias", "weight")) -> type:
    """The subclass of ``original`` a prepared ``module`` gets: a loading property for each frozen tensor
    name in ``names`` (any name: Gated DeltaNet's ``A_log``, ``dt_bias``), and the forward that loads."""
    namespace: dict[str, Any] = {"__module__": original.__module__, "_poros_original_class": original,
                                 "extra_repr": _describe_without_loading}
    if chunked:
        namespace["forward"] = _chunked_linear_forward
    if is_linear4bit(module):
        namespace["forward"] = _linear4bit_forward
        namespace["bias"] = _load_property("bias")
    else:
        if gathers_here(module):
            namespace["forward"] = _embedding_forward
        for name in names:
            namespace[name] = _load_property(name)
    return type(original.__name__, (original,), namespace)


def restore_class(module: nn.Module, original: type) -> None:
    module.__class__ = original
    for attr in ("_poros_device", "_poros_frozen", "_poros_quant_state", "_poros_row_chunks"):
        module.__dict__.pop(attr, None)


# Embedding subclasses whose forward is ``nn.Embedding.forward(ids) * self.embed_scale.to(weight.dtype)``
# (Gemma 3's and Gemma 4's scaled word embeddings; Gemma 4's per-layer table is one too): their rows are
# gathered and scaled the same way
SCALED_EMBEDDINGS = frozenset({"Gemma3TextScaledWordEmbedding", "Gemma4TextScaledWordEmbedding"})


def _scaled(module: nn.Module) -> bool:
    original = getattr(type(module), "_poros_original_class", type(module))
    return original.__name__ in SCALED_EMBEDDINGS and isinstance(module._buffers.get("embed_scale"), torch.Tensor)


def gathers_rows(module: nn.Module) -> bool:
    """Whether a prepared ``module`` looks rows up in the host store instead of loading its table: a
    plain ``nn.Embedding`` (its class keeps ``nn.Embedding.forward``), or a scaled one of Gemma's
    (``SCALED_EMBEDDINGS``), without ``max_norm`` (which would rewrite the table). Other subclasses
    with a forward of their own load the table as a block."""
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    original = getattr(type(module), "_poros_original_class", type(module))
    return original.forward is nn.Embedding.forward or _scaled(module)


def gathers_here(module: nn.Module) -> bool:
    return gathers_rows(module) and not module.weight.requires_grad


def _embedding_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` with the rows gathered from the host store (padding_idx,
    scale_grad_by_freq and sparse only shape the table's gradient, and the table is frozen); a scaled
    embedding (``SCALED_EMBEDDINGS``) multiplies them by its scale as its own forward does."""
    weight = self._parameters["weight"]
    rows = ops.gather(weight, input, self._poros_device)
    return rows * self.embed_scale.to(weight.dtype) if _scaled(self) else rows


def head_rows(head: nn.Module) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]]:
    """``rows(start, stop)`` of a prepared head: its weight's (and a frozen bias's) rows loaded from the
    host store, a trainable bias sliced (the chunked head below and the chunked loss, ``loss.py``)."""
    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias, device = head._parameters["weight"], head._parameters.get("bias"), head._poros_device
        b = None if bias is None else bias[start:stop] if bias.requires_grad else ops.load(bias[start:stop], device)
        return ops.load(weight[start:stop], device), b

    return rows


def _chunked_linear_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the weight loaded in row chunks: each chunk's rows are loaded, give
    their slice of the output features, and are dead before the next chunk's matmul."""
    rows = head_rows(self)
    return torch.cat([torch.nn.functional.linear(x, *rows(start, stop)) for start, stop in self._poros_row_chunks],
                     dim=-1)


def _linear4bit_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward`` (0.49/0.50) with the packed weight and quant state loaded;
    the matmul is ``poros::matmul_4bit`` (the same kernels as ``bnb.matmul_4bit``, one op for Dynamo to
    trace, see ops.py) where it applies, else ``bnb.matmul_4bit`` itself."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    device = self._poros_device
    host_qs = self._poros_quant_state
    nested = host_qs.nested
    absmax2 = ops.load(self.poros_qs_absmax2, device) if nested else None
    code2 = ops.load(self.poros_qs_code2, device) if nested else None
    absmax = ops.load(self.poros_qs_absmax, device)
    offset = ops.load(self.poros_qs_offset, device) if nested else None
    packed = ops.load(self._parameters["weight"], device)
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    if bias is not None:
        bias = bias.to(x.dtype).to(self.compute_dtype)
    if self._poros_matmul_op and (bias is None or not bias.requires_grad):
        # matmul_4bit's B.view(-1, 1) of packed.t() is packed itself: [(N*K+1)//2, 1]
        return ops.MATMUL_4BIT(x, packed, list(host_qs.shape), absmax, host_qs.blocksize, host_qs.quant_type,
                               host_qs.dtype, absmax2, code2, offset, host_qs.state2.blocksize if nested else 0,
                               host_qs.state2.dtype if nested else torch.float32, bias).to(inp_dtype)
    state2 = None
    if nested:
        state2 = QuantState(absmax=absmax2, code=code2, blocksize=host_qs.state2.blocksize, dtype=host_qs.state2.dtype)
    quant_state = QuantState(absmax=absmax, shape=host_qs.shape, code=None, blocksize=host_qs.blocksize,
                             quant_type=host_qs.quant_type, dtype=host_qs.dtype, offset=offset, state2=state2)
    return bnb.matmul_4bit(x, packed.t(), bias=bias, quant_state=quant_state).to(inp_dtype)
