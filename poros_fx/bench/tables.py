"""What every benchmark report holds: the environment it ran in, its cells, its markdown tables, and the
JSON + markdown pair it writes (``benchmarks/scripts/load_memory.py`` and the other benchmark scripts)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..runtime.host_ram import proc_meminfo

PACKAGES = ("transformers", "peft", "bitsandbytes", "safetensors")


def environment(device: str, root: Path | None = None) -> dict[str, Any]:
    """Versions (python, torch, CUDA and ``PACKAGES``), host RAM and CPUs, the GPU when ``device`` is
    ``"cuda"``, and ``git describe`` of ``root`` (the checkout that ran)."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpu_count": os.cpu_count(),
                           "host_ram_bytes": proc_meminfo("MemTotal"),
                           "host_ram_available_bytes": proc_meminfo("MemAvailable"),
                           "kernel": platform.release(), "device": device}
    for name in PACKAGES:
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - an absent package is reported
            env[name] = f"unavailable ({type(e).__name__})"
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
    else:
        env["gpu_name"] = None
    env["git"] = git_describe(root)
    return env


def git_describe(root: Path | None) -> str | None:
    """``git describe --always --dirty`` of ``root`` (``None`` outside a checkout)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], check=False, cwd=root,
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cell(x: Any) -> str:
    """A table cell: ``-`` for nothing, ``yes``/``NO``, a float to three decimals, anything else as text."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a markdown table (cells already formatted; a ``|`` inside one is replaced)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def write_report(out: Path | None, stem: str, doc: dict[str, Any], markdown: str) -> None:
    """``out/<stem>.json`` (the whole ``doc``) and ``out/<stem>.md``; nothing when ``out`` is ``None``."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
