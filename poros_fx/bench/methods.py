"""What a bench row runs: a ``Method`` turns the shared model into a ``Runner``."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable, Literal, Mapping

import torch
from torch import nn

from ..prepare import set_trace_options
from ..families import resolve
from ..prepare import causal_lm
from ..prepare import get_store
from ..runtime.accumulate import block_major

COMPILED_RESIDENT_MODELS = ("tiny", "qwen2.5-0.5b", "qwen2.5-7b")  # Inductor on a 32B+ resident base: not asked for

State = Literal["prepared", "resident"]

@dataclasses.dataclass
class Runner:
    """What a method's setup returns: the callable a micro-batch goes through, and how to undo the setup."""

    forward: Callable[..., Any]  # forward(**batch, use_cache=False) -> output with .loss
    teardown: Callable[[], None] = lambda: None
    # the context an optimizer step's micro-batches run in (poros: block-major, runtime/accumulate.py)
    micro_batches: Callable[[list], Any] = lambda batches: contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Method:
    """One benchmarked method: the model state it needs and how it turns the model into a ``Runner``.

    ``setup(model, block_size)`` gets the shared PEFT model (in ``state``) and the row's block size
    (``None`` unless ``per_block_size``). Pass extra ``Method``s to ``run(..., methods=...)`` to add one.
    """

    name: str
    state: State
    setup: Callable[[nn.Module, int | None], Runner]
    compiled: bool = False  # the first step compiles: report compile_s
    streams: bool = False  # a poros store counts its loads: report h2d_gbps
    per_block_size: bool = False  # one row per --block-sizes value
    models: tuple[str, ...] | None = None  # only these models (None: all)
    budget: bool = False  # setup also takes memory_budget= (the run's --memory-budget)
    own_process: bool = False  # measured in a process of its own on a checkpoint (unsloth.py), not on the model
    quantization: str = "nf4"  # the shared model's base: bf16 rows get a bf16 build of the same weights' shapes
    warmup: int = 1  # untimed steps at least (CUDA graphs: the first step warms up, the second records; under a
    # budget the first measures and the second records, and the third finds the load slots taken in the steady
    # order, which the fourth records again: runtime/cuda_graphs.py)


def _peft_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(model)


def _peft_checkpointing(model: nn.Module, block_size: int | None) -> Runner:
    # non-reentrant checkpointing needs no enable_input_require_grads: it does not rely on the
    # checkpointed block's input requiring grad (the reentrant variant does)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode
    return Runner(model, teardown=model.gradient_checkpointing_disable)


def _compiled_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(torch.compile(model))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:

    lm = causal_lm(model)
    return lm.get_submodule(resolve(lm.config.model_type).layers)


def _regional(checkpointing: bool) -> Callable[[nn.Module, int | None], Runner]:
    """Resident PEFT with each decoder layer under plain ``torch.compile`` (Inductor): PyTorch's
    "regional compilation" recipe, one compile for every layer of the same structure; optionally with
    transformers' activation checkpointing (each layer's compiled forward rerun in the backward)."""

    def setup(model: nn.Module, block_size: int | None) -> Runner:
        layers = _decoder_layers(model)
        for layer in layers:
            layer.compile()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()

        def teardown() -> None:
            for layer in layers:
                layer._compiled_call_impl = None
            if checkpointing:
                model.gradient_checkpointing_disable()

        return Runner(model, teardown=teardown)

    return setup


def _poros_teardown(model: nn.Module) -> Callable[[], None]:

    def teardown() -> None:
        store = get_store(model)
        if store is not None:
            store.resident_cache.clear()  # stream=False keeps device copies; the next row must not see them
            store.region_graphs = None  # a row's CUDA graphs and their memory pool go with it
            store.schedules.clear()  # each compiled graph's schedule and runtime: dead once the row is over

    return teardown


def _poros_with(**options: Any) -> Callable[[nn.Module, int | None], Runner]:
    """A streamed poros method: the row's block size plus ``options``; with accumulation its micro-batches
    run block-major unless ``options`` say ``block_major=False``."""

    def setup(model: nn.Module, block_size: int | None) -> Runner:
        set_trace_options(model, options)  # chunked_loss: the forward Dynamo traces reads it
        clear = _poros_teardown(model)

        def teardown() -> None:
            if options.get("chunked_loss"):
                set_trace_options(model, {"chunked_loss": False})  # the next row computes HF's loss again
            clear()

        return Runner(torch.compile(model, backend="poros", options={"block_size": block_size or 1, **options}),
                      teardown=teardown, micro_batches=lambda batches: block_major(model, batches))

    return setup


_poros = _poros_with()
_poros_eager = _poros_with(codegen="eager")
_poros_inductor = _poros_with(codegen="inductor")
_poros_tensor_copies = _poros_with(group_copies=False)
_poros_prefetch1 = _poros_with(prefetch=1)
_poros_micro_major = _poros_with(block_major=False)
_poros_chunked_loss = _poros_with(chunked_loss=True)
_poros_long = _poros_with(chunked_loss=True, offload_boundaries=True)
EVERY_LAYER = 1 << 30  # save_activations counts layer blocks from the last; more than a model has means all
_poros_saved = _poros_with(save_activations=EVERY_LAYER)
_poros_graphs = _poros_with(cuda_graphs=True)
_poros_saved_graphs = _poros_with(save_activations=EVERY_LAYER, cuda_graphs=True)


def _poros_budget(model: nn.Module, block_size: int | None, memory_budget: str | None = None,
                  save_activations: int = 0, cuda_graphs: bool = False) -> Runner:
    """Streamed with ``options={"memory_budget": ...}``: the first step measures, then blocks that fit
    stay resident (runtime/budget.py); ``save_activations``: that many layer blocks keep their activations;
    ``cuda_graphs``: region calls replayed from CUDA graphs."""

    runner = _poros_with(memory_budget=memory_budget, save_activations=save_activations,
                         cuda_graphs=cuda_graphs)(model, block_size)
    clear = runner.teardown

    def teardown() -> None:
        store = get_store(model)
        if store is not None:  # the next row streams again
            store.forget_plan()
            store.memory_budget = None
        clear()

    return Runner(runner.forward, teardown=teardown, micro_batches=runner.micro_batches)


def _poros_budget_saved(model: nn.Module, block_size: int | None, memory_budget: str | None = None) -> Runner:
    """``_poros_budget`` with every layer block's activations saved: kept blocks are neither reloaded nor
    recomputed; streamed ones are reloaded, not recomputed."""
    return _poros_budget(model, block_size, memory_budget, save_activations=EVERY_LAYER)


def _poros_budget_graphs(model: nn.Module, block_size: int | None, memory_budget: str | None = None) -> Runner:
    """``_poros_budget`` with the region calls replayed from CUDA graphs."""
    return _poros_budget(model, block_size, memory_budget, cuda_graphs=True)


def _poros_budget_saved_graphs(model: nn.Module, block_size: int | None, memory_budget: str | None = None) -> Runner:
    """``_poros_budget_saved`` with the region calls replayed from CUDA graphs."""
    return _poros_budget(model, block_size, memory_budget, save_activations=EVERY_LAYER, cuda_graphs=True)


def _own_process(model: nn.Module, block_size: int | None) -> Runner:
    raise RuntimeError("an own-process method is measured by bench/unsloth.py, never set up on the shared model")


def _poros_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(torch.compile(model, backend="poros", options={"stream": False}), teardown=_poros_teardown(model))


METHODS: Mapping[str, Method] = types.MappingProxyType({
    "peft_resident": Method("peft_resident", "resident", _peft_resident),
    # the same model with a bf16 base on the device (a mixture of experts' bf16 experts): a model of its own
    "peft_resident_bf16": Method("peft_resident_bf16", "resident", _peft_resident, quantization="bf16"),
    "peft_checkpointing": Method("peft_checkpointing", "resident", _peft_checkpointing),
    "compiled_resident": Method("compiled_resident", "resident", _compiled_resident, compiled=True,
                                models=COMPILED_RESIDENT_MODELS),
    "compiled_regional": Method("compiled_regional", "resident", _regional(False), compiled=True),
    "compiled_regional_checkpointing": Method("compiled_regional_checkpointing", "resident", _regional(True),
                                              compiled=True),
    "poros": Method("poros", "prepared", _poros, compiled=True, streams=True, per_block_size=True),
    # each codegen by name (poros runs the device's default one)
    "poros_eager": Method("poros_eager", "prepared", _poros_eager, compiled=True, streams=True, per_block_size=True),
    "poros_inductor": Method("poros_inductor", "prepared", _poros_inductor, compiled=True, streams=True,
                             per_block_size=True),
    "poros_resident": Method("poros_resident", "prepared", _poros_resident, compiled=True, streams=True),
    # streamed with --memory-budget: blocks that fit stay resident after the first step
    "poros_budget": Method("poros_budget", "prepared", _poros_budget, compiled=True, streams=True,
                           per_block_size=True, budget=True),
    # every layer block keeps its activations for the backward (options save_activations): no recompute
    "poros_saved": Method("poros_saved", "prepared", _poros_saved, compiled=True, streams=True, per_block_size=True),
    "poros_budget_saved": Method("poros_budget_saved", "prepared", _poros_budget_saved, compiled=True, streams=True,
                                 per_block_size=True, budget=True),
    # region calls captured in CUDA graphs and replayed (runtime/cuda_graphs.py): step 1 warms up, step 2 records
    "poros_graphs": Method("poros_graphs", "prepared", _poros_graphs, compiled=True, streams=True, per_block_size=True,
                           warmup=2),
    "poros_saved_graphs": Method("poros_saved_graphs", "prepared", _poros_saved_graphs, compiled=True, streams=True,
                                 per_block_size=True, warmup=2),
    "poros_budget_graphs": Method("poros_budget_graphs", "prepared", _poros_budget_graphs, compiled=True,
                                  streams=True, per_block_size=True, budget=True, warmup=4),
    "poros_budget_saved_graphs": Method("poros_budget_saved_graphs", "prepared", _poros_budget_saved_graphs,
                                        compiled=True, streams=True, per_block_size=True, budget=True, warmup=4),
    # accumulation micro-batch after micro-batch, each copying the base (the default runs them block-major)
    "poros_micro_major": Method("poros_micro_major", "prepared", _poros_micro_major, compiled=True, streams=True,
                                per_block_size=True),
    # long sequences (poros_fx/loss.py, passes/offload.py): the head and loss in vocabulary chunks, and with
    # them the boundary activations in host memory (32B seq 8192, 72B seq 4096: --seqs 8192 / 4096)
    "poros_chunked_loss": Method("poros_chunked_loss", "prepared", _poros_chunked_loss, compiled=True, streams=True,
                                 per_block_size=True),
    "poros_long": Method("poros_long", "prepared", _poros_long, compiled=True, streams=True, per_block_size=True),
    # a fixed prefetch depth of 1 against the default "auto" (opt-in, for A/B runs)
    "poros_prefetch1": Method("poros_prefetch1", "prepared", _poros_prefetch1, compiled=True, streams=True,
                              per_block_size=True),
    # the runtime before a block became one copy: one copy and allocation per tensor (opt-in, for A/B runs)
    "poros_tensor_copies": Method("poros_tensor_copies", "prepared", _poros_tensor_copies, compiled=True,
                                  streams=True, per_block_size=True),
    # the peer, each in a process of its own on a checkpoint of the same weights (unsloth.py, unsloth_worker.py)
    "unsloth_resident": Method("unsloth_resident", "resident", _own_process, compiled=True, own_process=True),
    "unsloth_checkpointing": Method("unsloth_checkpointing", "resident", _own_process, compiled=True,
                                    own_process=True),
    "unsloth_offload": Method("unsloth_offload", "resident", _own_process, compiled=True, own_process=True),
})
