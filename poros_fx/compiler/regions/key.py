"""What makes two decoder layers one region, and what Dynamo must watch for a region to stay right.

A region is traced from one layer; layers whose ``fingerprint`` is equal (module classes, plain
attributes such as dropout rates and LoRA scalings, tensor shapes; layer indices left out) trace the
same graph and share it. Some of those attributes change between steps: ``model.eval()`` flips every
``training`` flag, PEFT's ``disable_adapter()`` / ``set_adapter()`` switch LoRA layers, and nothing in
the step's graph reads them once the layer is one op. ``mode_entry`` reads them in the code Dynamo
traces (``call_region``), so Dynamo guards each one and a change recompiles the step, which then finds
(or traces) the region of the layer as it is now::

    call:  "#0:T\x1f...\x1fuse_cache=False\x1f@mode=1111111...|0default(('default', 2.0),)..."

The caller's ``torch.autocast`` belongs to the mode too. A region's trace cannot see it by itself: it
runs inside the op's fake implementation, below the autocast dispatch key, so without it a layer is
traced in its parameters' dtype where eager casts each matmul to bf16 (``SFTConfig``'s default
``bf16=True`` on an fp32 model). ``autocast_entry`` reads it into the call, and ``autocast_of`` traces
the region under it::

    call:  "...\x1fuse_cache=False\x1f@autocast=cpu:bfloat16\x1f@mode=..."
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ...errors import PorosConfigError
from .call import SEP
from .parameter_lora import is_parameter_lora

# -- what makes two layers one region --------------------------------------------------------------------

_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_poros_layer", "_poros_own", "_poros_hosts", "_poros_table",
                         "_poros_block", "_poros_modules", "_poros_adapters", "_poros_writes",
                         # the layer's index: read only to index a KV cache, which a region never gets
                         "layer_idx"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_LAYER_PATH = re.compile(r"(\.)\d+(\.|$)")  # "model.layers.3.self_attn" -> "model.layers.#.self_attn"


def _plain(value: Any, memo: dict[int, Any], objects: dict[int, tuple[Any, Any]], depth: int = 0) -> Any:
    """A hashable description of an attribute value: plain values as they are, containers and
    objects by their plain contents (a few levels deep), tensors by shape and dtype. A module path
    names its layer by index (PEFT keeps ``target_name``): the index is left out. An object that is
    not a container (a model config, a bitsandbytes quant state) is described once and the
    description kept in ``objects``: walking a config's hundred fields for every layer at every
    lookup cost seconds of a deep model's compile."""
    if isinstance(value, str):
        return _LAYER_PATH.sub(r"\1#\2", value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    key = id(value)
    if key in memo:
        return memo[key]
    if depth >= 3:
        out: Any = ("deep", type(value).__qualname__)
    elif isinstance(value, (tuple, list)):
        out = (type(value).__name__, tuple(_plain(v, memo, objects, depth + 1) for v in value))
    elif isinstance(value, (set, frozenset)):
        out = ("set", tuple(sorted(repr(_plain(v, memo, objects, depth + 1)) for v in value)))
    elif isinstance(value, dict):
        # integer keys are hook handles (different in every layer); string keys are names (adapters)
        out = ("dict", tuple((k if isinstance(k, str) else "#", _plain(v, memo, objects, depth + 1)) for k, v in value.items()))
    elif isinstance(value, type) or callable(value) and not hasattr(value, "__dict__"):
        out = ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    elif callable(value) and hasattr(value, "__func__"):  # a bound method
        out = ("method", value.__func__.__qualname__)
    elif hasattr(value, "__dict__"):
        known = objects.get(key)
        if known is not None and known[0] is value:
            return known[1]
        memo[key] = ("cycle", type(value).__qualname__)
        out = (type(value).__qualname__, tuple((k, _plain(v, memo, objects, depth + 1))
                                               for k, v in sorted(vars(value).items()) if not isinstance(v, nn.Module)))
        objects[key] = (value, out)
    else:
        out = ("object", type(value).__qualname__)
    memo[key] = out
    return out


def fingerprint(layer: nn.Module, objects: dict[int, tuple[Any, Any]] | None = None) -> tuple:
    """What a traced region of ``layer`` depends on besides its inputs: the classes of its modules,
    their plain attributes (training flags, dropout rates, LoRA scalings, attention kinds, ...) and
    their tensors' shapes and dtypes. Two layers with equal fingerprints trace to the same graph.
    ``objects``: descriptions of non-container objects already walked (``_plain``)."""
    memo: dict[int, Any] = {}
    objects = {} if objects is None else objects
    parts = []
    for name, mod in layer.named_modules(remove_duplicate=False):
        attrs = tuple((k, _plain(v, memo, objects)) for k, v in sorted(vars(mod).items()) if k not in _SKIP_ATTRS)
        tensors = tuple((k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in
                        (*mod._parameters.items(), *mod._buffers.items()) if t is not None)
        parts.append((name, _module_class(mod), attrs, tensors))
    return tuple(parts)


def _module_class(module: nn.Module) -> Any:
    """A module's class as far as a trace is concerned. ``prepare`` gives a decoder layer, and each
    module owning frozen tensors, a class made for its model (``host_modules.poros_class``): described
    by the class it was, the names it adds and the forward it sets, so two models' layers of one
    structure have one fingerprint. ``torch.nn.utils.parametrize`` gives each parametrized module a
    class of its own too (NF4 experts, ``io/nf4_experts.py``): described by its base and the names."""
    cls = type(module)
    own = vars(cls)
    if "_poros_layer_class" in own:
        return own["_poros_layer_class"]
    added = None
    if "_poros_original_class" in own:
        added = (tuple(sorted(k for k in own if not k.startswith("__"))), own.get("forward"))
        cls = own["_poros_original_class"]
    if parametrize.is_parametrized(module) and cls.__bases__ and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}":
        cls = ("parametrized", cls.__bases__[0], tuple(sorted(module.parametrizations)))
    return cls if added is None else (cls, *added)


def state(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The layer's tensors in the order ``call_region`` passes them: parameters, then buffers."""
    return [*layer.named_parameters(), *layer.named_buffers()]


def state_names(layer: nn.Module) -> list[str]:
    return [n for n, _ in state(layer)]


MERGE_ERROR = ("merging a LoRA adapter into a prepared (streamed) base is not supported: the base weights live in "
               "the poros host store and PEFT's merge changes a temporary copy of them, so the model would run "
               "without the adapter. Merge offline instead (`poros-fx export ADAPTER --base MODEL -o OUT`), or call "
               "poros_fx.unprepare(model) first")


def check_not_merged(layer: nn.Module) -> None:
    """PEFT's ``merge_adapter`` on a prepared model adds the adapter to a loaded copy of the base weight
    (lost) and marks the LoRA layer merged, which then skips its adapter: refuse to run it."""
    if any(getattr(m, "merged", False) is True for m in layer.modules()):
        raise PorosConfigError(MERGE_ERROR)


PARAMETER_LORA_ERROR = (
    "LoRA on the parameter {name!r} (PEFT's target_parameters; or target_modules naming a mixture of experts' fused "
    "weights such as 'gate_up_proj' / 'down_proj' bare, which PEFT then adapts as parameters) runs in a decoder "
    "layer's region only, and this model was prepared with regions=False: prepare it with regions=True (the default), "
    "or adapt the layers' linear modules only")
DORA_NF4_ERROR = ("DoRA (LoraConfig(use_dora=True)) on an NF4 base is not supported: PEFT's DoRA reads the base "
                  "weight as a bitsandbytes Params4bit to dequantize it, and a streamed base hands it a loaded copy of "
                  "the packed bytes. Use plain LoRA (use_dora=False), or DoRA on a bf16 / fp32 base")


def check_no_dora_on_nf4(layer: nn.Module) -> None:
    """PEFT's DoRA over a bitsandbytes 4-bit layer would scale by the norm of the packed weight: refuse it."""
    for module in layer.modules():
        if getattr(module, "lora_magnitude_vector", None) and type(getattr(module, "base_layer", None)).__name__ == "Linear4bit":
            raise PorosConfigError(DORA_NF4_ERROR)


def check_no_parameter_lora(layer: nn.Module) -> None:
    """For a model prepared without regions: PEFT's LoRA on a parameter (``target_parameters``: a mixture of
    experts' fused 3-D weights) runs in a region only (``parameter_lora.py``); Dynamo would trace the
    parametrization PEFT registers inside each forward: refuse it."""
    for module in layer.modules():
        if is_parameter_lora(module):
            raise PorosConfigError(PARAMETER_LORA_ERROR.format(name=module.parameter_name))


def check_state(layer: nn.Module, index: int) -> None:
    """The tensors ``prepare`` listed for the layer are still its tensors (an adapter removed after
    ``prepare`` changes them, which no hook sees; a region traced from the old list would read the
    wrong ones), and no adapter of it is merged."""
    check_not_merged(layer)
    current = state(layer)
    listed = [(layer._poros_own if kind == "own" else layer._poros_hosts)[k] for kind, k in layer._poros_layout]
    if len(current) != len(listed) or any(t is not u for (_, t), u in zip(current, listed)):
        raise PorosConfigError(f"decoder layer {index}'s parameters or buffers changed after poros_fx.prepare (an adapter "
                               "added, removed or replaced?); call poros_fx.unprepare(model) and prepare it again")




# -- the mode Dynamo guards -------------------------------------------------------------------------------

MODE = "@mode="  # the call string's entry that describes the layer's mode (``rebuild_call`` skips it)


# forwards that never read ``training``: containers (no forward of their own), and torch's linear,
# identity and embedding. A module of one of these classes cannot change a trace by its flag.
_MODE_FREE_FORWARDS = frozenset({nn.Module.forward, nn.Linear.forward, nn.Identity.forward, nn.Embedding.forward})


def mode_modules(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules whose mode ``mode_entry`` reads: every module of the layer whose forward may read its
    ``training`` flag (all but containers and plain linears: a LoRA'd layer has about 80 modules, 20 of
    them with a forward of their own; each flag read is a guard Dynamo builds and checks on every call),
    and the PEFT tuner layers among them (adapter switched off, active adapter, scaling)."""
    modules = [m for m in layer.modules() if type(m).forward not in _MODE_FREE_FORWARDS]
    return modules, [m for m in modules if hasattr(m, "_disable_adapters") and hasattr(m, "scaling")]


def mode_entry(layer: nn.Module) -> str:
    """The layer's mode as a call-string entry, read in code Dynamo traces so it guards every flag
    (``prepare`` lists the modules: ``_poros_modules``, ``_poros_adapters``)."""
    flags = "".join(["1" if m.training else "0" for m in layer._poros_modules])
    adapters = "".join([f"|{'0' if m._disable_adapters else '1'}{m._active_adapter}{tuple(m.scaling.items())}"
                        for m in layer._poros_adapters])
    return f"{MODE}{flags}{adapters}"


AUTOCAST = "@autocast="  # the call string's entry of a layer called under torch.autocast


def autocast_entry(device: torch.device) -> str | None:
    """``torch.autocast``'s state on ``device``'s type as a call-string entry (``None``: off), read in code
    Dynamo traces (which guards the autocast state): a call with and one without autocast get regions of
    their own."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return f"{AUTOCAST}{kind}:" + str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


def autocast_of(call: str) -> contextlib.AbstractContextManager:
    """The autocast ``call`` names (``autocast_entry``), to trace its region under; a null context when none.
    Without its cast cache, as torch's own tracing (``make_fx``) runs autocast: the casts are the same."""
    for entry in call.split(SEP):
        if entry.startswith(AUTOCAST):
            kind, dtype = entry[len(AUTOCAST):].split(":")
            return torch.autocast(kind, dtype=getattr(torch, dtype), cache_enabled=False)
    return contextlib.nullcontext()
