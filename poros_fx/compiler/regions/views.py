"""Views of a decoder layer for a region's trace: shallow copies with some submodules replaced.

A region traces the layer's own forward on a view whose children at any depth may be wrappers
(``sequence_chunks.TokenChunks``, ``parameter_lora.ParameterLoRA``). The view shares every parameter,
buffer and untouched submodule with the layer; the prepared model is not changed.
"""

from __future__ import annotations

import copy
from typing import Callable

from torch import nn


def with_children(module: nn.Module, replace: Callable[[str, nn.Module, int], nn.Module | None],
                  depth: int = 0) -> nn.Module:
    """``module``, or a shallow copy of it whose children are ``replace(name, child, depth)`` where that is
    not ``None`` (``depth`` 0: ``module``'s own children), and views of their own children elsewhere, in
    the modules' order (depth first)."""
    children = {}
    for name, child in module._modules.items():
        if child is not None:
            replaced = replace(name, child, depth)
            child = replaced if replaced is not None else with_children(child, replace, depth + 1)
        children[name] = child
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    view = copy.copy(module)
    view.__dict__["_modules"] = children
    return view
