"""``PorosSFTTrainer``: TRL's ``SFTTrainer`` with the model's decoder stack streamed by the poros backend.

Imported lazily (``poros_fx.PorosSFTTrainer``): it needs the optional
``trl`` package (``pip install poros-fx[trl]``).

What TRL does and why it needs care. ``SFTTrainer`` replaces the causal LM's ``forward`` with a fused
LM-head forward (``trl.trainer.utils.add_fused_lm_head``): called with ``fused_lm_head=True`` it runs
the backbone (embedding, decoder layers, final norm), then reads ``lm_head.weight`` itself and scores
the labels with ``trl.kernels.ChunkedLogProbFunction``, an ``autograd.Function`` that projects the
hidden states in vocabulary tiles with ``torch.mm(..., out=tile)``. Dynamo cannot trace that
(``out=`` into a non-contiguous view is a graph break), so compiling the whole model leaves the head
to eager code, and the compiled graph would hand the loaded head weight to it (refused:
``PorosExactnessError: forward graph hands load_N ... to its output``).

So ``PorosSFTTrainer`` keeps TRL's own code and moves only the seam: in ``compute_loss`` TRL's loss
code (``SFTTrainer.compute_loss``: assistant-only / completion-only masks, ``num_items_in_batch``,
DFT, the entropy / token-accuracy metrics) is handed a model whose ``fused_lm_head=True`` call runs
TRL's installed fused forward function with

* the backbone compiled with ``backend="poros"`` (streamed and recomputed block by block), and
* the head's weight loaded from the host store under ``torch.no_grad()`` when TRL's code reads it,
  dropped after the forward and loaded again when its backward unpacks it
  (``torch.autograd.graph.saved_tensors_hooks``): the same bits, never resident across the step.

Calls without the fused head (label smoothing, ``compute_loss_func``, evaluation with logits) go through
``PorosTrainer``'s compiled wrapper of the whole model. Mixed precision is applied as accelerate's
wrapped ``forward`` applies it (``accelerator.autocast()``, outputs converted to fp32). Nothing of TRL,
transformers, accelerate or torch is patched.

``SFTConfig.gradient_checkpointing`` (TRL's default: on) is switched off: the backend recomputes each
block in the backward itself, and Hugging Face checkpointing on top is refused (see ``hf.py``).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Mapping
from typing import Any

import torch
import trl
from accelerate.utils import convert_outputs_to_fp32
from torch import nn

from .distributed import no_ddp_optimizer
from .errors import PorosConfigError
from .hf import PorosTrainer, checkpointing_off, checkpointing_on
from .handles import get_store
from .runtime.lengths import mark_dynamic, without_flash_lengths

logger = logging.getLogger(__name__)


class PorosSFTTrainer(PorosTrainer, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose model forward streams the frozen base through the ``poros`` backend.

    Takes every ``SFTTrainer`` argument (``peft_config`` included: the adapter is added to the base, then
    the model is prepared) plus ``poros_options`` (as ``PorosTrainer``). The per-step log and the adapter
    equal a plain ``SFTTrainer``'s bit for bit on the CPU (``tests/test_sft.py``).
    """

    def __init__(self, model: Any = None, args: trl.SFTConfig | None = None, *pos: Any,
                 poros_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if pos:
            raise TypeError("PorosSFTTrainer takes model and args positionally, everything else by keyword")
        if args is None:  # SFTTrainer's own default, with checkpointing off
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = trl.SFTConfig(f"{str(name).split('/')[-1] or 'model'}-SFT")
        if args.world_size > 1:  # the backbone is compiled apart from DDP's wrapper: its gradients would not be synced
            raise PorosConfigError("PorosSFTTrainer runs in one process for now (torchrun / accelerate launch with "
                                   f"{args.world_size} processes asked for); PorosTrainer runs under torchrun")
        if (poros_options or {}).get("chunked_loss"):
            raise PorosConfigError("PorosSFTTrainer: leave chunked_loss unset; SFTTrainer scores the labels with its "
                                   "own fused LM head, which already projects the vocabulary a tile at a time")
        if checkpointing_on(args):
            logger.info("PorosSFTTrainer: gradient_checkpointing switched off (the poros backend recomputes each block "
                        "in the backward itself)")
            checkpointing_off(args)
        self._poros_backbone: tuple[nn.Module, Any, nn.Module] | None = None  # (backbone, its store, compiled)
        super().__init__(model=model, args=args, poros_options=poros_options, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        # TRL's loss code, with a model whose fused-head forward streams the backbone (module docstring)
        # sizes dynamic from the first batch: packing or per-batch padding compiles once (runtime/lengths.py)
        batch = mark_dynamic(without_flash_lengths(inputs, getattr(causal_lm_of(model), "config", None)))
        return trl.SFTTrainer.compute_loss(self, _StreamedSFTModel(self, model), batch,
                                           return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def poros_backbone(self, model: nn.Module) -> nn.Module:
        """``torch.compile(backbone, backend="poros")`` for the decoder stack of ``model``; one per backbone
        and host store."""
        lm = causal_lm_of(model)
        backbone = lm.base_model
        self.poros_prepare(model)
        store = get_store(model)
        cached = self._poros_backbone
        if cached is not None and cached[0] is backbone and cached[1] is store:
            return cached[2]
        compiled = torch.compile(backbone, backend="poros", options=dict(self.poros_options))
        self._poros_backbone = (backbone, store, compiled)
        return compiled


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The causal LM inside ``model`` (a PEFT model or the LM itself; a DDP wrapper's module)."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def fused_forward_of(lm: nn.Module) -> Any:
    """The function TRL installed as ``lm.forward`` (``add_fused_lm_head``), or ``None`` when TRL did not
    (a TRL version without the fused head: the model's own forward is then compiled whole)."""
    bound = vars(lm).get("forward")
    if isinstance(bound, types.MethodType) and bound.__self__ is lm:
        return bound.__func__
    return None


class _StreamedSFTModel:
    """What ``SFTTrainer.compute_loss`` calls as its model for one batch."""

    def __init__(self, trainer: PorosSFTTrainer, model: nn.Module) -> None:
        self.trainer, self.model = trainer, model

    def __call__(self, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        lm = causal_lm_of(self.model)
        fused = fused_forward_of(lm)
        with no_ddp_optimizer():
            if not fused_lm_head or fused is None:
                if fused_lm_head:
                    kwargs["fused_lm_head"] = True
                return self.trainer.poros_model(self.model)(*args, **kwargs)
            backbone = self.trainer.poros_backbone(self.model)
            accelerator = self.trainer.accelerator
            with _HeadFromHostStore(lm.get_output_embeddings()) as head:
                call = _FusedCall(lm, backbone, head)
                if accelerator.native_amp:  # as accelerate wraps the model's forward under mixed precision
                    with accelerator.autocast():
                        return convert_outputs_to_fp32(lambda: fused(call, *args, fused_lm_head=True, **kwargs))()
                return fused(call, *args, fused_lm_head=True, **kwargs)


class _FusedCall:
    """``self`` for TRL's fused forward: the causal LM, with its backbone the poros-compiled one and its
    output embedding the head that loads from the host store."""

    def __init__(self, lm: nn.Module, backbone: nn.Module, head: "_HeadFromHostStore") -> None:
        self._lm, self._backbone, self._head = lm, backbone, head

    @property
    def base_model(self) -> nn.Module:
        return self._backbone

    @property
    def model(self) -> nn.Module:  # the backbone's name for vision-language models before transformers 5
        return self._backbone

    def get_output_embeddings(self) -> "_HeadFromHostStore":
        return self._head

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lm, name)


class _HeadFromHostStore:
    """The LM head as TRL's fused head reads it (``.weight``, ``.bias``): loaded from the host store under
    ``torch.no_grad()`` on first read (the head is frozen), and while the context is open, a saved
    tensor that is that weight is packed as a note and loaded again when the backward unpacks it, so the
    device copy does not live from the forward to the backward."""

    def __init__(self, lm_head: nn.Module) -> None:
        if any(p.requires_grad for p in lm_head.parameters(recurse=False)):
            raise PorosConfigError("PorosSFTTrainer streams a frozen lm_head; this one has trainable parameters "
                                   "(modules_to_save=['lm_head'] or trainable tokens): leave the head out of the adapter")
        self._lm_head = lm_head
        self._loaded: dict[str, torch.Tensor | None] = {}
        self._hooks = contextlib.ExitStack()
        self._hooked = False  # saved_tensors_hooks entered (at the first read, after the backbone ran)

    def _load(self, name: str) -> torch.Tensor | None:
        if name not in self._loaded:
            with torch.no_grad():
                self._loaded[name] = getattr(self._lm_head, name)
            if not self._hooked:  # after the backbone ran: its own saved tensors stay as they are
                self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
                self._hooked = True
        return self._loaded[name]

    @property
    def weight(self) -> torch.Tensor:
        return self._load("weight")

    @property
    def bias(self) -> torch.Tensor | None:
        return self._load("bias")

    def _pack(self, tensor: torch.Tensor) -> Any:
        for name, loaded in self._loaded.items():
            if loaded is not None and _same(tensor, loaded):
                return _Reload(self._lm_head, name)
        return tensor

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Reload):
            with torch.no_grad():
                return getattr(packed.module, packed.name)
        return packed

    def __enter__(self) -> "_HeadFromHostStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.close()
        self._loaded.clear()  # the forward's copies go with the call


class _Reload:
    """A saved head tensor, to be loaded from the host store again when the backward needs it."""

    __slots__ = ("module", "name")

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
