"""Third-party log lines that say nothing to a poros-fx user, filtered where they are logged.

- bitsandbytes logs a warning on every import on a CPU with AVX512-BF16 when the optional ``kernels``
  package is missing ("Failed to load CPU gemm_4bit_forward from kernels-community ..."): its fallback
  kernel is used, which is what poros-fx runs on the CPU anyway.
- Dynamo's compile-event log says "ChromiumEventLogger: Start event not in stack, ignoring" when a
  region is traced and compiled inside the compile of the step (``compiler/regions``): the log tracks
  nested compile events and loses the start of some of them (seen on CUDA: six lines in the first step
  of a 7B model). It is torch's compile trace; the step is not affected.

A ``logging.Filter`` on each logger drops exactly that line (nothing is patched; other messages pass).
"""

from __future__ import annotations

import logging

# (logger, the start of the message dropped)
DROPPED = (("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
           ("torch._dynamo.utils", "ChromiumEventLogger: Start event not in stack"))


class DropMessages(logging.Filter):
    """Drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def filter_third_party_noise() -> None:
    """Install the filters (idempotent); called when ``poros_fx`` is imported, before bitsandbytes is."""
    for name, prefix in DROPPED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(DropMessages(prefix))
