"""LoRA on a parameter (PEFT's ``target_parameters``: a mixture of experts' fused 3-D weights) inside a region.

PEFT's ``ParamWrapper`` adapts a weight by registering a ``torch.nn.utils.parametrize`` parametrization
on the wrapped module for the length of each forward call and removing it after. A region's trace
substitutes the layer's tensors by name (``torch.nn.utils.stateless``), which that registration cannot
run under. The region therefore traces a view of the layer whose ``ParamWrapper`` chains are
``ParameterLoRA`` modules: each computes the adapted weight with PEFT's own proxy module
(``_LoraFactorsProxy``: ``baddbmm(W, lhs, rhs, alpha=scaling)``, or ``_LoraParameterProxy``: ``W + delta``,
chosen as ``ParamWrapper._activate_lora`` chooses), then runs a shallow copy of the wrapped module that
reads that weight in place of its own. The ops are the ones eager PEFT runs, once per forward as under
its ``parametrize.cached()``, so a region stays equal to the plain eager loop. An NF4 experts weight
(``io/nf4_experts.py``, itself a parametrization) is dequantized, then adapted: PEFT's own forward cannot
stack its parametrization on that one (it reads ``parametrizations[name].original``, and NF4 keeps five
originals), so there the reference is ``stream=False`` only.

Region forward of an experts module with LoRA on ``down_proj``, before (not traceable)::

    register_parametrization(experts, "down_proj", _LoraFactorsProxy(lhs, rhs, scaling))
    out = experts(hidden, top_k_index, top_k_weights)        # reads experts.down_proj
    remove_parametrizations(...)

After::

    permute = aten.permute(lora_B_weight.view(out, r, E), [2, 0, 1])      # lhs: [E, out, r]
    view = aten.view(lora_A_weight, [E, r, in])                           # rhs
    baddbmm = aten.baddbmm(down_proj, permute, view, alpha=2.0)
    ...                                                                   # the experts' code on baddbmm

The view shares every parameter, buffer and submodule with the prepared layer, which is not changed.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from peft.tuners.lora.layer import ParamWrapper, _LoraFactorsProxy, _LoraParameterProxy
from peft.utils.constants import UPCAST_DTYPES
from torch import nn
from torch.nn.utils import parametrize

from ...errors import PorosConfigError
from .views import with_children


def is_parameter_lora(module: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (``target_parameters``)."""
    return isinstance(module, ParamWrapper)


def wrapper_chain(outer: nn.Module) -> tuple[list[ParamWrapper], nn.Module]:
    """The ``ParamWrapper``s nested from ``outer`` inwards (one per adapted parameter) and the module they wrap."""
    chain = []
    module = outer
    while isinstance(module, ParamWrapper):
        chain.append(module)
        module = module.base_layer
    return chain, module


def adapted_weight(wrapper: ParamWrapper, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with ``wrapper``'s active adapters applied, as ``ParamWrapper._activate_lora`` applies them;
    ``weight`` itself where none of them is on this parameter."""
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not adapters:
        return weight
    low_precision = any(getattr(torch, name, None) == weight.dtype for name in UPCAST_DTYPES)
    if len(adapters) == 1 and wrapper.num_experts > 1 and not low_precision:
        proxy: nn.Module = _LoraFactorsProxy(*wrapper.get_delta_factors(adapters[0]))
    else:
        delta = None
        for adapter in adapters:
            delta = wrapper.get_delta_weight(adapter) if delta is None else delta + wrapper.get_delta_weight(adapter)
        proxy = _LoraParameterProxy(delta)
    return proxy(weight)


def target_parameters(model: nn.Module) -> set[str]:
    """The ``target_parameters`` of every adapter of a PEFT model (none for any other model)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return set()
    return {t for c in configs.values() for t in (getattr(c, "target_parameters", None) or ())}


def check_targets_adapted(layer: nn.Module, targets: Iterable[str], index: int) -> None:
    """A ``target_parameters`` entry naming one of the layer's parametrized weights (NF4 experts) is one PEFT
    skipped with only a warning (it matches plain parameters): refuse to train without that adapter."""
    for module_name, module in layer.named_modules():
        if is_parameter_lora(module) or not parametrize.is_parametrized(module):
            continue
        for tensor_name in module.parametrizations:
            full = f"{module_name}.{tensor_name}"
            for target in targets:
                if full == target or full.endswith("." + target):
                    raise PorosConfigError(
                        f"LoRA target_parameters entry {target!r} names decoder layer {index}'s {full}, which is "
                        "quantized (NF4 experts: a parametrization), and PEFT matches a parametrized weight by its "
                        "full module path only: it skipped this one with a warning, so the model has no adapter "
                        "there. Name each layer's weight in full (target_parameters=[f'model.layers.{i}.mlp.experts."
                        "gate_up_proj' for i in range(num_layers)], ...; poros runs it exactly to stream=False, while "
                        "PEFT's own forward cannot), load the experts in bf16, or drop target_parameters")


class ParameterLoRA(nn.Module):
    """What a region traces in place of a ``ParamWrapper`` chain: the wrapped module, called with each adapted
    parameter replaced by its adapted value. The chain is held, not registered: the layer's tensor names stay."""

    def __init__(self, outer: nn.Module) -> None:
        super().__init__()
        self.__dict__["outer"] = outer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        chain, base = wrapper_chain(self.outer)
        if any(w.disable_adapters for w in chain):
            return self.outer(*args, **kwargs)  # PEFT calls the base module, which traces as it is
        weights = {w.parameter_name: adapted_weight(w, getattr(base, w.parameter_name)) for w in chain}
        return with_weights(base, weights)(*args, **kwargs)


def with_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` that reads ``weights`` in place of its own tensors of those names, and the
    values of its other parametrized tensors (NF4 experts) as plain tensors. Setting a parametrized attribute
    would run the parametrization's ``right_inverse`` (quantize the adapted weight), so the copy is of the
    module's class before ``torch.nn.utils.parametrize`` subclassed it, with no parametrizations."""
    parametrized = parametrize.is_parametrized(module)
    # parametrize's class derives from the module's own only (and refuses copy.copy)
    view = object.__new__(type(module).__bases__[0] if parametrized else type(module))
    view.__dict__.update(module.__dict__)
    tensors = dict(module._parameters)
    if parametrized:
        tensors.update({name: getattr(module, name) for name in module.parametrizations if name not in weights})
        view.__dict__["_modules"] = {k: v for k, v in module._modules.items() if k != "parametrizations"}
    tensors.update(weights)
    view.__dict__["_parameters"] = tensors
    return view


def with_parameter_lora(module: nn.Module) -> nn.Module:
    """``module``, or a shallow copy of it in which every ``ParamWrapper`` chain at any depth is a
    ``ParameterLoRA``; the copies share every parameter, buffer and submodule."""
    return with_children(module, lambda name, child, depth: ParameterLoRA(child) if is_parameter_lora(child) else None)
