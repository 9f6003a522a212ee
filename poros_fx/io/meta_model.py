"""Building the model: the module tree on ``meta``, which checkpoint tensor fills which parameter, the
buffers no checkpoint holds, and the adapter attached at the end.

``meta_model`` builds the tree without memory (NF4 decoder linears as ``Linear4bit`` skeletons, NF4
experts parametrized on ``meta``); ``param_groups`` lists every parameter and persistent buffer once with
all its names (a tied pair has two); ``read_groups`` the same with each NF4 experts parametrization's
stored tensors as the one weight they are made from (what a checkpoint holds); ``plan_reads`` matches
those to a checkpoint's tensors and raises every mismatch before reading.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..errors import PorosConfigError
from ..families import Family
from .checkpoint import FLOAT_DTYPES, MXFP4_GROUP, ExpertsSpec, LoaderError, Mxfp4Spec, TensorSpec, check_adapter
from .nf4_experts import NF4Experts, quantize_experts_nf4
from .quantize import linear4bit_like

if TYPE_CHECKING:
    import transformers

COMPUTE_DTYPE = torch.bfloat16  # dtype of every unquantized base tensor and of the NF4 compute


# checkpoint keys older transformers versions wrote and that from_pretrained drops as well
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)


def check_quantization(quantization: Any) -> None:
    """Refuse a quantization the loader does not make (``"nf4"``, ``"bf16"``)."""
    if quantization not in ("nf4", "bf16"):
        raise PorosConfigError(f"quantization must be 'nf4' or 'bf16', got {quantization!r}")


def is_config(obj: Any) -> bool:
    import transformers

    return isinstance(obj, transformers.PretrainedConfig)


def meta_model(config: "transformers.PretrainedConfig", quantization: str, fam: Family) -> nn.Module:
    """The module tree with every tensor on ``meta``; NF4 decoder linears become ``Linear4bit`` skeletons."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE)
    if quantization == "nf4":
        # the same replacement poros_fx.io.quantize.quantize_nf4 makes, without touching any weight
        for _, child in list(model.get_submodule(fam.layers).named_modules()):
            for attr, lin in list(child.named_children()):
                if type(lin) is not nn.Linear:
                    continue
                q = linear4bit_like(lin, compute_dtype=COMPUTE_DTYPE, nested=True)
                if lin.bias is not None:
                    q.bias = lin.bias  # keeps the model's bf16 (Linear4bit would make a float32 one)
                setattr(child, attr, q)
        quantize_experts_nf4(model, layers=fam.layers)  # bitsandbytes' fake quantization: the stored shapes
    return model


def is_nf4_weight(module: nn.Module, attr: str) -> bool:
    if attr != "weight":
        return False
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def is_nf4_experts(module: nn.Module, attr: str) -> bool:
    """Whether ``module.<attr>`` is a fused expert weight stored in NF4 (``io/nf4_experts.py``)."""
    plist = getattr(module, "parametrizations", None)
    return plist is not None and attr in plist and isinstance(plist[attr][0], NF4Experts)


PARAMETRIZED = ".parametrizations."


def read_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """``param_groups``, with the tensors an NF4 experts parametrization stores (``...parametrizations.
    gate_up_proj.original0`` to ``original4``) given as the weight they are made from, under its own name
    (``...experts.gate_up_proj``) and shape (a ``meta`` tensor): what a checkpoint holds and the loader reads."""
    out = []
    for names, meta in param_groups(model):
        owner_name, attr = split_name(names[0])
        module_name, found, weight = owner_name.rpartition(PARAMETRIZED)
        if not found or not is_nf4_experts(model.get_submodule(module_name), weight):
            out.append((names, meta))
        elif attr == "original0":
            out.append(([f"{module_name}.{weight}"], getattr(model.get_submodule(module_name), weight)))
    return out


def split_name(name: str) -> tuple[str, str]:
    owner, _, attr = name.rpartition(".")
    return owner, attr


def param_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every parameter and persistent buffer once, with all the names it has (a tied pair has two), in
    module order (embedding, layers, norm, head)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(name)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                groups.setdefault(id(b), ([], b))[0].append(f"{mod_name}.{attr}" if mod_name else attr)
    return list(groups.values())


def plan_reads(model: nn.Module, specs: dict[str, TensorSpec],
               folder: Path) -> list[tuple[list[str], TensorSpec | ExpertsSpec | Mxfp4Spec]]:
    """Which checkpoint tensor fills which group of names; every mismatch raised before reading."""
    plan = []
    missing = []
    used = set()
    for names, meta in read_groups(model):
        present = [alias for n in names for alias in checkpoint_names(n) if alias in specs]
        if not present:
            experts = experts_spec(names[0], tuple(meta.shape), specs)
            packed = mxfp4_spec(names[0], tuple(meta.shape), specs) if experts is None else None
            if experts is not None:
                used.update(p.name for expert in experts.parts for p in expert)
                plan.append((names, experts))
            elif packed is not None:
                used.update((packed.blocks.name, packed.scales.name))
                plan.append((names, packed))
            else:
                missing.append(names[0])
            continue
        spec = specs[present[0]]  # a tied pair saved twice: the first name (the embedding) wins, as in transformers
        used.update(present)
        if spec.dtype not in FLOAT_DTYPES:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}; expected a float checkpoint "
                              f"({', '.join(FLOAT_DTYPES)}). Pre-quantized or integer checkpoints are not loaded: "
                              f"pass the bf16/fp16/fp32 one")
        owner_name, attr = split_name(names[0])
        owner = model.get_submodule(owner_name)
        expected = nf4_logical_shape(owner) if is_nf4_weight(owner, attr) else tuple(meta.shape)
        if spec.shape != expected:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has shape {list(spec.shape)}, the model built from "
                              f"config.json expects {list(expected)} (config and weights from different models?)")
        plan.append((names, spec))
    if missing:
        raise LoaderError(f"{folder}: the checkpoint has no tensor for {len(missing)} model weight(s): "
                          f"{few(missing)} (a different architecture, or an incomplete save?)")
    ignore = [re.compile(p) for p in (*ALWAYS_IGNORED, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                                           or ()))]
    unexpected = [n for n in specs if n not in used and not any(p.search(n) for p in ignore)]
    if unexpected:
        raise LoaderError(f"{folder}: the checkpoint has {len(unexpected)} tensor(s) the model built from config.json "
                          f"does not: {few(unexpected)} (config and weights from different models?)")
    return plan


# a fused expert weight -> the per-expert projections a checkpoint holds for it, stacked in this order
# (Qwen's names, Mixtral's); transformers' conversion_mapping packs the same ones on load
EXPERT_SOURCES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
# the names a checkpoint may give a module that transformers renames on load (Mixtral's mixture of experts)
CHECKPOINT_RENAMES = ((".mlp.", ".block_sparse_moe."),)


def checkpoint_names(name: str) -> list[str]:
    """``name`` and the names a checkpoint may hold it under (``CHECKPOINT_RENAMES``)."""
    return [name, *(name.replace(new, old, 1) for new, old in CHECKPOINT_RENAMES if new in name)]


def experts_spec(name: str, shape: tuple[int, ...], specs: dict[str, TensorSpec]) -> ExpertsSpec | None:
    """The per-expert checkpoint tensors that make the fused weight ``name`` of ``shape``, or ``None``."""
    prefix, _, weight = name.rpartition(".")
    if len(shape) != 3 or weight not in EXPERT_SOURCES:
        return None
    for parent in checkpoint_names(prefix + "."):
        for sources in EXPERT_SOURCES[weight]:
            keys = [[f"{parent}{e}.{source}.weight" for source in sources] for e in range(shape[0])]
            if not all(k in specs for expert in keys for k in expert):
                continue
            parts = tuple(tuple(specs[k] for k in expert) for expert in keys)
            for expert in parts:
                rows = sum(p.shape[0] for p in expert)
                if any(len(p.shape) != 2 or p.shape[1] != shape[2] or p.dtype != parts[0][0].dtype for p in expert) \
                        or rows != shape[1]:
                    raise LoaderError(f"{expert[0].file}: the per-expert tensors {[p.name for p in expert]} "
                                      f"({[list(p.shape) for p in expert]}) do not make one expert of {name!r} "
                                      f"{list(shape[1:])} (config and weights from different models?)")
            return ExpertsSpec(name, parts, shape)
    return None


def mxfp4_spec(name: str, shape: tuple[int, ...], specs: dict[str, TensorSpec]) -> Mxfp4Spec | None:
    """The MXFP4 blocks and scales (gpt-oss's ``<name>_blocks`` / ``<name>_scales``) that make the fused
    weight ``name`` of ``shape`` ``[experts, K, N]``, or ``None``."""
    blocks, scales = specs.get(f"{name}_blocks"), specs.get(f"{name}_scales")
    if blocks is None or scales is None or len(shape) != 3:
        return None
    experts, k, n = shape
    expected = (experts, n, k // MXFP4_GROUP, MXFP4_GROUP // 2)
    if k % MXFP4_GROUP or (blocks.dtype, scales.dtype) != ("U8", "U8") or blocks.shape != expected \
            or scales.shape != expected[:3]:
        raise LoaderError(f"{blocks.file}: {blocks.name!r} {blocks.dtype} {list(blocks.shape)} and {scales.name!r} "
                          f"{scales.dtype} {list(scales.shape)} do not make {name!r} {list(shape)} in MXFP4 (expected "
                          f"U8 {list(expected)} and U8 {list(expected[:3])}; config and weights from different "
                          f"models?)")
    return Mxfp4Spec(name, blocks, scales, shape)


def nf4_logical_shape(module: nn.Module) -> tuple[int, int]:
    return (module.out_features, module.in_features)


def few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def numel(t: torch.Tensor) -> int:
    return math.prod(t.shape)


def rebuild_buffers(model: nn.Module, config: "transformers.PretrainedConfig") -> None:
    """Non-persistent buffers (rotary ``inv_freq``) are in no checkpoint: build the module that owns them
    again on the CPU from its config, as ``from_pretrained``'s re-initialization computes them."""
    for mod_name, module in model.named_modules():
        on_meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not on_meta:
            continue
        if on_meta == ["embed_scale"] and isinstance(getattr(module, "scalar_embed_scale", None), float):
            # Gemma's scaled embeddings keep their scale as a float too (their constructor takes sizes)
            module._buffers["embed_scale"] = torch.tensor(module.scalar_embed_scale).to(module._buffers["embed_scale"].dtype)
            continue
        try:
            with torch.device("cpu"):
                own = getattr(module, "config", None)
                fresh = type(module)(own if own is not None else config)
        except (TypeError, ValueError, AttributeError) as e:
            raise LoaderError(f"{mod_name}: buffer(s) {on_meta} are in no checkpoint and "
                              f"{type(module).__name__}(config) cannot rebuild them ({e})") from None
        for n in on_meta:
            value = fresh._buffers.get(n)
            if value is None or value.shape != module._buffers[n].shape:
                raise LoaderError(f"{mod_name}.{n}: a fresh {type(module).__name__}(config) has no matching buffer")
            module._buffers[n] = value.to(module._buffers[n].dtype)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise LoaderError(f"tensors left unloaded: {few(left)}")


def load_generation_config(model: nn.Module, folder: Path) -> None:
    if not (folder / "generation_config.json").is_file() or not getattr(model, "can_generate", lambda: False)():
        return
    import transformers

    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:  # from_pretrained also goes on without it; the weights are what matter
        warnings.warn(f"{folder / 'generation_config.json'} not used: {e}", stacklevel=3)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Around peft's ``PeftModel(...)``: peft 0.21 reads ``model.is_gradient_checkpointing``, which
    transformers 5 deprecated (a FutureWarning on every run that is not the user's to fix). Only that
    warning, only inside this block; every other warning goes through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def attach_adapter(model: nn.Module, adapter: str | os.PathLike, *, trainable: bool, source: str = "the model") -> nn.Module:
    """``peft.PeftModel.from_pretrained(model, adapter, is_trainable=trainable)``, the adapter folder
    checked first and peft's errors (an adapter made for another base) named with the folder."""
    import peft

    folder = check_adapter(adapter)
    try:
        with quiet_peft():
            return peft.PeftModel.from_pretrained(model, folder, is_trainable=trainable)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        raise LoaderError(f"{folder}: peft cannot attach this adapter to {source} ({str(e).strip().splitlines()[0]}); "
                          f"was it trained on another base model?") from None


def freeze_adapter(model: nn.Module) -> None:
    """A loaded adapter made read-only, as ``PeftModel.from_pretrained(..., is_trainable=False)`` leaves it
    (the base is frozen already)."""
    model.requires_grad_(False)
    for cfg in getattr(model, "peft_config", {}).values():
        cfg.inference_mode = True
