"""Errors poros-fx raises. Each says what went wrong and what to do about it."""

from __future__ import annotations

import torch


class PorosError(RuntimeError):
    """Base class of every error poros-fx raises on purpose."""


class PorosConfigError(PorosError, ValueError):
    """An option or a model setup that poros-fx cannot run (bad block size, no adapter, ...)."""


class UnsupportedArchitectureError(PorosError):
    """The model's family is neither validated nor registered by the user as ``user_asserted``."""


class NoBlocksError(PorosError):
    """The model has no decoder-layer list poros-fx can stream block by block."""


class PorosExactnessError(PorosError):
    """A schedule that would not reproduce the resident run bit for bit; raised instead of running."""


class PorosOOMError(PorosError, torch.OutOfMemoryError):
    """A block plus its prefetch did not fit the free device memory; says which block size / prefetch
    would, from the free memory measured when it happened."""
