"""Streamed loader: a checkpoint (or a config) straight into a prepared poros-fx model.

``load_pretrained`` builds the module tree on the ``meta`` device (no memory), then fills it one
tensor at a time: each tensor is read from its memory-mapped safetensors file, cast to bf16,
quantized to NF4 by bitsandbytes' own ``Params4bit`` path on the target device when it is a decoder
linear, moved to host memory and set into its module. So at most one tensor (well under one decoder
layer) is in flight, and the full-precision model never exists in host RAM or on the GPU. The
non-persistent buffers (rotary ``inv_freq``) are recomputed on the CPU the way ``from_pretrained``
does, tied embeddings are re-tied, the LoRA adapter (a new one from ``lora=``, a saved one from ``adapter=``,
or none) is attached and the result goes through ``poros_fx.prepare``.

``from_config`` does the same with random weights generated tensor by tensor from a seed, for
benchmarks without a checkpoint.

Hub ids are resolved only from the local Hugging Face cache; nothing is ever downloaded, and pickle
checkpoints (``.bin``) are refused: ``torch.load`` is never called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import struct
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
from torch import nn

from ..errors import PorosConfigError, PorosError
from ..families import Family, resolve
from ..runtime.budget import parse_size
from ..prepare import AUTO, check_block_options, check_codegen, prepare, quant_state_tensors, resolve_device, set_quant_state, unwrap
from ..runtime.arena import HostArena, aligned, nbytes
from .sizes import nf4_bytes

if TYPE_CHECKING:
    import peft
    import transformers

Quantization = Literal["nf4", "bf16"]
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> a host tensor to fill
Fetch = Callable[[Alloc], torch.Tensor]  # produces one tensor; host tensors it makes come from the Alloc

COMPUTE_DTYPE = torch.bfloat16  # dtype of every unquantized base tensor and of the NF4 compute
NF4_BLOCKSIZE = 64  # bitsandbytes' (and BitsAndBytesConfig's) default for NF4
NESTED_BLOCKSIZE = 256  # blocksize bitsandbytes uses for the nested (double) quantization of absmax
REPORT_ATTR = "_poros_load_report"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"  # a saved PEFT adapter (``adapter=``)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# checkpoint keys older transformers versions wrote and that from_pretrained drops as well
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)


class LoaderError(PorosError):
    """A checkpoint poros-fx cannot load: missing or damaged files, keys or dtypes it does not expect."""


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one ``load_pretrained`` / ``from_config`` call did (``poros_fx.load_report(model)``)."""

    source: str  # the checkpoint folder, or "random-init (seed=N)"
    quantization: str
    device: str  # where NF4 quantization ran (the compute device)
    tensors: int  # tensors materialized (a tied pair counts once)
    bytes_read: int  # checkpoint bytes read (0 for from_config)
    host_bytes: int  # bytes of the base in the host store
    peak_inflight_bytes: int  # most bytes of not-yet-stored tensors alive at once while loading
    seconds: float
    shared_ranks: int = 1  # processes of this host whose host store is this one arena (1: not shared)
    attached: bool = False  # this process mapped the arena another rank filled (it read nothing itself)


# -- public API -------------------------------------------------------------------------------------

def load_pretrained(name_or_path: str | os.PathLike, quantization: Quantization = "nf4",
                    device: str | torch.device | None = None, block_size: int = 1, prefetch: int | str = AUTO,
                    lora: "peft.PeftConfig | None" = None, family: Family | None = None, *,
                    adapter: str | os.PathLike | None = None, trainable: bool = True,
                    revision: str | None = None, cache_dir: str | os.PathLike | None = None, progress: bool = True,
                    available_ram: int | Callable[[], int | None] | None = None,
                    head_chunks: int | None = None, codegen: str | None = None,
                    memory_budget: int | str | None = None, share: bool | None = None) -> nn.Module:
    """Load a causal LM checkpoint tensor by tensor into a prepared poros-fx model, with an adapter or without.

    ``name_or_path``: a folder written by ``save_pretrained`` (``model.safetensors`` or sharded with
    ``model.safetensors.index.json``), or a hub id already in the local Hugging Face cache (never
    downloaded; ``revision``/``cache_dir`` select the snapshot). ``quantization``: ``"nf4"`` (decoder
    linears in bitsandbytes NF4, double-quantized, blocksize 64, bf16 compute; the rest bf16) or
    ``"bf16"``. ``device``, ``block_size``, ``prefetch``, ``family``, ``head_chunks``, ``codegen``, ``memory_budget`` are
    ``poros_fx.prepare``'s (``head_chunks=1`` keeps a 7B+ head whole, as an eager run computes it).
    ``lora`` (a ``peft.LoraConfig``) attaches a new adapter to train; ``adapter`` (a folder written by
    peft's ``save_pretrained`` or ``poros-fx train``) attaches a saved one, trainable or frozen
    (``trainable``); they are mutually exclusive. With neither, the prepared base itself is returned (for
    evaluation or inference, or to attach an adapter later with ``peft.PeftModel.from_pretrained``).
    ``available_ram`` overrides the reading of available host RAM (bytes, or a callable returning them).
    ``share``: under ``torchrun`` (torch.distributed initialized, several ranks on a host) the ranks of a
    host keep one copy of the base: the host's first rank reads the checkpoint into a shared-memory arena
    and the others map it (``poros_fx.distributed.HostShare``; call this on every rank). ``None``: share
    when torch.distributed is initialized with more than one rank; ``False``: each process its own copy.
    The model is returned in eval mode, as ``from_pretrained`` returns it; call ``model.train()`` to train.
    """
    started = time.perf_counter()
    adapter_dir = _check_args(quantization, lora, block_size, prefetch, codegen, adapter, trainable, share)
    parse_size(memory_budget)  # before a byte is read
    compute = resolve_device(device)
    folder = resolve_folder(name_or_path, revision=revision, cache_dir=cache_dir)
    config = _read_config(folder)
    fam = resolve(getattr(config, "model_type", None), family)
    specs = read_checkpoint_index(folder)
    model = _meta_model(config, quantization, fam)
    plan = _plan(model, specs, folder)
    in_flight = max((s.nbytes + s.numel * _itemsize(COMPUTE_DTYPE) for _, s in plan), default=0)
    host_bytes = _store_bytes(model)

    with contextlib.ExitStack() as files:
        reader = _Reader(files)
        total = sum(s.nbytes for _, s in plan)

        def fill(arena: HostArena) -> int:
            with _progress(f"loading {Path(folder).name}", total, len(plan), progress) as advance:
                return _materialize(model, [(names, reader.fetcher(spec)) for names, spec in plan], compute,
                                    advance, arena)

        arena, peak, shared = _fill(model, fill, share,
                                    lambda: _check_ram(str(folder), host_bytes, in_flight, available_ram, quantization))
    _rebuild_buffers(model, config)
    _load_generation_config(model, folder)
    report = LoadReport(source=str(folder), quantization=quantization, device=str(compute), tensors=len(plan),
                        bytes_read=reader.bytes_read, host_bytes=host_bytes, peak_inflight_bytes=peak,
                        seconds=0.0, shared_ranks=shared[0], attached=shared[1])
    return _finish(model, lora, adapter_dir, trainable, compute, block_size, prefetch, family, report, started, arena,
                   head_chunks, codegen, memory_budget)


def from_config(config: "transformers.PretrainedConfig | str | os.PathLike", quantization: Quantization = "nf4",
                device: str | torch.device | None = None, seed: int = 0, lora: "peft.PeftConfig | None" = None,
                block_size: int = 1, prefetch: int | str = AUTO, family: Family | None = None, *,
                adapter: str | os.PathLike | None = None, trainable: bool = True, progress: bool = True,
                available_ram: int | Callable[[], int | None] | None = None,
                head_chunks: int | None = None, codegen: str | None = None,
                memory_budget: int | str | None = None, share: bool | None = None) -> nn.Module:
    """Like ``load_pretrained`` with random-init weights instead of a checkpoint (benchmarks, no hub).

    Each tensor is generated on its own from ``seed`` and its name (normal(0, ``initializer_range``) for
    linear and embedding weights, ones for norm weights, zeros for biases), on the compute device, then
    quantized and stored like a loaded one. The same seed on the same device type gives the same weights,
    whatever the number of layers. ``config`` may also be a folder or cached hub id holding a config.json.
    ``lora`` / ``adapter`` / ``trainable`` / ``share`` as in ``load_pretrained`` (an adapter trained on these
    random weights fits them only: load it back with the same config and seed). Shared, only the first rank
    of each host generates the weights.
    """
    started = time.perf_counter()
    adapter_dir = _check_args(quantization, lora, block_size, prefetch, codegen, adapter, trainable, share)
    parse_size(memory_budget)  # before a byte is read
    compute = resolve_device(device)
    if not _is_config(config):
        config = _read_config(resolve_folder(config))
    fam = resolve(getattr(config, "model_type", None), family)
    model = _meta_model(config, quantization, fam)
    groups = _param_groups(model)
    in_flight = max((_numel(meta) * (4 + _itemsize(COMPUTE_DTYPE)) for _, meta in groups), default=0)
    host_bytes = _store_bytes(model)
    source = f"random-init (seed={seed})"

    std = _init_std(config)
    jobs = [(names, _random_fetcher(model, names[0], meta, seed, std, compute)) for names, meta in groups]
    total = sum(_numel(meta) * _itemsize(COMPUTE_DTYPE) for _, meta in groups)

    def fill(arena: HostArena) -> int:
        with _progress(f"initializing {getattr(config, 'model_type', 'model')} (seed {seed})", total, len(jobs),
                       progress) as advance:
            return _materialize(model, jobs, compute, advance, arena)

    arena, peak, shared = _fill(model, fill, share,
                                lambda: _check_ram(source, host_bytes, in_flight, available_ram, quantization))
    _rebuild_buffers(model, config)
    report = LoadReport(source=source, quantization=quantization, device=str(compute), tensors=len(jobs),
                        bytes_read=0, host_bytes=host_bytes, peak_inflight_bytes=peak, seconds=0.0,
                        shared_ranks=shared[0], attached=shared[1])
    return _finish(model, lora, adapter_dir, trainable, compute, block_size, prefetch, family, report, started, arena,
                   head_chunks, codegen, memory_budget)


def load_report(model: nn.Module) -> LoadReport:
    """The ``LoadReport`` of a model made by ``load_pretrained`` or ``from_config``."""
    report = getattr(unwrap(model), REPORT_ATTR, None)
    if report is None:
        raise PorosConfigError("model was not made by poros_fx.load_pretrained or from_config")
    return report


def estimate_host_bytes(config: "transformers.PretrainedConfig", quantization: Quantization = "nf4", *,
                        family: Family | None = None) -> int:
    """Bytes the base of ``config`` takes in the host store (exact for the layouts this loader makes)."""
    _check_quantization(quantization)
    fam = resolve(getattr(config, "model_type", None), family)
    return _store_bytes(_meta_model(config, quantization, fam))


def host_ram_available() -> int | None:
    """Available host RAM in bytes: psutil when installed, else /proc/meminfo's MemAvailable, else None."""
    try:
        import psutil
    except ImportError:
        return proc_meminfo_available()
    return int(psutil.virtual_memory().available)


def proc_meminfo_available(path: str | os.PathLike = "/proc/meminfo") -> int | None:
    """``MemAvailable`` from a /proc/meminfo-format file, in bytes (None when absent or unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def resolve_folder(name_or_path: str | os.PathLike, *, revision: str | None = None,
                   cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder as is, or the folder of a hub id's snapshot in the local cache (never downloads)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix in _PICKLE_SUFFIXES:
            raise LoaderError(_pickle_message(path.parent, [path.name]))
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


# -- checkpoint files -------------------------------------------------------------------------------

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
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES
                     or p.name.endswith(".bin.index.json"))
    if pickles:
        raise LoaderError(_pickle_message(folder, pickles))
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
            if length > min(size - 8, _MAX_HEADER):
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
        expected = math.prod(shape) * _ITEMSIZE[dtype] if dtype in _ITEMSIZE else end - begin
        if begin < 0 or end - begin != expected:
            raise LoaderError(f"{path}: corrupt safetensors header: tensor {name!r} ({dtype}, shape {list(shape)}) "
                              f"has offsets {begin}..{end}, {end - begin} bytes instead of {expected}")
        specs[name] = TensorSpec(name=name, file=path, dtype=dtype, shape=shape, nbytes=end - begin,
                                 offset=8 + length + begin)
    return specs


def _pickle_message(folder: Path, names: list[str]) -> str:
    return (f"{folder} holds a pickle checkpoint ({', '.join(names)}) and no safetensors; poros-fx never unpickles "
            f"(torch.load can run arbitrary code). Convert it once, in an environment you trust, e.g. "
            f"transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out) (writes "
            f"model.safetensors), and load `out`.")


class _Reader:
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

    def fetcher(self, spec: TensorSpec) -> "Fetch":
        return lambda alloc: self.read(spec, alloc)

    def read(self, spec: TensorSpec, alloc: "Alloc" = lambda shape, dtype: torch.empty(shape, dtype=dtype)) -> torch.Tensor:
        if spec.dtype not in _FLOAT_DTYPES:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}, not a float type")
        tensor = alloc(spec.shape, _FLOAT_DTYPES[spec.dtype])
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


# -- building the model -----------------------------------------------------------------------------

def _check_quantization(quantization: Any) -> None:
    if quantization not in ("nf4", "bf16"):
        raise PorosConfigError(f"quantization must be 'nf4' or 'bf16', got {quantization!r}")


def _check_args(quantization: Any, lora: Any, block_size: Any, prefetch: Any, codegen: Any = None,
                adapter: Any = None, trainable: Any = True, share: Any = None) -> Path | None:
    """Everything that can be wrong with the arguments, raised before a byte is read; returns the adapter
    folder (checked) when ``adapter`` is given."""
    _check_quantization(quantization)
    check_block_options(block_size, prefetch)
    check_codegen(codegen)
    if lora is not None and adapter is not None:
        raise PorosConfigError("pass lora= (a new adapter to train) or adapter= (a saved one to load), not both")
    if not isinstance(trainable, bool):
        raise PorosConfigError(f"trainable must be True or False, got {trainable!r}")
    if share is not None and not isinstance(share, bool):
        raise PorosConfigError(f"share must be True, False or None (share when torch.distributed is initialized), "
                               f"got {share!r}")
    if lora is not None:
        import peft

        if not isinstance(lora, peft.PeftConfig):
            raise PorosConfigError(f"lora must be a peft config such as peft.LoraConfig(...), got "
                                   f"{type(lora).__name__}")
    if quantization == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise PorosConfigError("quantization='nf4' needs bitsandbytes (pip install bitsandbytes), or use "
                                   "quantization='bf16'") from None
    return None if adapter is None else check_adapter(adapter)


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


def _is_config(obj: Any) -> bool:
    import transformers

    return isinstance(obj, transformers.PretrainedConfig)


def _read_config(folder: Path) -> "transformers.PretrainedConfig":
    import transformers

    if not (folder / "config.json").is_file():
        raise LoaderError(f"{folder} has no config.json; pass a folder written by save_pretrained")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise LoaderError(f"{folder / 'config.json'}: transformers cannot read it ({e})") from None
    if getattr(config, "quantization_config", None) is not None:
        raise LoaderError(f"{folder / 'config.json'} describes a pre-quantized checkpoint (quantization_config); "
                          f"poros-fx quantizes on load: pass the bf16/fp16/fp32 checkpoint")
    return config


def _meta_model(config: "transformers.PretrainedConfig", quantization: str, fam: Family) -> nn.Module:
    """The module tree with every tensor on ``meta``; NF4 decoder linears become ``Linear4bit`` skeletons."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE)
    if quantization == "nf4":
        from .quantize import linear4bit_like

        # the same replacement poros_fx.io.quantize.quantize_nf4 makes, without touching any weight
        for _, child in list(model.get_submodule(fam.layers).named_modules()):
            for attr, lin in list(child.named_children()):
                if type(lin) is not nn.Linear:
                    continue
                q = linear4bit_like(lin, compute_dtype=COMPUTE_DTYPE, nested=True)
                if lin.bias is not None:
                    q.bias = lin.bias  # keeps the model's bf16 (Linear4bit would make a float32 one)
                setattr(child, attr, q)
    return model


def _is_nf4_weight(module: nn.Module, attr: str) -> bool:
    if attr != "weight":
        return False
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def _split(name: str) -> tuple[str, str]:
    owner, _, attr = name.rpartition(".")
    return owner, attr


def _param_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
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


def _plan(model: nn.Module, specs: dict[str, TensorSpec], folder: Path) -> list[tuple[list[str], TensorSpec]]:
    """Which checkpoint tensor fills which group of names; every mismatch raised before reading."""
    plan = []
    missing = []
    used = set()
    for names, meta in _param_groups(model):
        present = [n for n in names if n in specs]
        if not present:
            missing.append(names[0])
            continue
        spec = specs[present[0]]  # a tied pair saved twice: the first name (the embedding) wins, as in transformers
        used.update(present)
        if spec.dtype not in _FLOAT_DTYPES:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has dtype {spec.dtype}; expected a float checkpoint "
                              f"({', '.join(_FLOAT_DTYPES)}). Pre-quantized or integer checkpoints are not loaded: "
                              f"pass the bf16/fp16/fp32 one")
        owner_name, attr = _split(names[0])
        owner = model.get_submodule(owner_name)
        expected = _nf4_logical_shape(owner) if _is_nf4_weight(owner, attr) else tuple(meta.shape)
        if spec.shape != expected:
            raise LoaderError(f"{spec.file}: tensor {spec.name!r} has shape {list(spec.shape)}, the model built from "
                              f"config.json expects {list(expected)} (config and weights from different models?)")
        plan.append((names, spec))
    if missing:
        raise LoaderError(f"{folder}: the checkpoint has no tensor for {len(missing)} model weight(s): "
                          f"{_few(missing)} (a different architecture, or an incomplete save?)")
    ignore = [re.compile(p) for p in (*_ALWAYS_IGNORED, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                                           or ()))]
    unexpected = [n for n in specs if n not in used and not any(p.search(n) for p in ignore)]
    if unexpected:
        raise LoaderError(f"{folder}: the checkpoint has {len(unexpected)} tensor(s) the model built from config.json "
                          f"does not: {_few(unexpected)} (config and weights from different models?)")
    return plan


def _nf4_logical_shape(module: nn.Module) -> tuple[int, int]:
    return (module.out_features, module.in_features)


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _numel(t: torch.Tensor) -> int:
    return math.prod(t.shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _materialize(model: nn.Module, jobs: list[tuple[list[str], Fetch]], compute: torch.device,
                 advance: Callable[[int], None], arena: HostArena) -> int:
    """Fill the meta model: for each group, fetch its tensor, convert it, set it under every name, free it.

    Every parameter ends in ``arena``, the host store's exact-size allocation ``prepare`` adopts: a tensor
    kept as it is fetched (a bf16 checkpoint's embedding, norms) is read or generated straight into its
    place there, anything converted first (quantized, cast) is copied in and its source freed. Returns
    the peak bytes of fetched tensors not yet set into the model (what is in flight).
    """
    peak = 0
    for names, fetch in jobs:
        owner_name, attr = _split(names[0])
        owner = model.get_submodule(owner_name)
        meta = getattr(owner, attr)
        # an NF4 skeleton's weight is float32 on meta; bitsandbytes quantizes the bf16 weight, as from_pretrained
        target_dtype = COMPUTE_DTYPE if _is_nf4_weight(owner, attr) else meta.dtype
        kept_as_fetched = attr not in owner._buffers and not _is_nf4_weight(owner, attr)

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if kept_as_fetched and dtype == target_dtype:
                return arena.reserve(tuple(shape), dtype)
            return torch.empty(shape, dtype=dtype)

        raw = fetch(alloc)
        value = raw.to(target_dtype)
        inflight = nbytes(raw) + (nbytes(value) if value is not raw else 0)
        if _is_nf4_weight(owner, attr):
            if len(names) > 1:
                raise LoaderError(f"{names}: a tied NF4 weight is not supported")
            stored, device_bytes = _quantize_nf4(value, compute)
            inflight += device_bytes
            _place_nf4(stored, arena)
        elif value.device.type != "cpu":
            stored = value.to("cpu")
        else:
            stored = value
        if kept_as_fetched:
            stored = arena.place(stored)  # a no-op when it was read or generated in place
        peak = max(peak, inflight)
        if attr in owner._buffers:
            for name in names:
                mod_name, leaf = _split(name)
                model.get_submodule(mod_name)._buffers[leaf] = stored
        else:
            param = stored if _is_nf4_weight(owner, attr) else nn.Parameter(stored, requires_grad=meta.requires_grad)
            for name in names:  # one Parameter under every name keeps a tied pair tied
                mod_name, leaf = _split(name)
                model.get_submodule(mod_name)._parameters[leaf] = param
        advance(nbytes(raw))
        del raw, value, stored  # nothing of this tensor but the stored copy outlives the iteration
    return peak


def _fill(model: nn.Module, fill: Callable[[HostArena], int], share: bool | None,
          check_ram: Callable[[], None]) -> tuple[HostArena, int, tuple[int, bool]]:
    """``model``'s host arena, filled by ``fill`` (returns the peak bytes in flight): a private arena, or
    under torch.distributed this host's shared one (``poros_fx.distributed.HostShare``), which the host's
    first rank fills and describes (``io/manifest.py``) and the others attach their ``meta`` model to.
    ``check_ram`` runs where host memory is taken (a private arena, a host's first rank). Returns the
    arena, the peak, and (ranks of this host sharing it, whether this rank attached)."""
    from .. import distributed
    from . import manifest

    capacity = _arena_capacity(model)
    host = distributed.HostShare.open(capacity, before_create=check_ram) if distributed.wants_share(share) else None
    if host is None:
        check_ram()
        arena = HostArena(capacity)
        return arena, fill(arena), (1, False)
    try:
        def lead() -> tuple[int, list[dict[str, Any]]]:
            peak = fill(host.arena)
            return peak, manifest.describe(model, host.arena)

        peak, described = host.from_leader(lead, "filling the shared host store")
        status: dict[str, Any] = {}
        if not host.leader:
            peak = 0  # this rank read and converted nothing
            try:
                manifest.attach(model, host.arena, described)
            except Exception as e:  # every rank hears of it just below
                status = {"error": f"{type(e).__name__}: {e}"}
        host.agree(status, "attaching the model to the shared host store")
    finally:
        host.close()
    return host.arena, peak, (host.local_world_size, not host.leader)


def _place_nf4(q: torch.Tensor, arena: HostArena) -> None:
    """Move a host ``Params4bit``'s packed weight and the quant-state tensors ``prepare`` keeps into the arena."""
    q.data = arena.place(q.data)
    set_quant_state(q.quant_state, {k: arena.place(t) for k, t in quant_state_tensors(q.quant_state).items()})


def _arena_capacity(model: nn.Module) -> int:
    """The host arena's exact size for this (meta) model: what ``prepare`` will keep of every parameter,
    each tensor aligned as the arena places it (NF4: packed weight, absmax, and nested: offset, the
    nested absmax and its code)."""
    total = 0
    for names, meta in _param_groups(model):
        owner_name, attr = _split(names[0])
        owner = model.get_submodule(owner_name)
        if attr in owner._buffers:
            continue
        if _is_nf4_weight(owner, attr):
            total += nf4_bytes(_numel(meta), NF4_BLOCKSIZE, align=aligned)
        else:
            total += aligned(_numel(meta) * meta.element_size())
    return total


def _quantize_nf4(weight: torch.Tensor, compute: torch.device) -> tuple[nn.Parameter, int]:
    """bitsandbytes' standard NF4 quantization of ``weight`` on ``compute``, the result moved to the host."""
    import bitsandbytes as bnb

    q = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4",
                          blocksize=NF4_BLOCKSIZE).to(compute)
    device_bytes = 0
    if q.device.type != "cpu":
        device_bytes = nbytes(weight) + nbytes(q)
        q = q.to("cpu")  # a quantized Params4bit moves its quant state along, in place
    return q, device_bytes


def _rebuild_buffers(model: nn.Module, config: "transformers.PretrainedConfig") -> None:
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
        raise LoaderError(f"tensors left unloaded: {_few(left)}")


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    if not (folder / "generation_config.json").is_file() or not getattr(model, "can_generate", lambda: False)():
        return
    import transformers

    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:  # from_pretrained also goes on without it; the weights are what matter
        warnings.warn(f"{folder / 'generation_config.json'} not used: {e}", stacklevel=3)


def _finish(model: nn.Module, lora: Any, adapter: Path | None, trainable: bool, compute: torch.device,
            block_size: int, prefetch: int | str, family: Family | None, report: LoadReport, started: float,
            arena: HostArena, head_chunks: int | None, codegen: str | None,
            memory_budget: int | str | None = None) -> nn.Module:
    import peft

    model.eval()  # as from_pretrained returns it
    if lora is not None:
        with quiet_peft():
            model = peft.get_peft_model(model, lora)
    elif adapter is not None:
        # attached as trainable even when it is to be frozen: prepare moves every frozen parameter into the
        # host store (whose exact size the loader fixed from the base alone); a frozen adapter stays a small
        # device-resident tensor like a trainable one, and is frozen just after prepare
        model = attach_adapter(model, adapter, trainable=True, source=report.source)
    else:
        model.requires_grad_(False)  # the base alone is frozen, as peft leaves it under an adapter
    # prepare moves the adapter and the buffers (rotary ``inv_freq``) to ``compute``, as in a model built
    # there, and takes the frozen base from the host into its store
    prepare(model, device=compute, block_size=block_size, prefetch=prefetch, family=family, head_chunks=head_chunks,
            codegen=codegen, memory_budget=memory_budget, _arena=arena)
    if adapter is not None and not trainable:
        _freeze_adapter(model)
    setattr(model, REPORT_ATTR, dataclasses.replace(report, seconds=time.perf_counter() - started))
    return model


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


def _freeze_adapter(model: nn.Module) -> None:
    """A loaded adapter made read-only, as ``PeftModel.from_pretrained(..., is_trainable=False)`` leaves it
    (the base is frozen already)."""
    model.requires_grad_(False)
    for cfg in getattr(model, "peft_config", {}).values():
        cfg.inference_mode = True


# -- random init (from_config) ----------------------------------------------------------------------

def _init_std(config: "transformers.PretrainedConfig") -> float:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return float(getattr(text, "initializer_range", None) or 0.02)


def _tensor_seed(seed: int, name: str) -> int:
    """A generator seed per tensor, so each tensor's values depend only on (seed, name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "little") >> 1


_RANDOM_CHUNK_ELEMENTS = 16 * 2**20  # fp32 values generated per call: 64 MB on the device at most


def _random_fetcher(model: nn.Module, name: str, meta: torch.Tensor, seed: int, std: float,
                    compute: torch.device) -> Fetch:
    owner_name, attr = _split(name)
    owner = model.get_submodule(owner_name)
    shape = _nf4_logical_shape(owner) if _is_nf4_weight(owner, attr) else tuple(meta.shape)
    if attr == "bias":
        kind = "zeros"
    elif "norm" in type(owner).__name__.lower():
        kind = "ones"
    else:
        kind = "normal"
    padding_idx = getattr(owner, "padding_idx", None) if isinstance(owner, nn.Embedding) else None

    # a decoder linear is quantized on the compute device; everything else goes to the host store as it is
    # made, so only the chunk being generated is on the device (a 72B's embedding is 2.5 GB in bf16)
    target = compute if _is_nf4_weight(owner, attr) else torch.device("cpu")

    def fetch(alloc: Alloc) -> torch.Tensor:
        w = alloc(shape, COMPUTE_DTYPE) if target.type == "cpu" else torch.empty(shape, dtype=COMPUTE_DTYPE,
                                                                                  device=target)
        if kind == "zeros":
            return w.zero_()
        if kind == "ones":
            return w.fill_(1)
        g = torch.Generator(device=compute).manual_seed(_tensor_seed(seed, name))
        rows = w.view(-1, shape[-1]) if w.dim() else w.view(1, 1)
        step = max(1, _RANDOM_CHUNK_ELEMENTS // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            part = torch.randn((min(step, rows.shape[0] - start), rows.shape[1]), generator=g, dtype=torch.float32,
                               device=compute)
            rows[start:start + part.shape[0]].copy_(part * std)  # copy_ rounds to bf16 as .to() does
        if padding_idx is not None:
            w[padding_idx].zero_()
        return w

    return fetch


# -- host memory ------------------------------------------------------------------------------------

def _store_bytes(model: nn.Module) -> int:
    """What ``prepare`` will put in the host store for this (meta) model: every parameter once."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            total += nf4_bytes(_numel(p), NF4_BLOCKSIZE) if _is_nf4_weight(module, attr) else _numel(p) * p.element_size()
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def _check_ram(source: str, host_bytes: int, in_flight: int, available_ram: int | Callable[[], int | None] | None,
               quantization: str) -> None:
    """Refuse before reading anything when the base cannot fit in available host RAM."""
    if callable(available_ram):
        available = available_ram()
    elif available_ram is None:
        available = host_ram_available()
    else:
        available = int(available_ram)
    if available is None:
        warnings.warn("could not read the available host RAM (no psutil, no /proc/meminfo); loading without "
                      "checking that the base fits", stacklevel=3)
        return
    needed = host_bytes + in_flight
    if needed <= available:
        return
    hint = " Use quantization='nf4' to shrink the decoder linears about 3.5x, free memory" \
        if quantization == "bf16" else " Free memory"
    raise LoaderError(f"not enough host RAM to load {source}: the {quantization} base needs about {_gib(needed)} "
                      f"({_gib(host_bytes)} in the host store + {_gib(in_flight)} in flight while loading) and "
                      f"only {_gib(available)} is available.{hint}, or use a machine with more RAM.")


# -- progress ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _progress(description: str, total_bytes: int, total_tensors: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (tensors, bytes, elapsed) on stderr when it is a terminal; a no-op otherwise."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        enabled = False
    if enabled:
        console = Console(stderr=True)
        enabled = console.is_terminal
    if not enabled:
        yield lambda nbytes: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.fields[tensors]}/{task.fields[total_tensors]} tensors"), DownloadColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(description, total=total_bytes, tensors=0, total_tensors=total_tensors)
        count = 0

        def advance(nbytes: int) -> None:
            nonlocal count
            count += 1
            bar.update(task, advance=nbytes, tensors=count)

        yield advance
