"""The host's memory as the kernel reports it: what the loader checks a base against before reading it
(``io/host_memory.py``) and what the boundary offload checks its page-locked buffer against before the
first step (``compiler/host_fit.py``)."""

from __future__ import annotations

import os


def host_ram_available() -> int | None:
    """Available host RAM in bytes: psutil when installed, else /proc/meminfo's MemAvailable, else None."""
    try:
        import psutil
    except ImportError:
        return proc_meminfo_available()
    return int(psutil.virtual_memory().available)


def proc_meminfo(key: str = "MemAvailable", path: str | os.PathLike = "/proc/meminfo") -> int | None:
    """One line of a /proc/meminfo-format file (``MemAvailable``, ``MemTotal``, ...), in bytes (None when
    absent or unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def proc_meminfo_available(path: str | os.PathLike = "/proc/meminfo") -> int | None:
    """``MemAvailable`` from a /proc/meminfo-format file, in bytes (None when absent or unreadable)."""
    return proc_meminfo("MemAvailable", path)
