"""The streaming options, declared once (``PorosOptions``: each field's type, default, check and help),
and what the surfaces derive from them: ``torch.compile(..., backend="poros", options=...)``,
``prepare()`` and the loaders (``PREPARE_DEFAULTS``), ``@poros_fx.step``, the trainers' ``poros_options``,
``FineTuner``, ``poros-fx train``'s flags, ``run.toml`` and ``--resume``'s comparison
(``SAME_BITS_OPTIONS``). Also the device and codegen helpers every surface shares."""

from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from .errors import PorosConfigError
from .units import parse_size

DUMP_ENV = "POROS_FX_DUMP"
AUTO = "auto"  # prefetch depth measured from the first forward run (runtime/depth.py)
CODEGENS = ("inductor", "eager")  # how compiled regions run: fused kernels, or the aten graph as is


def check_block_options(block_size: Any, prefetch: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise PorosConfigError(f"block_size must be an integer >= 1 (decoder layers per streamed block), got {block_size!r}")
    if prefetch != AUTO and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise PorosConfigError(f"prefetch must be an integer >= 0 (blocks loaded ahead of the one computing) or "
                               f"'auto' (measured), got {prefetch!r}")


def check_budget_option(value: Any) -> None:
    """A ``memory_budget``: bytes, a size string, ``"auto"`` or ``None``."""
    if value != AUTO:
        parse_size(value)


def parse_prefetch(text: str) -> int | str:
    """A command line's ``--prefetch``: ``auto`` or an integer >= 0."""
    try:
        value: int | str = int(text)
    except ValueError:
        value = text  # "auto", or refused just below
    check_block_options(1, value)
    return value


def check_codegen(codegen: Any) -> str | None:
    if codegen is not None and codegen not in CODEGENS:
        raise PorosConfigError(f"codegen must be 'inductor' (fused kernels per region) or 'eager' (aten calls, equal "
                               f"to the eager loop), got {codegen!r}")
    return codegen


def default_codegen(device: torch.device) -> str:
    """The codegen a prepared model's regions get unless asked otherwise: ``"inductor"`` on CUDA (fused
    kernels; streamed == ``stream=False`` bit for bit, tested on the H200), ``"eager"`` on the CPU (aten
    calls, also bit-equal to the plain eager loop, and no C++ compile for a CPU run)."""
    return "inductor" if device.type == "cuda" else "eager"


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")  # one CPU device: "cpu:0" (accelerate's device under torch.distributed) is "cpu"
    if device.type not in ("cpu", "cuda"):
        raise PorosConfigError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PorosConfigError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or device=None")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_problem(text: str) -> str | None:
    """What is wrong with a command line's ``--device`` (cpu or cuda[:N], cuda only where torch sees one),
    or ``None``."""
    try:
        kind = torch.device(text).type
    except RuntimeError:  # torch cannot parse it
        kind = None
    if kind not in ("cpu", "cuda"):
        return f"must be cpu or cuda (or cuda:N), got {text!r}"
    if kind == "cuda" and not torch.cuda.is_available():
        return (f"{text!r} was asked for but torch sees no CUDA device (torch {torch.__version__}); use --device cpu, "
                "or leave it out")
    return None


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PorosConfigError(f"{name} must be True or False, got {value!r}")


def _check_optional_bool(name: str, value: Any) -> None:
    if value is not None:
        _check_bool(name, value)


def _check_block_size(name: str, value: Any) -> None:
    if value is not None:
        check_block_options(value, 0)


def _check_prefetch(name: str, value: Any) -> None:
    if value is not None:
        check_block_options(1, value)


def _check_codegen(name: str, value: Any) -> None:
    check_codegen(value)


def _check_budget(name: str, value: Any) -> None:
    check_budget_option(value)


def _check_dump(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise PorosConfigError(f"dump must be a folder path, got {value!r}")


def _check_save_activations(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PorosConfigError(f"save_activations must be an integer >= 0 (the last N decoder-layer blocks keep "
                               f"their activations instead of recomputing them), got {value!r}")


def _check_sequence_chunks(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PorosConfigError(f"sequence_chunks must be an integer >= 1 (token chunks each decoder layer's MLP and "
                               f"projections run in, recomputed one at a time in the backward; 1: off), got {value!r}")


_COMPILE_ONLY = object()  # an option prepare() does not take


def _option(default: Any, help: str, check: Callable[[str, Any], None], *, prepare: Any = _COMPILE_ONLY,
            same_bits: bool = True) -> Any:
    """One option's declaration. ``help``: what it does, for docstrings and the command line; ``check``
    refuses a bad value with what to do; ``prepare``: the default of ``prepare()`` and the loaders, which
    take it too (the model keeps it; the option given at compile time overrides it); ``same_bits``:
    changing it leaves every bit of the result as it is (a resumed run may change it)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "prepare": prepare,
                                                        "same_bits": same_bits})


@dataclasses.dataclass(frozen=True)
class PorosOptions:
    """The streaming options, declared once. ``torch.compile(..., backend="poros", options=...)``,
    ``@poros_fx.step(...)``, the trainers' ``poros_options``, ``FineTuner``, ``poros-fx train``'s flags and
    a run's ``run.toml`` take these names; ``prepare()`` and the loaders take those marked ``prepare``.
    ``None`` where an option is set at prepare: what the model was prepared with."""

    block_size: int | None = _option(None, "decoder layers streamed together as one block (default 1)",
                                     _check_block_size, prepare=1)
    prefetch: int | str | None = _option(
        None, "blocks loaded ahead of the one computing: an integer >= 0, or 'auto' (the default: one in the "
        "forward, the backward's depth measured in the first forward)", _check_prefetch, prepare=AUTO)
    stream: bool = _option(True, "False: the base stays on the device and nothing is recomputed (the "
                           "exactness reference)", _check_bool)
    dump: str | None = _option(None, f"folder for graph dumps after every pass ({DUMP_ENV} when not given)",
                               _check_dump)
    group_copies: bool = _option(True, "False: one copy per tensor instead of one per block (for A/B runs)",
                                 _check_bool)
    codegen: str | None = _option(
        None, "how decoder-layer regions run: 'inductor' (fused kernels) or 'eager' (aten calls, equal to the "
        "eager loop); default: inductor on CUDA, eager on the CPU (docs/exactness.md)", _check_codegen, prepare=None, same_bits=False)
    turnaround: bool = _option(True, "a training forward's last blocks stay for the backward, a backward's for "
                               "the next forward (False: evict and reload)", _check_bool)
    memory_budget: int | str | None = _option(
        None, "device memory the step may use ('24GB', bytes, or 'auto': what the device has free at the first "
        "step, less a margin); after the first step the blocks that fit stay resident. None: every block "
        "streams every step", _check_budget, prepare=None)
    block_major: bool | None = _option(
        None, "with gradient accumulation, each block runs all the step's micro-batches while it is loaded "
        "(default True; the same bits as micro-batch after micro-batch)", _check_optional_bool, prepare=True)
    chunked_loss: bool | None = _option(
        None, "a training forward with labels computes the head and the loss a vocabulary chunk at a time: never "
        "the whole logits (not bitwise HF's loss; default False)", _check_optional_bool, prepare=False,
        same_bits=False)
    offload_boundaries: bool | None = _option(
        None, "the hidden states saved between blocks wait in host memory until the backward needs them "
        "(default False)", _check_optional_bool, prepare=False)
    sequence_chunks: int | None = _option(
        None, "each decoder layer's MLP and linear projections run in this many token chunks, each recomputed on "
        "its own in the backward: their activations take 1/K of the memory at long sequences (not the eager loop's kernels; default 1: off; "
        "docs/exactness.md)", _check_sequence_chunks, prepare=1, same_bits=False)
    save_activations: int = _option(
        0, "the last N decoder-layer blocks keep their activations for the backward instead of recomputing them "
        "(memory for time; the same bits)", _check_save_activations)
    cuda_graphs: bool | None = _option(
        None, "replay each decoder layer's kernels from CUDA graphs (the same bits, a graph memory pool on top); "
        "default: on where the step computes on CUDA and graphs keep the guarantee", _check_optional_bool)
    least_memory: bool = _option(
        False, "the plan that holds the least device memory: every block streams every step, no CUDA graphs, "
        "nothing saved instead of recomputed", _check_bool)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "PorosOptions":
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise PorosConfigError(f"unknown poros option(s) {unknown}; known options: {sorted(known)}")
        for f in dataclasses.fields(cls):
            if f.name in options:
                f.metadata["check"](f.name, options[f.name])
        opts = cls(**options)
        if opts.least_memory:
            asked = [f"{name}={getattr(opts, name)!r}" for name, off in LEAST_MEMORY_OFF.items()
                     if getattr(opts, name) not in off]
            if asked:
                raise PorosConfigError(f"least_memory=True streams every block with no CUDA graphs and nothing saved; "
                                       f"it cannot be combined with {', '.join(asked)}: drop one of them")
        if opts.dump is None and os.environ.get(DUMP_ENV):
            opts = dataclasses.replace(opts, dump=os.environ[DUMP_ENV])
        return opts


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PorosOptions))
# the options prepare() and the loaders take (the model keeps them as its defaults)
PREPARE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.metadata["prepare"] for f in dataclasses.fields(PorosOptions) if f.metadata["prepare"] is not _COMPILE_ONLY})
# the options a run may change when it is resumed: none touches a bit of the result
SAME_BITS_OPTIONS = tuple(f.name for f in dataclasses.fields(PorosOptions) if f.metadata["same_bits"])
# where the trainers and `poros-fx train` differ from prepare's defaults: a trainer keeps what fits
TRAINER_DEFAULTS: Mapping[str, Any] = MappingProxyType({"memory_budget": AUTO})
# what least_memory leaves each of these options at (values a user may also give)
LEAST_MEMORY_OFF: Mapping[str, tuple[Any, ...]] = MappingProxyType(
    {"cuda_graphs": (None, False), "memory_budget": (None,), "save_activations": (0,)})


def option_help(name: str) -> str:
    """What option ``name`` does, as its declaration says."""
    return next(f.metadata["help"] for f in dataclasses.fields(PorosOptions) if f.name == name)


def given_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked (unknown names and bad values raise ``PorosConfigError``), without the ones left
    at ``None`` (not given)."""
    PorosOptions.from_dict({k: v for k, v in options.items() if v is not None})
    return {k: v for k, v in options.items() if v is not None}


def prepare_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The given options ``prepare()`` takes too, for a surface that prepares a model itself."""
    return {k: v for k, v in options.items() if k in PREPARE_DEFAULTS and v is not None}


def prepare_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """What ``prepare()`` and the loaders were given, checked, with their defaults for the rest. An option
    that is set at compile time is refused with where it goes."""
    later = sorted(set(options) & (set(OPTION_NAMES) - set(PREPARE_DEFAULTS)))
    if later:
        raise PorosConfigError(f"{', '.join(later)} is set when the model is compiled, not prepared: pass it to "
                               f"torch.compile(model, backend='poros', options={{...}}), @poros_fx.step(...) or the "
                               f"trainers' poros_options")
    PorosOptions.from_dict(options)
    return {**PREPARE_DEFAULTS, **{k: v for k, v in options.items() if v is not None}}


def cuda_graphs_choice(opts: PorosOptions, device: torch.device, offload_boundaries: bool,
                       sequence_chunks: int = 1) -> tuple[bool, str]:
    """Whether a step's region calls replay from CUDA graphs, and why, in a few words. Asked for where they
    cannot run, ``PorosConfigError``; left to the default, they are on where the step computes on CUDA and
    off where they could not keep the guarantee, with the reason."""
    chunked = sequence_chunks > 1  # stream=False runs the same chunked regions
    if opts.cuda_graphs:
        if device.type != "cuda":
            raise PorosConfigError(f"options={{'cuda_graphs': True}} captures CUDA kernels; this model computes on "
                                   f"{device}. Leave the option out on the CPU")
        if offload_boundaries and opts.stream:
            raise PorosConfigError("options={'cuda_graphs': True} cannot be combined with offload_boundaries (the copy "
                                   "stream reads the saved activations after the step's run, where a replay may "
                                   "write); use one of the two")
        if chunked:
            raise PorosConfigError("options={'cuda_graphs': True} cannot be combined with sequence_chunks > 1 (a "
                                   "chunk's recompute replays its dropout from the generator state read at run "
                                   "time, which a graph replay does not read again); use one of the two")
        return True, "on (options={'cuda_graphs': True})"
    if opts.cuda_graphs is False:
        return False, "off (options={'cuda_graphs': False})"
    if opts.least_memory:
        return False, "off (least_memory: their pool and load slots cost device memory)"
    if device.type != "cuda":
        return False, f"off (CUDA only; this step computes on {device})"
    if offload_boundaries and opts.stream:
        return False, ("off by default with offload_boundaries (the copy stream reads the saved activations after "
                       "a graph's run, where a replay may write)")
    if chunked:
        return False, ("off by default with sequence_chunks > 1 (a chunk's recompute replays its dropout from the "
                       "generator state read at run time)")
    return True, "on by default on CUDA (options={'cuda_graphs': False} or least_memory turns them off)"
