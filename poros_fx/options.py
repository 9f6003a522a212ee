"""The options every surface takes, and their checks: the ``options=`` dict of ``torch.compile(...,
backend="poros", options=...)``, ``block_size`` / ``prefetch`` / ``codegen`` / ``device`` as ``prepare``,
the loaders and the CLI take them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

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
    or ``None``; shared by the demo's and the CLI's option checks."""
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


# what least_memory leaves each of these options at (values a user may also give)
LEAST_MEMORY_OFF: dict[str, tuple[Any, ...]] = {"cuda_graphs": (None, False), "memory_budget": (None,),
                                                "save_activations": (0,)}


@dataclasses.dataclass(frozen=True)
class PorosOptions:
    block_size: int | None = None  # None: what prepare() was given
    prefetch: int | str | None = None  # None: what prepare() was given (default "auto": measured, runtime/depth.py)
    stream: bool = True  # False: base resident, nothing recomputed (the parity reference)
    dump: str | None = None  # folder for graph dumps; POROS_FX_DUMP when not given
    group_copies: bool = True  # False: one copy (and allocation) per tensor instead of one per block; for A/B runs
    codegen: str | None = None  # "inductor" | "eager": how regions run; None: what prepare() was given
    # a training forward's last blocks stay for the backward, a backward's for the next forward (False: evict
    # and reload)
    turnaround: bool = True
    # device bytes the step may use ("24GB", or "auto": what the device has free at the first step, less a
    # margin: runtime/budget.py); None: what prepare() was given
    memory_budget: int | str | None = None
    block_major: bool | None = None  # an accumulation step's micro-batches go through each block together
    # (runtime/accumulate.py); None: what prepare() was given (default True)
    chunked_loss: bool | None = None  # head + loss in vocabulary chunks (loss.py); None: what the model has
    # (prepare(chunked_loss=...)); the model's forward reads it, so it must be set before tracing
    # (prepare.set_trace_options)
    offload_boundaries: bool | None = None  # saved block outputs wait in host memory (passes/offload.py);
    # None: what prepare() was given (default False)
    save_activations: int = 0  # the last N decoder-layer blocks keep their activations for the backward
    # instead of recomputing them (passes/recompute.py); their base is still reloaded for the backward
    # region calls captured in CUDA graphs and replayed (runtime/cuda_graphs.py); None: on where the step
    # computes on CUDA and graphs keep the guarantee (cuda_graphs_choice)
    cuda_graphs: bool | None = None
    # the plan that holds the least device memory: every block streams every step, no CUDA graphs (their
    # pool and load slots), nothing saved instead of recomputed
    least_memory: bool = False

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "PorosOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise PorosConfigError(f"unknown poros option(s) {unknown}; known options: {sorted(known)}")
        opts = cls(**options)
        check_block_options(1 if opts.block_size is None else opts.block_size,
                            0 if opts.prefetch is None else opts.prefetch)
        check_codegen(opts.codegen)
        check_budget_option(opts.memory_budget)
        for name in ("stream", "group_copies", "turnaround", "least_memory"):
            if not isinstance(getattr(opts, name), bool):
                raise PorosConfigError(f"{name} must be True or False, got {getattr(opts, name)!r}")
        for name in ("block_major", "chunked_loss", "offload_boundaries", "cuda_graphs"):
            if getattr(opts, name) is not None and not isinstance(getattr(opts, name), bool):
                raise PorosConfigError(f"{name} must be True or False, got {getattr(opts, name)!r}")
        if isinstance(opts.save_activations, bool) or not isinstance(opts.save_activations, int) or opts.save_activations < 0:
            raise PorosConfigError(f"save_activations must be an integer >= 0 (the last N decoder-layer blocks keep "
                                   f"their activations instead of recomputing them), got {opts.save_activations!r}")
        if opts.least_memory:
            asked = [f"{name}={getattr(opts, name)!r}" for name, off in LEAST_MEMORY_OFF.items()
                     if getattr(opts, name) not in off]
            if asked:
                raise PorosConfigError(f"least_memory=True streams every block with no CUDA graphs and nothing saved; "
                                       f"it cannot be combined with {', '.join(asked)}: drop one of them")
        if opts.dump is None and os.environ.get(DUMP_ENV):
            opts = dataclasses.replace(opts, dump=os.environ[DUMP_ENV])
        return opts


def cuda_graphs_choice(opts: PorosOptions, device: torch.device, offload_boundaries: bool) -> tuple[bool, str]:
    """Whether a step's region calls replay from CUDA graphs, and why, in a few words. Asked for where they
    cannot run, ``PorosConfigError``; left to the default, they are on where the step computes on CUDA and
    off where they could not keep the guarantee, with the reason."""
    if opts.cuda_graphs:
        if device.type != "cuda":
            raise PorosConfigError(f"options={{'cuda_graphs': True}} captures CUDA kernels; this model computes on "
                                   f"{device}. Leave the option out on the CPU")
        if offload_boundaries and opts.stream:
            raise PorosConfigError("options={'cuda_graphs': True} cannot be combined with offload_boundaries (the copy "
                                   "stream reads the saved activations after the step's run, where a replay may "
                                   "write); use one of the two")
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
    return True, "on by default on CUDA (options={'cuda_graphs': False} or least_memory turns them off)"
