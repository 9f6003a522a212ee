"""The command-line options several ``poros-fx`` commands share, with their checks: a bad value is a usage
error naming the flag, before anything loads."""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import PorosConfigError
from ..options import check_budget_option, device_problem, parse_prefetch
from ..units import parse_size


def prefetch_value(value: str) -> int | str:
    try:
        return parse_prefetch(value)
    except PorosConfigError as e:
        raise typer.BadParameter(str(e))


def memory_budget_value(value: Optional[str]) -> Optional[str]:
    try:
        check_budget_option(value)
    except PorosConfigError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def codegen_value(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in ("inductor", "eager"):
        raise typer.BadParameter(f"--codegen must be inductor or eager, got {value!r}")
    return value


CODEGEN_OPTION = typer.Option(None, callback=codegen_value, help="how decoder-layer regions run: inductor (fused kernels) "
                              "or eager (aten calls, equal to the eager loop); default: the device's (see "
                              "docs/exactness.md)")


PREFETCH_OPTION = typer.Option("auto", callback=prefetch_value, help="blocks loaded ahead of the one computing: an "
                               "integer >= 0, or auto (one in the forward; the backward's depth measured in the "
                               "first forward)")


def device_value(value: Optional[str]) -> Optional[str]:
    """``--device``: cpu or cuda[:N], and cuda only where torch sees one (refused here, not as a traceback)."""
    if value is None:
        return None

    problem = device_problem(value)
    if problem is not None:
        raise typer.BadParameter(problem)
    return value


DEVICE_OPTION = typer.Option(None, callback=device_value, help="cpu or cuda (default: cuda when present)")


def size_value(text: str, flag: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes, as for --memory-budget."""
    try:
        return parse_size(text, flag)
    except PorosConfigError as e:
        raise typer.BadParameter(str(e)) from None


def device_memory_value(value: Optional[str]) -> Optional[int]:
    """``check --device-memory``: a size, in bytes."""
    return None if value is None else size_value(value, "--device-memory")


def positive_epochs(value: Optional[float]) -> Optional[float]:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"--epochs must be above 0, got {value}")
    return value
