"""Adapters attached to a prepared model, followed; merges into its streamed base, refused.

An adapter attached after ``prepare`` (PEFT's ``get_peft_model`` / ``PeftModel.from_pretrained`` /
``load_adapter`` on a prepared base) adds modules and parameters inside the decoder layers, whose
tensor lists ``prepare`` made (``_poros_own``, ``_poros_hosts``): torch's module, parameter and buffer
registration hooks see every such assignment, and the layer is listed again. They run before the
assignment, so the hook makes it first. PEFT's ``merge_and_unload`` replaces each LoRA layer by its
base layer after merging into a weight that, on a prepared model, is a copy loaded from the host store:
refused before the swap.

torch's registration hooks are process-wide. One set of them, installed at the first ``prepare`` and
kept, serves every prepared model through ``_FOLLOWERS`` (each model's ``LayerFollower``, held by its
host store and gone with it): a set per model would change the number of global hooks, which Dynamo
guards, and recompile every compiled model at each new ``prepare``. The hooks do nothing while Dynamo
traces: a model's forward that slices its layers (``self.layers[:n]``, most of transformers' models)
builds a ``ModuleList`` and calls them, and a hook that read ``_FOLLOWERS`` there would make Dynamo
guard on how many models are prepared (a recompile between two micro-batches when another model is
freed; a guard on the set's internals that failed to build). What a traced forward registers belongs
to modules it made, not to an adapter attached to the model.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .compiler.regions import MERGE_ERROR
from .errors import PorosConfigError

# the live followers (weak: a follower lives as long as its model's host store) and the hooks' handles
_FOLLOWERS: "weakref.WeakSet[LayerFollower]" = weakref.WeakSet()
_HOOKS: list[Any] = []


class LayerFollower:
    """One prepared model's decoder layers: which layer every module inside them belongs to, and what
    to do when one of them gets a new module, parameter or buffer (``relist``)."""

    def __init__(self, layers: Sequence[nn.Module], relist: Callable[[nn.Module], None]) -> None:
        self.layers = list(layers)
        self.relist = relist
        self.owner: dict[int, int] = {}  # id of every module inside a decoder layer -> the layer's index
        for i in range(len(self.layers)):
            self._index(i)

    def _index(self, index: int) -> None:
        for module in self.layers[index].modules():
            self.owner[id(module)] = index

    def registered(self, module: nn.Module, name: str, value: Any, kind: str) -> None:
        index = self.owner.get(id(module))
        if index is None or getattr(self.layers[index], "_poros_table", None) is None:
            return
        if kind == "_modules":
            refuse_merge(module._modules.get(name), value)
        getattr(module, kind)[name] = value  # what the registration is about to do (it does it again)
        self.relist(self.layers[index])
        self._index(index)

    def remove(self) -> None:
        _FOLLOWERS.discard(self)


def follow(layers: Sequence[nn.Module], relist: Callable[[nn.Module], None]) -> LayerFollower:
    """Follow ``layers`` (one prepared model's) until the returned follower is removed or freed; keep it
    alive as long as the model is prepared (its host store holds it)."""
    if not _HOOKS:
        import torch.nn.modules.module as module_hooks

        _HOOKS.extend([
            module_hooks.register_module_module_registration_hook(lambda m, n, v: _registered(m, n, v, "_modules")),
            module_hooks.register_module_parameter_registration_hook(lambda m, n, v: _registered(m, n, v, "_parameters")),
            module_hooks.register_module_buffer_registration_hook(lambda m, n, v: _registered(m, n, v, "_buffers")),
        ])
    follower = LayerFollower(layers, relist)
    _FOLLOWERS.add(follower)
    return follower


def _registered(module: nn.Module, name: str, value: Any, kind: str) -> None:
    if torch.compiler.is_compiling():
        return
    for follower in list(_FOLLOWERS):
        follower.registered(module, name, value, kind)


def refuse_merge(old: nn.Module | None, new: nn.Module) -> None:
    """PEFT's ``merge_and_unload`` merges each LoRA layer into its base weight and puts the base layer
    in its place. On a prepared model the base weight a LoRA layer reads is a copy loaded from the host
    store, so the merge lands in that copy and is lost: the model would silently run without the
    adapter. Raise before the swap instead."""
    if old is not None and getattr(old, "merged", False) and callable(getattr(old, "get_base_layer", None)) \
            and old.get_base_layer() is new:
        raise PorosConfigError(MERGE_ERROR)
