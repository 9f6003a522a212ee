"""Third-party log lines poros-fx's own work provokes, filtered at import (a ``logging.Filter``, nothing
patched).

- ``torch._dynamo.utils``: "ChromiumEventLogger: Start event not in stack, ignoring". A region is traced
  and compiled inside the compile of the step (``compiler/regions``), and Dynamo's event log, which
  tracks nested compile events per thread, loses the start of some of them (seen on CUDA: six lines in
  the first step of a 7B model). The log is torch's compile trace; the step is not affected.
"""

from __future__ import annotations

import logging

_DROPPED = {
    "torch._dynamo.utils": ("ChromiumEventLogger: Start event not in stack",),
}


class DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Add the filters (once: a logger keeps one ``DropMessages`` of ours)."""
    for name, prefixes in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(prefixes))
