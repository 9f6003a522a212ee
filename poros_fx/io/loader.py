"""The loader's public functions: a checkpoint (or a config) straight into a prepared poros-fx model.

``load_pretrained`` builds the module tree on the ``meta`` device (no memory), then fills it one
tensor at a time: each tensor is read from its safetensors file (plain reads), cast to bf16,
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

The parts live beside this module, one concern each: ``checkpoint`` (reading files), ``meta_model``
(building the module tree and matching it to a checkpoint), ``quantize`` (NF4), ``random_init``
(``from_config``'s weights), ``host_memory`` (the store's size, the RAM check) and ``manifest`` (a shared
host store). The names other code imports from here stay importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
from torch import nn

from ..errors import PorosConfigError
from ..families import Family, resolve
from ..options import prepare_settings, resolve_device
from ..prepare import prepare, unwrap
from ..runtime.arena import HostArena, nbytes
from ..runtime.host_ram import host_ram_available, proc_meminfo_available
from ..runtime.share import HostShare, wants_share
from ..units import itemsize
from . import manifest
from .checkpoint import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, INDEX_FILE, ITEMSIZE, SINGLE_FILE, CheckpointReader, Fetch,
                         LoaderError, TensorSpec, check_adapter, read_checkpoint_index, read_config, read_safetensors_header,
                         resolve_folder)
from .host_memory import arena_capacity, check_ram, store_bytes
from .meta_model import (COMPUTE_DTYPE, attach_adapter, check_quantization, freeze_adapter, is_config, is_nf4_experts,
                         is_nf4_weight,
                         load_generation_config, meta_model, numel, plan_reads, quiet_peft, read_groups,
                         rebuild_buffers, split_name)
from .nf4_experts import place_nf4_experts
from .quantize import place_nf4, quantize_nf4_weight
from .random_init import init_std, random_fetcher

if TYPE_CHECKING:
    import peft
    import transformers

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "COMPUTE_DTYPE", "INDEX_FILE", "SINGLE_FILE", "LoadReport",
           "LoaderError", "Quantization", "TensorSpec", "attach_adapter", "check_adapter", "estimate_host_bytes",
           "from_config", "host_ram_available", "load_pretrained", "load_report", "proc_meminfo_available",
           "quiet_peft", "read_checkpoint_index", "read_safetensors_header", "resolve_folder"]

Quantization = Literal["nf4", "bf16"]
REPORT_ATTR = "_poros_load_report"


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


def load_pretrained(name_or_path: str | os.PathLike, quantization: Quantization = "nf4",
                    device: str | torch.device | None = None, *, lora: "peft.PeftConfig | None" = None,
                    family: Family | None = None, adapter: str | os.PathLike | None = None, trainable: bool = True,
                    revision: str | None = None, cache_dir: str | os.PathLike | None = None, progress: bool = True,
                    available_ram: int | Callable[[], int | None] | None = None, head_chunks: int | None = None,
                    share: bool | None = None, **options: Any) -> nn.Module:
    """Load a causal LM checkpoint tensor by tensor into a prepared poros-fx model, with an adapter or without.

    ``name_or_path``: a folder written by ``save_pretrained`` (``model.safetensors`` or sharded with
    ``model.safetensors.index.json``), or a hub id already in the local Hugging Face cache (never
    downloaded; ``revision``/``cache_dir`` select the snapshot). ``quantization``: ``"nf4"`` (decoder
    linears in bitsandbytes NF4, double-quantized, blocksize 64, bf16 compute; the rest bf16) or
    ``"bf16"``. ``device``, ``family``, ``head_chunks`` and the streaming ``options`` (``block_size``,
    ``prefetch``, ``codegen``, ``memory_budget``, ...: ``options.PREPARE_DEFAULTS``) are
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
    adapter_dir = _check_args(quantization, lora, options, adapter, trainable, share)  # before a byte is read
    compute = resolve_device(device)
    folder = resolve_folder(name_or_path, revision=revision, cache_dir=cache_dir)
    config = read_config(folder)
    fam = resolve(getattr(config, "model_type", None), family)
    specs = read_checkpoint_index(folder)
    model = meta_model(config, quantization, fam)
    plan = plan_reads(model, specs, folder)
    in_flight = max((s.nbytes + s.numel * itemsize(COMPUTE_DTYPE) for _, s in plan), default=0)
    host_bytes = store_bytes(model)

    with contextlib.ExitStack() as files:
        reader = CheckpointReader(files)
        total = sum(s.numel * ITEMSIZE[s.dtype] for _, s in plan)  # the bytes of what is read (MXFP4 as bf16)

        def fill(arena: HostArena) -> int:
            with _progress(f"loading {Path(folder).name}", total, len(plan), progress) as advance:
                return _materialize(model, [(names, reader.fetcher(spec)) for names, spec in plan], compute,
                                    advance, arena)

        arena, peak, shared = _fill(model, fill, share,
                                    lambda: check_ram(str(folder), host_bytes, in_flight, available_ram, quantization))
    rebuild_buffers(model, config)
    load_generation_config(model, folder)
    report = LoadReport(source=str(folder), quantization=quantization, device=str(compute), tensors=len(plan),
                        bytes_read=reader.bytes_read, host_bytes=host_bytes, peak_inflight_bytes=peak,
                        seconds=0.0, shared_ranks=shared[0], attached=shared[1])
    return _finish(model, lora, adapter_dir, trainable, compute, family, report, started, arena, head_chunks,
                   options)


def from_config(config: "transformers.PretrainedConfig | str | os.PathLike", quantization: Quantization = "nf4",
                device: str | torch.device | None = None, seed: int = 0, *, lora: "peft.PeftConfig | None" = None,
                family: Family | None = None, adapter: str | os.PathLike | None = None, trainable: bool = True,
                progress: bool = True, available_ram: int | Callable[[], int | None] | None = None,
                head_chunks: int | None = None, share: bool | None = None, **options: Any) -> nn.Module:
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
    adapter_dir = _check_args(quantization, lora, options, adapter, trainable, share)  # before a byte is read
    compute = resolve_device(device)
    if not is_config(config):
        config = read_config(resolve_folder(config))
    fam = resolve(getattr(config, "model_type", None), family)
    model = meta_model(config, quantization, fam)
    groups = read_groups(model)
    in_flight = max((numel(meta) * (4 + itemsize(COMPUTE_DTYPE)) for _, meta in groups), default=0)
    host_bytes = store_bytes(model)
    source = f"random-init (seed={seed})"

    std = init_std(config)
    jobs = [(names, random_fetcher(model, names[0], meta, seed, std, compute)) for names, meta in groups]
    total = sum(numel(meta) * itemsize(COMPUTE_DTYPE) for _, meta in groups)

    def fill(arena: HostArena) -> int:
        with _progress(f"initializing {getattr(config, 'model_type', 'model')} (seed {seed})", total, len(jobs),
                       progress) as advance:
            return _materialize(model, jobs, compute, advance, arena)

    arena, peak, shared = _fill(model, fill, share,
                                lambda: check_ram(source, host_bytes, in_flight, available_ram, quantization))
    rebuild_buffers(model, config)
    report = LoadReport(source=source, quantization=quantization, device=str(compute), tensors=len(jobs),
                        bytes_read=0, host_bytes=host_bytes, peak_inflight_bytes=peak, seconds=0.0,
                        shared_ranks=shared[0], attached=shared[1])
    return _finish(model, lora, adapter_dir, trainable, compute, family, report, started, arena, head_chunks,
                   options)


def load_report(model: nn.Module) -> LoadReport:
    """The ``LoadReport`` of a model made by ``load_pretrained`` or ``from_config``."""
    report = getattr(unwrap(model), REPORT_ATTR, None)
    if report is None:
        raise PorosConfigError("model was not made by poros_fx.load_pretrained or from_config")
    return report


def estimate_host_bytes(config: "transformers.PretrainedConfig", quantization: Quantization = "nf4", *,
                        family: Family | None = None) -> int:
    """Bytes the base of ``config`` takes in the host store (exact for the layouts this loader makes)."""
    check_quantization(quantization)
    fam = resolve(getattr(config, "model_type", None), family)
    return store_bytes(meta_model(config, quantization, fam))


def _check_args(quantization: Any, lora: Any, options: dict[str, Any], adapter: Any = None, trainable: Any = True,
                share: Any = None) -> Path | None:
    """Everything that can be wrong with the arguments, raised before a byte is read; returns the adapter
    folder (checked) when ``adapter`` is given."""
    check_quantization(quantization)
    prepare_settings(options)
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
        owner_name, attr = split_name(names[0])
        owner = model.get_submodule(owner_name)
        meta = getattr(owner, attr)
        # an NF4 skeleton's weight is float32 on meta; bitsandbytes quantizes the bf16 weight, as from_pretrained
        nf4_experts = is_nf4_experts(owner, attr)
        target_dtype = COMPUTE_DTYPE if is_nf4_weight(owner, attr) or nf4_experts else meta.dtype
        kept_as_fetched = attr not in owner._buffers and not is_nf4_weight(owner, attr) and not nf4_experts

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if kept_as_fetched and dtype == target_dtype:
                return arena.reserve(tuple(shape), dtype)
            return torch.empty(shape, dtype=dtype)

        raw = fetch(alloc)
        value = raw.to(target_dtype)
        inflight = nbytes(raw) + (nbytes(value) if value is not raw else 0)
        if nf4_experts:  # quantized where it was made (the compute device), stored where the parametrization reads
            peak = max(peak, inflight + place_nf4_experts(owner, attr, value, arena))
            advance(nbytes(raw))
            del raw, value
            continue
        if is_nf4_weight(owner, attr):
            if len(names) > 1:
                raise LoaderError(f"{names}: a tied NF4 weight is not supported")
            stored, device_bytes = quantize_nf4_weight(value, compute)
            inflight += device_bytes
            place_nf4(stored, arena)
        elif value.device.type != "cpu":
            stored = value.to("cpu")
        else:
            stored = value
        if kept_as_fetched:
            stored = arena.place(stored)  # a no-op when it was read or generated in place
        peak = max(peak, inflight)
        if attr in owner._buffers:
            for name in names:
                mod_name, leaf = split_name(name)
                model.get_submodule(mod_name)._buffers[leaf] = stored
        else:
            param = stored if is_nf4_weight(owner, attr) else nn.Parameter(stored, requires_grad=meta.requires_grad)
            for name in names:  # one Parameter under every name keeps a tied pair tied
                mod_name, leaf = split_name(name)
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
    capacity = arena_capacity(model)
    host = HostShare.open(capacity, before_create=check_ram) if wants_share(share) else None
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


def _finish(model: nn.Module, lora: Any, adapter: Path | None, trainable: bool, compute: torch.device,
            family: Family | None, report: LoadReport, started: float, arena: HostArena, head_chunks: int | None,
            options: dict[str, Any]) -> nn.Module:
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
    prepare(model, device=compute, family=family, head_chunks=head_chunks, _arena=arena, **options)
    if adapter is not None and not trainable:
        freeze_adapter(model)
    setattr(model, REPORT_ATTR, dataclasses.replace(report, seconds=time.perf_counter() - started))
    return model


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
