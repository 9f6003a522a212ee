"""The call of a decoder layer, as a list of tensors and a string that gives the rest.

A custom op takes tensors, ints and strings, not Python objects, so ``call_region`` hands
``poros::region`` the tensors of a layer call and a string for everything else; the region's trace
rebuilds the call from the two. ``("hidden", attention_mask=(mask, skip), use_cache=False)`` is::

    tensors: [hidden, mask, skip]
    call:    "#0:T\\x1fattention_mask:(2\\x1fuse_cache=False"

State that crosses layers outside the hidden state comes as a mapping of names to tuples of tensors
(Gemma 4's ``shared_kv_states``: the keys and values a layer stores for later layers to read). Its
entries are tensors of the call, sorted by name, and the region's trace rebuilds it as a ``dict``
(``shared_kv_states={sliding_attention: (k, v)}``)::

    tensors: [hidden, k, v]
    call:    "#0:T\\x1fshared_kv_states:{sliding_attention=2"

What the layer writes into it comes back as more outputs of the region (``trace.py``: ``writes``)
and goes into the caller's mapping (``ops.call_region``).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Sequence

import torch

SEP = "\x1f"  # between the entries of a call string (a string constant holding it is not taken)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], str] | None:
    """The tensors of a layer call and a string that gives the rest (``None``: a value a region cannot
    take, such as a cache object; the layer then runs inline). Traced by Dynamo, so plain Python."""
    tensors: list[torch.Tensor] = []
    entries: list[str] = []
    named = [(f"#{i}", a) for i, a in enumerate(args)] + [(k, kwargs[k]) for k in sorted(kwargs)]
    for name, value in named:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            entries.append(f"{name}:T")
        elif isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value):
            tensors.extend(value)
            entries.append(f"{name}:{'(' if isinstance(value, tuple) else '['}{len(value)}")
        elif isinstance(value, Mapping):
            names = sorted(value.keys())
            if any(not _tensor_tuple(value[k]) or not _plain_name(k) for k in names):
                return None
            for k in names:
                tensors.extend(value[k])
            entries.append(f"{name}:{{" + ",".join([f"{k}={len(value[k])}" for k in names]))
        elif value is None or isinstance(value, (bool, int, float, str)):
            text = repr(value)
            if SEP in text:
                return None
            entries.append(f"{name}={text}")
        else:
            return None
    return tensors, SEP.join(entries)


def _tensor_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def _plain_name(key: Any) -> bool:
    return isinstance(key, str) and key.isidentifier()


def state_mapping(args: tuple, kwargs: dict) -> Any:
    """The mapping of a layer call that carries state between layers (``flatten_call`` flattens it),
    or ``None``: the one the region's writes go back into."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Mapping):
            return value
    return None


def rebuild_call(call: str, tensors: Sequence[Any]) -> tuple[tuple, dict]:
    """``flatten_call``'s inverse: the args and kwargs, with ``tensors`` in the tensor places. Entries
    whose name starts with ``@`` describe the layer's mode (``key.mode_entry``), not the call."""
    it = iter(tensors)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for entry in call.split(SEP) if call else ():
        if entry.startswith("@"):
            continue
        cut = min(i for i in (entry.find(":"), entry.find("=")) if i >= 0)
        name, kind, payload = entry[:cut], entry[cut], entry[cut + 1:]
        if kind == "=":
            value = ast.literal_eval(payload)
        elif payload == "T":
            value = next(it)
        elif payload[0] == "{":
            value = {}
            for item in payload[1:].split(",") if len(payload) > 1 else ():
                key, count = item.split("=")
                value[key] = tuple(next(it) for _ in range(int(count)))
        else:
            items = [next(it) for _ in range(int(payload[1:]))]
            value = tuple(items) if payload[0] == "(" else items
        if name.startswith("#"):
            args.append(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs
