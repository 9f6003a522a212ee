"""Reading a checkpoint: safetensors headers and tensors, the folder a name resolves to, a saved adapter.

Everything here reads files and checks what can be checked before a byte of data is read: an index
that names only shards that exist, headers that parse and fit their files, no pickle (``torch.load``
is never called), hub ids resolved from the local Hugging Face cache only (nothing is downloaded).
``LoaderError`` is the error every part of the loader raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import PorosError

if TYPE_CHECKING:
    import transformers

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> a host tensor to fill
Fetch = Callable[[Alloc], torch.Tensor]  # produces one tensor; host tensors it makes come from the Alloc

SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


ADAPTER_CONFIG = "adapter_config.json"  # a saved PEFT adapter (``adapter=``)


ADAPTER_WEIGHTS = "adapter_model.safetensors"


MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header


FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class LoaderError(PorosError):
    """A checkpoint poros-fx cannot load: missing or damaged files, keys or dtypes it does not expect."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor as a safetensors header describes it (nothing read yet)."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code: "BF16", "F32", ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # where its bytes start in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """A fused 3-D expert weight (``...experts.gate_up_proj``, ``[experts, N, K]``) that a checkpoint holds
    one 2-D tensor per expert and projection, as the hub's mixture-of-experts checkpoints (and transformers
    5's ``save_pretrained``) do: ``parts[e]`` are expert ``e``'s tensors, stacked along N in that order
    (``gate_proj`` then ``up_proj``), as transformers' own conversion on load packs them."""

    name: str
    parts: tuple[tuple[TensorSpec, ...], ...]
    shape: tuple[int, ...]

    @property
    def file(self) -> Path:
        return self.parts[0][0].file

    @property
    def dtype(self) -> str:
        return self.parts[0][0].dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for expert in self.parts for p in expert)


MXFP4_GROUP = 32  # values per scale (OCP microscaling): 16 bytes of two FP4 values each


@dataclasses.dataclass(frozen=True)
class Mxfp4Spec:
    """A fused expert weight ``[experts, K, N]`` that gpt-oss checkpoints hold in MXFP4: ``blocks``
    ``[experts, N, K / 32, 16]`` (uint8, two FP4 e2m1 values a byte) and ``scales`` ``[experts, N, K / 32]``
    (uint8, a power-of-two exponent biased by 127 for each 32 values). Read as bf16 by transformers' own
    dequantization (``convert_moe_packed_tensors``, what ``Mxfp4Config(dequantize=True)`` loads), which is
    exact: every FP4 value times a power of two in the E8M0 range is a bf16 value."""

    name: str
    blocks: TensorSpec
    scales: TensorSpec
    shape: tuple[int, ...]
    dtype = "BF16"  # what it is read as

    @property
    def file(self) -> Path:
        return self.blocks.file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes


def read_checkpoint_index(folder: str | os.PathLike) -> dict[str, TensorSpec]:
    """Every tensor of the folder's safetensors checkpoint, from the file headers only.

    Checks what can be checked without reading data: the index is valid JSON and names only shards
    that exist and tensors those shards hold; every header parses and fits in its file.
    """
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise LoaderError(f"{index_path}: not a valid safetensors index ({e})") from None
        headers: dict[str, dict[str, TensorSpec]] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = folder / shard
            if not shard_path.is_file():
                raise LoaderError(f"{index_path} lists shard {shard!r}, which is not in {folder} (incomplete download "
                                  f"or copy?)")
            headers[shard] = read_safetensors_header(shard_path)
        specs = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise LoaderError(f"{index_path} says tensor {name!r} is in {shard!r}, but that shard has no such "
                                  f"tensor (index and shards come from different saves?)")
            specs[name] = headers[shard][name]
        return specs
    single = folder / SINGLE_FILE
    if single.is_file():
        return read_safetensors_header(single)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES
                     or p.name.endswith(".bin.index.json"))
    if pickles:
        raise LoaderError(pickle_message(folder, pickles))
    raise LoaderError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; poros-fx loads safetensors "
                      f"checkpoints written by save_pretrained")


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorSpec]:
    """The tensors a safetensors file declares, checked against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoaderError(f"{path}: truncated safetensors file ({size} bytes, not even a header length)")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER):
                raise LoaderError(f"{path}: truncated or corrupt safetensors file (header length {length} bytes, "
                                  f"file {size} bytes)")
            raw = f.read(length)
    except OSError as e:
        raise LoaderError(f"{path}: cannot read ({e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise LoaderError(f"{path}: corrupt safetensors header ({e})") from None
    data_size = size - 8 - length
    specs = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise LoaderError(f"{path}: corrupt safetensors header entry for tensor {name!r}: {entry!r}") from None
        if end > data_size:
            raise LoaderError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data section, but the "
                              f"file holds only {data_size} data bytes (re-download or re-save it)")
        expected = math.prod(shape) * ITEMSIZE[dtype] if dtype in ITEMSIZE else end - begin
        if begin < 0 or end - begin != expected:
            raise LoaderError(f"{path}: corrupt safetensors header: tensor {name!r} ({dtype}, shape {list(shape)}) "
                              f"has offsets {begin}..{end}, {end - begin} bytes instead of {expected}")
        specs[name] = TensorSpec(name=name, file=path, dtype=dtype, shape=shape, nbytes=end - begin,
                                 offset=8 + length + begin)
    return specs


def pickle_message(folder: Path, names: list[str]) -> str:
    return (f"{folder} holds a pickle checkpoint ({', '.join(names)}) and no safetensors; poros-fx never unpickles "
            f"(torch.load can run arbitrary code). Convert it once, in an environment you trust, e.g. "
            f"transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out) (writes "
            f"model.safetensors), and load `out`.")


class CheckpointReader:
    """Reads one tensor at a time with plain file reads into a fresh tensor.

    Not memory-mapped on purpose: a mapped checkpoint's pages count in the process's resident memory
    for as long as the mapping (and any tensor viewing it) lives, so a mapped load of a 15 GB checkpoint
    shows 15 GB more host RSS than the base it keeps. A read tensor owns its bytes and is freed as soon as
    the store has its copy; the page cache is the kernel's, not the process's.
    """

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def fetcher(self, spec: TensorSpec | ExpertsSpec | Mxfp4Spec) -> Fetch:
        if isinstance(spec, ExpertsSpec):
            return lambda alloc: self.read_experts(spec, alloc)
        if isinstance(spec, Mxfp4Spec):
            return lambda alloc: self.read_mxfp4(spec, alloc)
        return lambda alloc: self.read(spec, alloc)

    def read_experts(self, spec: ExpertsSpec, alloc: Alloc) -> torch.Tensor:
        """``spec``'s per-expert tensors, each read straight into its rows of the fused tensor."""
        if spec.dtype not in FLOAT_DTYPES:
            raise LoaderError(f"{spec.file}: tensor {spec.parts[0][0].name!r} has dtype {spec.dtype}, not a float type")
        fused = alloc(spec.shape, FLOAT_DTYPES[spec.dtype])
        for e, expert in enumerate(spec.parts):
            row = 0
            for part in expert:
                rows = fused[e, row:row + part.shape[0]]
                self.read(part, lambda shape, dtype, rows=rows: rows)
                row += part.shape[0]
        return fused

    def read_mxfp4(self, spec: Mxfp4Spec, alloc: Alloc) -> torch.Tensor:
        """``spec``'s blocks and scales, dequantized to bf16 by transformers one expert at a time (the
        temporaries are one expert's) into the fused ``[experts, K, N]`` tensor."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks = self.read_uint8(spec.blocks)
        scales = self.read_uint8(spec.scales)
        fused = alloc(spec.shape, torch.bfloat16)
        for e in range(spec.shape[0]):
            fused[e] = convert_moe_packed_tensors(blocks[e:e + 1], scales[e:e + 1], dtype=torch.bfloat16)[0]
        return fused

    def read_uint8(self, spec: TensorSpec) -> torch.Tensor:
        """A uint8 tensor (MXFP4's blocks and scales; not a float checkpoint tensor)."""
        if spec.dtype != "U8":
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}, expected U8 (MXFP4 blocks "
                              f"and scales)")
        return self.read_bytes(spec, torch.empty(spec.shape, dtype=torch.uint8))

    def read(self, spec: TensorSpec, alloc: Alloc = lambda shape, dtype: torch.empty(shape, dtype=dtype)) -> torch.Tensor:
        if spec.dtype not in FLOAT_DTYPES:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}, not a float type")
        return self.read_bytes(spec, alloc(spec.shape, FLOAT_DTYPES[spec.dtype]))

    def read_bytes(self, spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
        """``spec``'s bytes read into ``tensor`` (contiguous, of ``spec.nbytes``)."""
        buffer = tensor.reshape(-1).view(torch.uint8)
        try:
            handle = self.handles.get(spec.file)
            if handle is None:
                handle = self.handles[spec.file] = self.stack.enter_context(open(spec.file, "rb", buffering=0))
            handle.seek(spec.offset)
            view, got = memoryview(buffer.numpy()), 0
            while got < spec.nbytes:
                n = handle.readinto(view[got:])
                if not n:
                    break
                got += n
        except OSError as e:
            raise LoaderError(f"{spec.file}: cannot read tensor {spec.name!r} ({e})") from None
        if got != spec.nbytes:
            raise LoaderError(f"{spec.file}: truncated: tensor {spec.name!r} needs {spec.nbytes} bytes at offset "
                              f"{spec.offset}, the file gave {got} (re-download or re-save it)")
        self.bytes_read += spec.nbytes
        return tensor


def resolve_folder(name_or_path: str | os.PathLike, *, revision: str | None = None,
                   cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder as is, or the folder of a hub id's snapshot in the local cache (never downloads)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise LoaderError(pickle_message(path.parent, [path.name]))
        raise LoaderError(f"{path} is a file; pass the folder that holds config.json and the safetensors file(s)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    name = str(name_or_path)
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError:
        raise LoaderError(f"{name!r} is neither an existing folder nor a valid hub id (namespace/name)") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        where = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        rev = f" at revision {revision!r}" if revision else ""
        raise LoaderError(
            f"{name!r}{rev} is not a local folder and is not in the local Hugging Face cache ({where}); poros-fx "
            f"resolves hub ids from the cache only and does not attempt a download. Fetch it first where there is "
            f"network (e.g. `hf download {name}`), or pass the folder that holds it.") from None


def check_adapter(adapter: str | os.PathLike) -> Path:
    """The folder of a saved PEFT adapter, checked before anything is loaded: ``adapter_config.json`` is
    JSON, ``adapter_model.safetensors`` is there (a pickled ``adapter_model.bin`` is refused, as pickle
    checkpoints are) and its header fits the file (a truncated copy is named, not a traceback)."""
    path = Path(adapter).expanduser()
    if path.is_file():
        raise LoaderError(f"{path} is a file; pass the adapter folder (the one holding {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS})")
    folder = path if path.is_dir() else resolve_folder(adapter)  # a hub id already in the local cache
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise LoaderError(f"{folder} has no {ADAPTER_CONFIG}; pass a folder written by peft's save_pretrained or "
                          f"`poros-fx train --out`")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoaderError(f"{config_path}: not a valid adapter config ({e})") from None
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (folder / "adapter_model.bin").exists():
            raise LoaderError(f"{folder} holds a pickled adapter (adapter_model.bin) and no {ADAPTER_WEIGHTS}; "
                              f"poros-fx never unpickles (torch.load can run arbitrary code). Re-save it once, in an "
                              f"environment you trust, with peft's save_pretrained (safetensors is its default)")
        raise LoaderError(f"{folder} has no {ADAPTER_WEIGHTS} (an incomplete copy?)")
    read_safetensors_header(weights)  # truncated or corrupt: a LoaderError naming the file
    return folder


def read_config(folder: Path) -> "transformers.PretrainedConfig":
    """The ``config.json`` of a checkpoint folder (a pre-quantized one is refused)."""
    import transformers

    if not (folder / "config.json").is_file():
        raise LoaderError(f"{folder} has no config.json; pass a folder written by save_pretrained")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise LoaderError(f"{folder / 'config.json'}: transformers cannot read it ({e})") from None
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return config
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    if str(method) != "mxfp4":
        raise LoaderError(f"{folder / 'config.json'} describes a pre-quantized checkpoint (quantization_config, "
                          f"{method or 'no quant_method'}); poros-fx quantizes on load: pass the bf16/fp16/fp32 checkpoint (MXFP4 experts, "
                          f"as gpt-oss's, are read as bf16)")
    del config.quantization_config  # its MXFP4 experts are read as bf16 (Mxfp4Spec); the model built is a bf16 one
    return config
