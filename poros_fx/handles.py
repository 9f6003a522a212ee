"""Handles on a prepared model that every layer reads: the attribute names poros-fx sets, their getters,
and the gradient-checkpointing check every surface makes.

``prepare`` sets ``model._poros_store`` (the ``runtime.store.HostStore``) and marks each host tensor with
``_poros_entry`` (its ``runtime.host_tensors.HostEntry``); the compiler, the runtime, the surfaces and the tools read them
through this module, which imports nothing of poros-fx but ``errors``, so any layer may use it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .errors import PorosConfigError

STORE_ATTR = "_poros_store"  # on the prepared model (and its causal LM): its HostStore
ENTRY_ATTR = "_poros_entry"  # on a host tensor: its HostEntry in the store


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a ``torch.compile`` wrapper."""
    return getattr(model, "_orig_mod", model)


def text_config(config: Any) -> Any:
    """The text model's config of ``config`` (a multimodal config's ``get_text_config()``), or ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module inside a PEFT wrapper (or the model itself)."""
    model = unwrap(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def get_store(model: nn.Module) -> Any:
    """The ``runtime.store.HostStore`` of a prepared ``model`` (compiled or not), or ``None``."""
    return getattr(unwrap(model), STORE_ATTR, None)


CHECKPOINTING_MESSAGE = (
    "gradient (activation) checkpointing is on{where}: poros already recomputes each block in the backward, "
    "from its own reload of the base and with the forward's RNG state, and cannot nest a second recompute "
    "(torch.utils.checkpoint) inside its graphs. Turn it off (model.gradient_checkpointing_disable(), or leave "
    "TrainingArguments.gradient_checkpointing False); the activation memory stays one block's either way.")


def checkpointing_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose Hugging Face gradient checkpointing is switched on
    (``gradient_checkpointing_enable()`` sets ``module.gradient_checkpointing = True`` on each layer)."""
    return [name or type(m).__name__ for name, m in unwrap(model).named_modules()
            if getattr(m, "gradient_checkpointing", False) is True]


def check_no_checkpointing(model: nn.Module) -> None:
    """Raise ``PorosConfigError`` when ``model`` has gradient checkpointing switched on."""
    on = checkpointing_modules(model)
    if on:
        shown = ", ".join(on[:2]) + (f" and {len(on) - 2} more" if len(on) > 2 else "")
        raise PorosConfigError(CHECKPOINTING_MESSAGE.format(where=f" ({shown})"))
