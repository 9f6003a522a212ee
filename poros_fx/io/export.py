"""Merge a LoRA adapter into a bf16 copy of its base, streamed tensor by tensor (``poros-fx export``).

``export_merged(adapter_dir, base, out)`` reads the base checkpoint one tensor at a time from its
memory-mapped safetensors file(s) (``safetensors.safe_open``, as the loader does), and for every linear
the adapter has a LoRA pair for computes, in float32,

    W' = W + scale * (B @ A)          (transposed when the adapter says ``fan_in_fan_out``)

with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` honoured per module, matched as peft matches them), then casts it to bf16. Every other
floating tensor is cast to bf16 as is. The result is written as safetensors shards cut at decoder-layer
boundaries (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``), with ``config.json`` (dtype bfloat16), ``generation_config.json`` and
the tokenizer files, so ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it.

Memory: the adapter (small) is held whole; of the base, one tensor, its float32 copy and its delta at a
time. Each shard is written by a streaming safetensors writer (the header is computed from the shapes
first, then tensor bytes are appended one by one), so a shard never sits in memory either.

Exactness: the arithmetic is peft's ``get_delta_weight`` (``transpose(B @ A) * scale``) added to the
float32 base weight, then one rounding to bf16. ``merge_and_unload()`` on a float32 base followed by
``.to(torch.bfloat16)`` gives the same bits (tests/test_cli_train.py checks ``torch.equal``).
``merge_and_unload()`` on a bf16 base does not: there peft rounds the delta to bf16 and adds it in bf16
(two roundings), which can differ by one bf16 ulp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import PorosError
from ..units import itemsize
from .checkpoint import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoaderError, TensorSpec, read_checkpoint_index,
                         read_safetensors_header, resolve_folder)

OUT_DTYPE = torch.bfloat16
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hub's customary shard size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
_PREFIX = "base_model.model."  # what peft puts before the base model's own module names
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class ExportError(PorosError):
    """An adapter or base that cannot be merged: missing files, unsupported adapter kinds, mismatched shapes."""


@dataclasses.dataclass(frozen=True)
class LoraPair:
    """One adapted module: the base weight it changes and how."""

    module: str  # module name in the base model, e.g. "model.layers.0.self_attn.q_proj"
    weight: str  # checkpoint key of the base weight it merges into
    a: torch.Tensor  # lora_A (r, in), or lora_embedding_A (r, num_embeddings)
    b: torch.Tensor  # lora_B (out, r), or lora_embedding_B (dim, r)
    scale: float
    transpose: bool  # fan_in_fan_out for linears; always True for embeddings (peft stores them that way)

    def delta(self) -> torch.Tensor:
        """``transpose(B @ A) * scale`` in float32: peft's ``get_delta_weight`` on float32 adapter weights."""
        d = self.b.to(torch.float32) @ self.a.to(torch.float32)
        return (d.T if self.transpose else d) * self.scale


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What ``export_merged`` wrote."""

    out: str
    shards: list[str]
    tensors: int
    merged_modules: int
    bytes_written: int
    largest_tensor_bytes: int  # the base tensor kept in memory at once, before its float32 copy
    seconds: float


def export_merged(adapter_dir: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike, *,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                  progress: Callable[[int, int], None] | None = None, any_base: bool = False) -> ExportReport:
    """Merge the LoRA adapter in ``adapter_dir`` into ``base`` (a folder or cached hub id) and write a bf16
    model to ``out``. ``progress(done, total)`` is called after each tensor. The adapter must fit the base:
    every LoRA pair's shape (always), and the base it names (``base_model_name_or_path``, when its config
    has one) must be ``base`` (the same folder, the same hub id, or a folder of the same name), unless
    ``any_base``."""
    started = time.perf_counter()
    adapter_dir = Path(adapter_dir)
    folder = resolve_folder(base)
    out = Path(out)
    _check_out(out, folder, adapter_dir, overwrite)
    specs = read_checkpoint_index(folder)
    pairs = read_adapter(adapter_dir, specs)
    if not any_base:
        check_base_name(adapter_dir, str(base), folder)
    shards = plan_shards(specs, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    weight_map: dict[str, str] = {}
    written = 0
    done = 0
    merged = 0
    largest = 0
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(spec: TensorSpec) -> torch.Tensor:
            from safetensors import safe_open

            if spec.file not in handles:
                handles[spec.file] = stack.enter_context(safe_open(spec.file, framework="pt", device="cpu"))
            return handles[spec.file].get_tensor(spec.name)

        def produce(key: str) -> torch.Tensor:
            nonlocal done, merged, largest
            spec = specs[key]
            largest = max(largest, spec.nbytes)
            tensor = read(spec)
            pair = pairs.get(key)
            if pair is not None:
                # float32 sum, one rounding to bf16 (see the module docstring)
                tensor = (tensor.to(torch.float32) + pair.delta()).to(OUT_DTYPE)
                merged += 1
            elif tensor.is_floating_point():
                tensor = tensor.to(OUT_DTYPE)
            done += 1
            if progress is not None:
                progress(done, len(specs))
            return tensor

        for shard_name, keys in zip(names, shards):
            entries = [(key, _out_dtype(specs[key]), specs[key].shape) for key in keys]
            written += write_safetensors(out / shard_name, entries, produce, metadata={"format": "pt"})
            weight_map.update((key, shard_name) for key in keys)

    if len(names) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(_out_dtype(s), s.shape) for s in specs.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    _write_config(folder, out)
    _copy_side_files(folder, adapter_dir, out)
    return ExportReport(out=str(out), shards=names, tensors=len(specs), merged_modules=merged, bytes_written=written,
                        largest_tensor_bytes=largest, seconds=time.perf_counter() - started)


# -- the adapter ------------------------------------------------------------------------------------

def read_adapter(adapter_dir: Path, specs: dict[str, TensorSpec]) -> dict[str, LoraPair]:
    """The adapter's LoRA pairs keyed by the base checkpoint key they merge into, checked against ``specs``."""
    config_path = adapter_dir / ADAPTER_CONFIG
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise ExportError(f"{adapter_dir} has no {ADAPTER_CONFIG}; pass the folder `poros-fx train --out` (or "
                          f"peft's save_pretrained) wrote")
    if not weights_path.is_file():
        pickled = adapter_dir / "adapter_model.bin"
        extra = (" (it holds adapter_model.bin, a pickle poros-fx never loads; re-save it with safetensors)"
                 if pickled.exists() else "")
        raise ExportError(f"{adapter_dir} has no {ADAPTER_WEIGHTS}{extra}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_path}: not an adapter config (a JSON {type(config).__name__}, not an object)")
    if config.get("peft_type") != "LORA":
        raise ExportError(f"{config_path}: peft_type is {config.get('peft_type')!r}; export merges LoRA adapters only")
    unsupported = [k for k in ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices",
                               "target_parameters", "layer_replication") if config.get(k)]
    if unsupported:
        raise ExportError(f"{config_path}: {', '.join(unsupported)} set; export merges plain LoRA pairs only (merge "
                          f"such an adapter with peft's merge_and_unload on a model that fits in memory)")
    try:
        r = int(config["r"])
        alpha = float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{config_path}: no usable r / lora_alpha ({e!r}); a damaged adapter config?") from None
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))

    from safetensors.torch import load_file

    try:
        read_safetensors_header(weights_path)  # a truncated or corrupt file, named in one line
        tensors = load_file(weights_path)  # small: the adapter only
    except LoaderError as e:
        raise ExportError(str(e)) from None
    except Exception as e:  # safetensors' own errors (SafetensorError, OSError, ...): the file, in one line
        raise ExportError(f"{weights_path}: cannot read the adapter weights ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}); re-save or "
                          f"re-copy the adapter") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name = key.removeprefix(_PREFIX)
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight|(.+)\.(lora_embedding_A|lora_embedding_B)", name)
        if match is None:
            raise ExportError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight; export merges plain LoRA "
                              f"pairs only")
        module = match.group(1) or match.group(3)
        kind = match.group(2) or match.group(4)
        halves.setdefault(module, {})[kind] = value

    pairs = {}
    for module, half in sorted(halves.items()):
        embedding = "lora_embedding_A" in half or "lora_embedding_B" in half
        a = half.get("lora_embedding_A" if embedding else "lora_A")
        b = half.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None:
            raise ExportError(f"{weights_path}: module {module!r} has only one of its LoRA A/B weights (a damaged "
                              f"adapter?)")
        weight = f"{module}.weight"
        if weight not in specs:
            raise ExportError(f"the adapter changes {weight!r}, which the base checkpoint does not have (wrong --base, "
                              f"or a weight tied to another one?)")
        m_r = int(rank_pattern.get(_pattern_key(rank_pattern, module), r))
        m_alpha = float(alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha))
        if a.shape[0] != m_r or b.shape[1] != m_r:
            raise ExportError(f"{weights_path}: {module!r} has rank {a.shape[0]}/{b.shape[1]} (A/B), "
                              f"{config_path.name} says r={m_r}")
        transpose = embedding or fan_in_fan_out
        shape = (a.shape[1], b.shape[0]) if transpose else (b.shape[0], a.shape[1])
        if tuple(specs[weight].shape) != shape:
            raise ExportError(f"{module!r}: the adapter's delta has shape {list(shape)}, the base weight "
                              f"{list(specs[weight].shape)} (adapter trained on a different base?)")
        scale = m_alpha / math.sqrt(m_r) if rslora else m_alpha / m_r  # peft's LoraLayer.update_layer
        pairs[weight] = LoraPair(module=module, weight=weight, a=a, b=b, scale=scale, transpose=transpose)
    if not pairs:
        raise ExportError(f"{weights_path}: no LoRA weights in the adapter")
    return pairs


def check_base_name(adapter_dir: Path, base: str, folder: Path) -> None:
    """Refuse a base other than the one the adapter names (``base_model_name_or_path``): matching shapes do not
    make it the same model (a fine-tune of it, another size's sibling with equal widths)."""
    try:
        named = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return  # read_adapter has already said what is wrong with the config
    if not named:
        return
    same = (named == base or Path(named).expanduser().resolve() == folder.resolve()
            or Path(named).name.lower() == Path(base).name.lower() or Path(named).name.lower() == folder.name.lower())
    if not same:
        raise ExportError(f"{adapter_dir / ADAPTER_CONFIG}: the adapter was trained on {named!r} "
                          f"(base_model_name_or_path), not {base!r}; pass that base, or --any-base to merge into this "
                          f"one anyway (its shapes match)")


def _pattern_key(patterns: dict[str, Any], module: str) -> str:
    """peft's ``get_pattern_key``: the first pattern that matches the end of the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


# -- shards -----------------------------------------------------------------------------------------

def plan_shards(specs: dict[str, TensorSpec], max_shard_bytes: int) -> list[list[str]]:
    """Checkpoint keys in model order (embedding, layer 0, 1, ..., the rest), cut into shards of at most
    ``max_shard_bytes`` at decoder-layer boundaries (a layer larger than that gets a shard of its own)."""
    if max_shard_bytes < 1:
        raise ExportError(f"max shard size must be positive, got {max_shard_bytes}")
    groups: dict[tuple[int, int], list[str]] = {}
    for key in specs:
        match = _LAYER.search(key)
        if match:
            group = (1, int(match.group(1)))
        else:
            group = (0, 0) if "embed" in key else (2, 0)  # the embedding first, norm and head last
        groups.setdefault(group, []).append(key)
    shards: list[list[str]] = []
    size = 0
    for group in sorted(groups):
        keys = sorted(groups[group])
        nbytes = sum(_nbytes(_out_dtype(specs[k]), specs[k].shape) for k in keys)
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(keys)
        size += nbytes
    if shards and not shards[0]:
        shards.pop(0)
    return shards


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file tensor by tensor; returns its size in bytes.

    ``entries`` gives each tensor's name, dtype and shape, so the header is written first; ``produce(name)``
    is then called once per tensor, in file order, and only its bytes are held. Written to a temporary
    name and renamed at the end, so a failed export never leaves a file that looks complete.
    """
    # widest dtypes first, like safetensors' own serializer: every tensor stays aligned to its item size
    entries = sorted(entries, key=lambda e: (-itemsize(e[1]), e[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in entries:
            tensor = produce(name)
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ExportError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}, expected {dtype} "
                                  f"{list(shape)} (a corrupt base checkpoint?)")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    os.replace(tmp, path)
    return 8 + len(raw) + offset


def _out_dtype(spec: TensorSpec) -> torch.dtype:
    if spec.dtype not in _DTYPES:
        raise ExportError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}, which export does not handle")
    dtype = _DTYPES[spec.dtype]
    return OUT_DTYPE if dtype.is_floating_point else dtype


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * itemsize(dtype)


# -- the rest of the folder -------------------------------------------------------------------------

def _check_out(out: Path, base: Path, adapter_dir: Path, overwrite: bool) -> None:
    resolved = out.resolve()
    if resolved in (base.resolve(), adapter_dir.resolve()):
        raise ExportError(f"{out} is the base or the adapter folder; write the merged model to a new folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; pick a new folder (or pass --overwrite to replace what "
                          f"is there)")
    if overwrite and out.is_dir():
        # stale shards of an earlier export would sit next to the new index and confuse loaders
        for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)


def _write_config(base: Path, out: Path) -> None:
    """The base's config.json as written, with the dtype set to bfloat16 (the merged weights' dtype)."""
    path = base / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: cannot read it ({e})") from None
    config["dtype"] = "bfloat16"
    if "torch_dtype" in config:  # the key older transformers versions read
        config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _copy_side_files(base: Path, adapter_dir: Path, out: Path) -> None:
    """generation_config.json and the tokenizer files; the adapter's own tokenizer files win (training may
    have added tokens)."""
    for source in (base, adapter_dir):
        for name in ("generation_config.json", *TOKENIZER_FILES):
            if name == "generation_config.json" and source == adapter_dir:
                continue
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)

