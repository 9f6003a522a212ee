"""Where a loaded base lies in its host arena, so another process can map the same bytes (a manifest).

Under ``torchrun`` one rank per host fills a shared arena (``poros_fx.distributed.HostShare``); the
other ranks of that host build the same module tree on ``meta`` and need, for every tensor, its byte
offset, shape and dtype in the arena, and for a bitsandbytes NF4 weight its ``Params4bit`` settings
and the fields of its ``QuantState`` (absmax, nested absmax, code and offset are arena tensors too;
the 16-value NF4 table is not, and travels as bytes). ``describe`` writes that as plain Python data
(it goes through ``all_gather_object``); ``attach`` sets each parameter and buffer of the ``meta``
model to its view, so the attached model's tensors are the leader's bytes, not copies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime.arena import HostArena
from .checkpoint import LoaderError
from .meta_model import param_groups, split_name

Ref = dict[str, Any]  # {"offset", "shape", "dtype"} in the arena, or {"bytes", "shape", "dtype"} outside it


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise AssertionError(f"manifest names an unknown dtype {name!r}")
    return value


def _ref(t: torch.Tensor, arena: HostArena) -> Ref:
    ref: Ref = {"shape": list(t.shape), "dtype": str(t.dtype)}
    if arena.holds(t) and t.is_contiguous():
        ref["offset"] = arena.offset(t)
    else:  # small host tensors that are not the arena's (a buffer, the NF4 code table)
        ref["bytes"] = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return ref


def _tensor(ref: Ref, arena: HostArena) -> torch.Tensor:
    shape, dtype = tuple(ref["shape"]), _dtype(ref["dtype"])
    if "offset" in ref:
        return arena.view(ref["offset"], shape, dtype)
    raw = torch.frombuffer(bytearray(ref["bytes"]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).clone()


def _is_params4bit(t: Any) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(t, bnb.nn.Params4bit)


def _quant_state(qs: Any, arena: HostArena) -> dict[str, Any]:
    out: dict[str, Any] = {"absmax": _ref(qs.absmax, arena), "shape": list(qs.shape), "blocksize": qs.blocksize,
                           "quant_type": qs.quant_type, "dtype": str(qs.dtype),
                           "code": None if qs.code is None else _ref(qs.code, arena),
                           "offset": None if qs.offset is None else _ref(qs.offset, arena), "state2": None}
    if qs.nested:
        out["state2"] = {"absmax": _ref(qs.state2.absmax, arena), "code": _ref(qs.state2.code, arena),
                         "blocksize": qs.state2.blocksize, "dtype": str(qs.state2.dtype)}
    return out


def _make_quant_state(d: dict[str, Any], arena: HostArena) -> Any:
    from bitsandbytes.functional import QuantState

    state2 = None
    if d["state2"] is not None:
        s2 = d["state2"]
        state2 = QuantState(absmax=_tensor(s2["absmax"], arena), code=_tensor(s2["code"], arena),
                            blocksize=s2["blocksize"], dtype=_dtype(s2["dtype"]))
    return QuantState(absmax=_tensor(d["absmax"], arena), shape=torch.Size(d["shape"]),
                      code=None if d["code"] is None else _tensor(d["code"], arena), blocksize=d["blocksize"],
                      quant_type=d["quant_type"], dtype=_dtype(d["dtype"]),
                      offset=None if d["offset"] is None else _tensor(d["offset"], arena), state2=state2)


def describe(model: nn.Module, arena: HostArena) -> list[dict[str, Any]]:
    """Every parameter and persistent buffer of a loaded ``model`` (once, with all its names) as a
    reference into ``arena`` (or its bytes, for the few small tensors outside it)."""
    entries = []
    for names, t in param_groups(model):
        owner, attr = split_name(names[0])
        entry: dict[str, Any] = {"names": names, "buffer": attr in model.get_submodule(owner)._buffers,
                                 "requires_grad": bool(t.requires_grad), "tensor": _ref(t.data, arena)}
        if _is_params4bit(t):
            entry["params4bit"] = {"blocksize": t.blocksize, "compress_statistics": t.compress_statistics,
                                   "quant_type": t.quant_type, "quant_storage": str(t.quant_storage),
                                   "bnb_quantized": t.bnb_quantized, "module": t.module is not None,
                                   "quant_state": _quant_state(t.quant_state, arena)}
        entries.append(entry)
    return entries


def attach(model: nn.Module, arena: HostArena, manifest: list[dict[str, Any]]) -> None:
    """Set every tensor ``manifest`` names in the ``meta`` ``model`` to its view of ``arena`` (the
    model must be built as the leader's was: same config, same quantization)."""
    expected = {tuple(names) for names, _ in param_groups(model)}
    given = {tuple(e["names"]) for e in manifest}
    if expected != given:
        differ = sorted(expected ^ given)[:3]
        raise LoaderError(f"this rank's model and the shared host store's disagree on their tensors ({differ} ...): "
                          "every rank must load the same model with the same quantization")
    for entry in manifest:
        data = _tensor(entry["tensor"], arena)
        spec = entry.get("params4bit")
        for name in entry["names"]:
            owner_name, leaf = split_name(name)
            owner = model.get_submodule(owner_name)
            meta = owner._buffers[leaf] if entry["buffer"] else owner._parameters[leaf]
            if spec is None and (tuple(meta.shape) != tuple(data.shape) or meta.dtype != data.dtype):
                raise LoaderError(f"{name}: the shared host store holds {data.dtype} {list(data.shape)}, this rank's "
                                  f"model has {meta.dtype} {list(meta.shape)}: every rank must load the same model")
        if entry["buffer"]:
            value: torch.Tensor = data
        elif spec is not None:
            import bitsandbytes as bnb

            first_owner = model.get_submodule(split_name(entry["names"][0])[0])
            value = bnb.nn.Params4bit(data, requires_grad=entry["requires_grad"],
                                      quant_state=_make_quant_state(spec["quant_state"], arena),
                                      blocksize=spec["blocksize"], compress_statistics=spec["compress_statistics"],
                                      quant_type=spec["quant_type"], quant_storage=_dtype(spec["quant_storage"]),
                                      module=first_owner if spec["module"] else None,
                                      bnb_quantized=spec["bnb_quantized"])
        else:
            value = nn.Parameter(data, requires_grad=entry["requires_grad"])
        for name in entry["names"]:  # one object under every name keeps a tied pair tied
            owner_name, leaf = split_name(name)
            owner = model.get_submodule(owner_name)
            (owner._buffers if entry["buffer"] else owner._parameters)[leaf] = value
