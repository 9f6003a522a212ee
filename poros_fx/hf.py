"""``PorosTrainer``: a ``transformers.Trainer`` whose model forward runs through the poros backend.

``TrainingArguments(torch_compile_backend="poros")`` cannot be used: accelerate checks the backend
against a fixed list, and a compiled ``self.model`` would hide ``forward``'s signature from the
Trainer (it drops dataset columns by inspecting it). So ``self.model`` stays the plain (PEFT) model,
prepared in place (frozen base in the host store), and only ``compute_loss`` calls the compiled
wrapper ``torch.compile(model, backend="poros", options=...)``. Everything else (loss scaling with
``num_items_in_batch``, gradient accumulation, clipping, the optimizer and scheduler, logging,
checkpoints, resume) is the Trainer's own code. With ``gradient_accumulation_steps`` > 1 the
micro-batches of an optimizer step (which the Trainer fetches together, ``get_batch_samples``) are
moved to the device at once and run block-major (``runtime/accumulate.py``: each block loaded once for
all of them; the adapter is the same bits as micro-batch after micro-batch); ``poros_options=
{"block_major": False}`` runs them one after the other.

Example::

    from poros_fx.hf import PorosTrainer

    trainer = PorosTrainer(model=peft_model, args=transformers.TrainingArguments(...),
                           train_dataset=ds, poros_options={"block_size": 1})
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn

from .distributed import ignore_host_store, no_ddp_optimizer
from .errors import PorosConfigError
from .handles import CHECKPOINTING_MESSAGE, ENTRY_ATTR, causal_lm, get_store
from .options import TRAINER_DEFAULTS, given_options, prepare_options
from .prepare import prepare, set_trace_options
from .runtime import accumulate as accumulation
from .runtime.lengths import mark_dynamic, without_flash_lengths


class PorosTrainer(transformers.Trainer):
    """``transformers.Trainer`` with the model's forward compiled by the ``poros`` backend.

    ``poros_options``: the backend's ``options`` (``options.PorosOptions``: ``block_size``, ``prefetch``,
    ``stream``, ``codegen``, ``memory_budget``, ``chunked_loss``, ``offload_boundaries``, ``save_activations``,
    ``cuda_graphs``, ``least_memory``, ...) plus ``device``, the compute device for ``poros_fx.prepare``
    (default: ``args.device``). A model that is not prepared yet is prepared with ``device`` and the options
    ``prepare`` takes; a prepared one keeps its store, and the options here override its settings at
    compile time (``block_size`` regroups the compiled graph only). Under ``torchrun`` / ``accelerate launch`` (``args.world_size > 1``) the host store
    goes on DDP's ignore list before the Trainer wraps the model, the compiled wrapper is the Trainer's
    ``DistributedDataParallel`` module, and its forward runs with Dynamo's DDPOptimizer off
    (docs/distributed.md); load the model after ``TrainingArguments`` (which starts torch.distributed) for
    one shared host copy of the base per host. One device per process. Unless ``memory_budget`` or
    ``least_memory`` is given (or the model was prepared with a budget), the budget is ``"auto"``: the
    blocks that fit in what the device has free stay resident (``runtime/budget.py``).
    """

    def __init__(self, *args: Any, poros_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(poros_options or {})
        device = options.pop("device", None)
        options = given_options(options)  # bad options raise here, not at the first step
        self._poros_prepare_options = prepare_options(options)  # what the user gave, not the trainer's default
        model = kwargs.get("model", args[0] if args else None)
        if "memory_budget" not in options and not options.get("least_memory") and \
                (get_store(model) is None or get_store(model).budget.request is None):
            # a trainer keeps what fits on the device (prepare's budget wins)
            options["memory_budget"] = TRAINER_DEFAULTS["memory_budget"]
        # set before Trainer.__init__: it calls _move_model_to_device, which prepares the model
        self.poros_options: dict[str, Any] = options
        self.poros_device: str | torch.device | None = device
        self._poros_compiled: tuple[nn.Module, Any, nn.Module] | None = None  # (model, its store, wrapper)
        self._poros_step: Any = None  # the block-major accumulation step in flight (runtime/accumulate.py)
        # checked before Trainer.__init__, which would prepare (and place) the model
        _check_args(kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.model is not None:  # place_model_on_device=False skips _move_model_to_device
            self.poros_prepare(self.model)

    # -- poros ---------------------------------------------------------------------------------------

    def poros_prepare(self, model: nn.Module) -> nn.Module:
        """``model`` with its frozen base in the host store (``poros_fx.prepare``, unless it already is)."""
        if get_store(model) is None:
            device = self.poros_device if self.poros_device is not None else self.args.device
            prepare(model, device=device, **self._poros_prepare_options)
        if self.args.world_size > 1:
            ignore_host_store(model)  # before accelerate wraps it in DistributedDataParallel
        return model

    def poros_model(self, model: nn.Module) -> nn.Module:
        """The compiled poros wrapper of ``model``; one per model and host store (a re-prepared or a
        new model, e.g. from ``model_init``, gets a new one)."""
        from torch.nn.parallel import DistributedDataParallel

        if hasattr(model, "_orig_mod"):
            raise PorosConfigError("PorosTrainer got a torch.compile'd model; pass the plain (PEFT) model")
        inner = model.module if isinstance(model, DistributedDataParallel) else model  # the Trainer's DDP wrapper
        self.poros_prepare(inner)
        store = get_store(inner)
        cached = self._poros_compiled
        if cached is not None and cached[0] is model and cached[1] is store:
            return cached[2]
        set_trace_options(inner, self.poros_options)  # what the model's forward reads while Dynamo traces it
        wrapper = torch.compile(model, backend="poros", options=dict(self.poros_options))
        self._poros_compiled = (model, store, wrapper)
        return wrapper

    # -- Trainer hooks -------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        # the Trainer's own loss code, with the forward it calls compiled by poros
        with no_ddp_optimizer():  # sizes dynamic from the first batch: dynamic padding compiles once
            lm = causal_lm(getattr(model, "module", model))  # a DDP wrapper's module
            batch = mark_dynamic(without_flash_lengths(inputs, getattr(lm, "config", None)))
            return super().compute_loss(self.poros_model(model), batch, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        # the Trainer fetches an optimizer step's micro-batches before the first forward: on the device now
        # (training_step's _prepare_inputs then keeps these very tensors), they run block-major
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._poros_end_step()
        if self.model is None:
            return batch_samples, num_items_in_batch
        if not accumulation.runs_block_major(self.model, batch_samples, stream=self.poros_options.get("stream", True),
                                             block_major_option=self.poros_options.get("block_major"),
                                             data_parallel=self.args.world_size > 1):
            return batch_samples, num_items_in_batch
        batch_samples = [self._prepare_inputs(batch) for batch in batch_samples]
        self._poros_step = accumulation.begin(self.model, batch_samples, shared=(num_items_in_batch,))
        return batch_samples, num_items_in_batch

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._poros_step is not None and self._poros_step.finished:
            self._poros_end_step()
        return loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self._poros_end_step(check=False)

    def _poros_end_step(self, check: bool = True) -> None:
        step, self._poros_step = self._poros_step, None
        if step is not None:
            accumulation.end(step.model, step, check=check)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # model.to(device) would copy the whole frozen base onto the device: prepare first, then move
        # only what is not in the host store (the adapter, buffers)
        self.poros_prepare(model)
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and not hasattr(param, ENTRY_ATTR) and param.device != device:
                    param.data = param.data.to(device)
            for name, buf in module._buffers.items():
                if buf is not None and not hasattr(buf, ENTRY_ATTR) and buf.device != device:
                    module._buffers[name] = buf.to(device)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # accelerate's prepare() would model.to(device) the host store onto the device; the Trainer
        # moves the model (above) and every batch (_prepare_inputs) itself
        args = super()._build_accelerator_args(**kwargs)
        args["device_placement"] = False
        return args


def _check_args(args: transformers.TrainingArguments | None) -> None:
    if args is None:  # the Trainer's defaults are fine
        return
    if args.torch_compile:
        raise PorosConfigError("PorosTrainer compiles the model with backend='poros' itself; leave "
                               "TrainingArguments.torch_compile / torch_compile_backend unset")
    if args.n_gpu > 1:
        raise PorosConfigError(f"PorosTrainer streams the base to one device per process; got n_gpu={args.n_gpu} "
                               "(torch.nn.DataParallel over several GPUs in one process): start one process per GPU "
                               "with torchrun --nproc-per-node N or accelerate launch (docs/distributed.md)")
    if checkpointing_on(args):  # the same refusal as prepare's and the backend's
        raise PorosConfigError(CHECKPOINTING_MESSAGE.format(where=" (TrainingArguments.gradient_checkpointing=True)"))


def checkpointing_on(args: transformers.TrainingArguments) -> bool:
    """Whether ``args`` ask the Trainer for activation checkpointing (``gradient_checkpointing``, or its newer
    name ``activation_checkpointing``, of which it became an alias in transformers 5.2x)."""
    return bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", False))


def checkpointing_off(args: transformers.TrainingArguments) -> None:
    """Switch the Trainer's activation checkpointing off under both of its names."""
    args.gradient_checkpointing = False
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = False

