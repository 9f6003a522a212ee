"""The ``options=`` dict of ``torch.compile(..., backend="poros", options=...)``, checked."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .errors import PorosConfigError
from .loss import set_chunked_loss
from .prepare import causal_lm, check_block_options, check_codegen, unwrap

DUMP_ENV = "POROS_FX_DUMP"


@dataclasses.dataclass(frozen=True)
class PorosOptions:
    block_size: int | None = None  # None: what prepare() was given
    prefetch: int | str | None = None  # None: what prepare() was given (default "auto": measured, runtime/depth.py)
    stream: bool = True  # False: base resident, nothing recomputed (the parity reference)
    dump: str | None = None  # folder for graph dumps; POROS_FX_DUMP when not given
    group_copies: bool = True  # False: one copy (and allocation) per tensor instead of one per block; for A/B runs
    codegen: str | None = None  # "inductor" | "eager": how regions run; None: what prepare() was given
    turnaround: bool = True  # a training forward's last blocks stay for the backward (False: evict and reload)
    memory_budget: int | str | None = None  # device bytes the step may use ("24GB"); None: what prepare() was given
    block_major: bool | None = None  # an accumulation step's micro-batches go through each block together
    # (runtime/accumulate.py); None: what prepare() was given (default True)
    chunked_loss: bool | None = None  # head + loss in vocabulary chunks (loss.py); None: what the model has
    # (prepare(chunked_loss=...)); the model's forward reads it, so it must be set before tracing (set_trace_options)
    offload_boundaries: bool | None = None  # saved block outputs wait in host memory (passes/offload.py);
    # None: what prepare() was given (default False)

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
        from .runtime.budget import parse_size

        parse_size(opts.memory_budget)
        for name in ("stream", "group_copies", "turnaround"):
            if not isinstance(getattr(opts, name), bool):
                raise PorosConfigError(f"{name} must be True or False, got {getattr(opts, name)!r}")
        for name in ("block_major", "chunked_loss", "offload_boundaries"):
            if getattr(opts, name) is not None and not isinstance(getattr(opts, name), bool):
                raise PorosConfigError(f"{name} must be True or False, got {getattr(opts, name)!r}")
        if opts.dump is None and os.environ.get(DUMP_ENV):
            opts = dataclasses.replace(opts, dump=os.environ[DUMP_ENV])
        return opts


def set_trace_options(model: Any, options: dict[str, Any]) -> None:
    """Apply the options the model's own forward reads while Dynamo traces it (``chunked_loss``) to the
    prepared ``model``, before it is compiled; the backend checks that they match (``@poros_fx.step``,
    ``PorosTrainer``, ``poros-fx train`` call this)."""
    if options.get("chunked_loss") is not None:
        set_chunked_loss(causal_lm(unwrap(model)), options["chunked_loss"])
