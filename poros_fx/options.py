"""The ``options=`` dict of ``torch.compile(..., backend="poros", options=...)``, checked."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .errors import PorosConfigError
from .prepare import check_block_options, check_codegen

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
        if opts.block_major is not None and not isinstance(opts.block_major, bool):
            raise PorosConfigError(f"block_major must be True or False, got {opts.block_major!r}")
        if opts.dump is None and os.environ.get(DUMP_ENV):
            opts = dataclasses.replace(opts, dump=os.environ[DUMP_ENV])
        return opts
