"""The host arena: one exact-size host allocation that every frozen base tensor is a view of.

torch's pinned caching allocator rounds every request up to a power of two and keeps what it got, so
pinning a base tensor by tensor can cost up to ~2x its bytes (a 72B NF4 base is 36 GB: 64 GB pinned).
The arena instead allocates the base's exact size once (plus a few bytes of alignment per tensor) as
ordinary pageable memory, fills it tensor by tensor (each source tensor is freed as soon as it is
copied, and freed memory goes back to the OS every 64 MB, so host memory does not double while a
model on the host is moved in; the loader even reads tensors straight into their place) and, for a CUDA compute device,
page-locks the whole range with one ``cudaHostRegister`` at the end. Loads then copy from it
asynchronously like from any pinned tensor.

The registration is undone by a finalizer that holds the arena's tensor, so the memory is always
unregistered before it can be freed.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref

import torch

ALIGN = 512  # bytes; every tensor starts on this boundary (DMA-friendly, and a multiple of any element size)
PAGE = 4096
TRIM_EVERY = 64 * 2**20  # bytes placed between two returns of freed source memory to the OS


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """``capacity`` bytes of host memory handed out as tensors by ``place``; ``pin`` page-locks it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        # pages are touched only when written; the usable range starts on a page boundary
        raw = torch.empty(capacity + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        self.buffer = raw[start:start + capacity]
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        self._since_trim = 0

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` already lives in the arena (the loader fills it before ``prepare`` runs)."""
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the arena, for a producer to write into (a file read, a generator)."""
        return self._take(math.prod(shape) * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor in the arena with ``t``'s values (its own storage is not kept);
        ``t`` itself when it already lives here."""
        if self.holds(t):
            return t
        view = self._take(nbytes(t)).view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        return view

    def _take(self, nbytes: int) -> torch.Tensor:
        if self.used + nbytes > self.capacity:
            raise AssertionError(f"host arena full: {self.used} + {nbytes} > {self.capacity} bytes "
                                 "(the sizes counted before the move do not match the tensors moved)")
        if self.pinned:
            raise AssertionError("host arena is already pinned; nothing can be placed after pin()")
        view = self.buffer[self.used:self.used + nbytes]
        self.used += aligned(nbytes)
        self._since_trim += nbytes
        if self._since_trim >= TRIM_EVERY:
            # the sources placed so far are freed by now; glibc keeps freed heap pages (tensors under its
            # 32 MB mmap threshold) in the process unless asked, and host RSS would reach twice the base
            release_freed_host_memory()
            self._since_trim = 0
        return view

    def pin(self) -> None:
        """Page-lock the arena for asynchronous host-to-device copies (CUDA only)."""
        if self.pinned or self.used == 0:
            return
        release_freed_host_memory()
        from torch.cuda import _pin_memory_utils

        ptr = self.buffer.data_ptr()
        _pin_memory_utils.pin_memory(ptr, self.capacity)
        self.pinned = True
        self._finalizer = weakref.finalize(self, _unpin, self.buffer, ptr)

    def unpin(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.pinned = False

    @property
    def pinned_bytes(self) -> int:
        return self.capacity if self.pinned else 0


def release_freed_host_memory() -> None:
    """Hand memory that malloc holds but nothing uses back to the OS (glibc's ``malloc_trim``)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def _unpin(buffer: torch.Tensor, ptr: int) -> None:
    # ``buffer`` is an argument only so that the memory outlives its registration
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(ptr)
