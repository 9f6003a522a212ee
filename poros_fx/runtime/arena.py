"""The host arena: one exact-size host allocation that every frozen base tensor is a view of.

torch's pinned caching allocator rounds every request up to a power of two and keeps what it got, so
pinning a base tensor by tensor can cost up to ~2x its bytes (a 72B NF4 base is 36 GB: 64 GB pinned).
The arena instead allocates the base's exact size once (plus a few bytes of alignment per tensor) as
ordinary pageable memory, fills it tensor by tensor (each source tensor is freed as soon as it is
copied, and freed memory goes back to the OS every 64 MB, so host memory does not double while a
model on the host is moved in; the loader even reads tensors straight into their place) and, for a CUDA compute device,
page-locks the whole range with one ``cudaHostRegister`` at the end. Loads then copy from it
asynchronously like from any pinned tensor.

Several processes of one host (the ranks of a ``torchrun`` job) can share one arena: ``create_shared``
makes it a file in ``/dev/shm`` (``POROS_FX_SHM_DIR`` names another tmpfs), mapped ``MAP_SHARED``,
and ``attach_shared`` maps the same file in another process, read-only by convention (it never
places tensors). Each process page-locks its own mapping for its own GPU; the pages exist once.
The file is unlinked as soon as every process has mapped it (``SharedFile.unlink``), so the memory
goes back to the OS when the last process ends, however it ends. A file left behind by a process that
died between creating and unlinking it (killed, in that short window) is removed by the next
``create_shared`` in that folder: the creator holds an ``flock`` on it, which dies with the process.

The registration is undone by a finalizer that holds the arena's tensor, so the memory is always
unregistered before it can be freed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import math
import os
import secrets
import shutil
import sys
import time
import weakref

import torch

from ..errors import PorosConfigError
from ..units import GIB, gib
from .host_ram import host_ram_available

ALIGN = 512  # bytes; every tensor starts on this boundary (DMA-friendly, and a multiple of any element size)
PAGE = 4096
TRIM_EVERY = 64 * 2**20  # bytes placed between two returns of freed source memory to the OS
SHM_DIR_ENV = "POROS_FX_SHM_DIR"  # where shared arenas live (default /dev/shm)
SHM_PREFIX = "poros-fx-arena-"  # every shared arena file's name starts so (stale-file cleanup matches it)
STALE_AFTER_S = 60.0  # an unlocked arena file older than this has lost its creator


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """``capacity`` bytes of host memory handed out as tensors by ``place``; ``pin`` page-locks it.

    ``buffer``: the memory to use (a uint8 tensor of ``capacity`` bytes, e.g. a shared mapping from
    ``create_shared`` / ``attach_shared``); ``None`` allocates private memory. ``shared``: the file
    behind a shared buffer. An arena that is not ``writable`` (another process fills it) hands out
    views of what is there (``view``) and refuses ``place`` / ``reserve``.
    """

    def __init__(self, capacity: int, buffer: torch.Tensor | None = None, *,
                 shared: "SharedFile | None" = None, writable: bool = True) -> None:
        self.capacity = capacity
        self.used = 0 if writable else capacity
        if buffer is None:
            buffer = page_aligned(capacity)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != capacity:
            raise AssertionError(f"arena buffer must be {capacity} uint8 bytes, got {buffer.dtype} "
                                 f"{tuple(buffer.shape)}")
        self.buffer = buffer
        self.shared = shared
        self.writable = writable
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        self._since_trim = 0

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` already lives in the arena (the loader fills it before ``prepare`` runs)."""
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def offset(self, t: torch.Tensor) -> int:
        """Byte offset of ``t``'s first element in the arena (``t`` must live here)."""
        if not self.holds(t):
            raise AssertionError("tensor does not live in this host arena")
        return t.data_ptr() - self.buffer.data_ptr()

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The contiguous tensor of ``shape`` and ``dtype`` at byte ``offset`` of the arena (what another
        process placed there)."""
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % ALIGN or offset + size > self.capacity:
            raise AssertionError(f"no tensor of {size} bytes can start at byte {offset} of a {self.capacity}-byte "
                                 "arena (the ranks built different models?)")
        return self.buffer[offset:offset + size].view(dtype).view(shape)

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
        if not self.writable:
            raise AssertionError("this host arena was attached from another process, which fills it; nothing can "
                                 "be placed in it here")
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
        """Page-lock the arena for asynchronous host-to-device copies (CUDA only). A shared arena is
        page-locked by every process for its own device; the pages are the same."""
        if self.pinned or self.used == 0:
            return
        release_freed_host_memory()
        self._finalizer = page_lock(self, self.buffer, "the host store")
        self.pinned = True

    def unpin(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.pinned = False

    @property
    def pinned_bytes(self) -> int:
        return self.capacity if self.pinned else 0


class PageLockedBuffer:
    """``nbytes`` of host memory page-locked by one ``cudaHostRegister`` of exactly that size (torch's pinned
    caching allocator would round a request up to a power of two: 40 GiB to 64), ``tensor`` (uint8). The
    registration is undone when this object goes: whoever drops it first makes sure no copy still runs
    from or into it."""

    def __init__(self, nbytes: int, what: str) -> None:
        self.tensor = page_aligned(nbytes)
        self._finalizer = page_lock(self, self.tensor, what)


def page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised host memory starting on a page boundary (pages are touched only when
    written, or when page-locked)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start:start + nbytes]


def page_lock(owner: object, buffer: torch.Tensor, what: str) -> weakref.finalize:
    """Page-lock ``buffer`` (``cudaHostRegister``) until ``owner`` goes (the returned finalizer unregisters it
    earlier when called); a failure raises ``PorosConfigError`` naming ``what`` and the host's memory."""
    from torch.cuda import _pin_memory_utils

    ptr, size = buffer.data_ptr(), buffer.numel()
    try:
        _pin_memory_utils.pin_memory(ptr, size)
    except RuntimeError as e:
        available = host_ram_available()
        raise PorosConfigError(
            f"could not page-lock {gib(size)} of host memory for {what} ({e}); the host has "
            f"{gib(available) if available is not None else 'an unknown amount'} available. Free host memory, "
            "use a host with more, or make the step hold less there (a shorter sequence or batch when it is "
            "the boundary offload, NF4 when it is the host store)") from e
    return weakref.finalize(owner, _unpin, buffer, ptr)


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


# -- shared arenas (one host copy for several processes) ---------------------------------------------

@dataclasses.dataclass(eq=False)
class SharedFile:
    """The ``/dev/shm`` file behind a shared arena. The creator holds ``lock_fd`` (an ``flock``) until it
    unlinks the file, which marks the file live for ``remove_stale``."""

    path: str
    creator: bool
    lock_fd: int | None = None

    def unlink(self) -> None:
        """Remove the file's name (every process that mapped it keeps its mapping); idempotent."""
        if self.creator:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    @property
    def linked(self) -> bool:
        return os.path.exists(self.path)


def shm_dir() -> str:
    """Where shared arenas are made: ``$POROS_FX_SHM_DIR``, else ``/dev/shm``."""
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


def shm_free_bytes(directory: str | None = None) -> int | None:
    """Free bytes of the shared-memory folder (``None`` when it does not exist)."""
    try:
        return shutil.disk_usage(directory or shm_dir()).free
    except OSError:
        return None


def _no_room(directory: str, capacity: int, free: int) -> PorosConfigError:
    return PorosConfigError(
        f"the shared host store needs {gib(capacity)} in {directory}, which has {gib(free)} free: the ranks of a "
        f"host keep one copy of the frozen base there. Make room: in Docker, start the container with "
        f"--shm-size={max(1, math.ceil(capacity * 1.05 / GIB))}g (or --ipc=host); elsewhere remount the tmpfs "
        f"larger (mount -o remount,size=... {directory}), or set {SHM_DIR_ENV} to a tmpfs folder with room.")


def create_shared(capacity: int, directory: str | None = None) -> HostArena:
    """A new shared arena of ``capacity`` bytes: a file in ``directory`` (``shm_dir()``), its space
    reserved up front (``posix_fallocate``: a tmpfs that runs out later would kill the process with
    SIGBUS), mapped shared. Stale files of dead creators in ``directory`` are removed first."""
    directory = directory or shm_dir()
    if not os.path.isdir(directory):
        raise PorosConfigError(f"{directory} does not exist: the shared host store needs a tmpfs folder (Linux "
                               f"/dev/shm); set {SHM_DIR_ENV} to one")
    remove_stale(directory)
    free = shm_free_bytes(directory)
    if free is not None and free < capacity:
        raise _no_room(directory, capacity, free)
    path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    shared = SharedFile(path=path, creator=True, lock_fd=fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # live while this process holds it (remove_stale takes LOCK_EX)
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _no_room(directory, capacity, shm_free_bytes(directory) or 0) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, capacity)  # a file system without fallocate: sized, not reserved
        arena = HostArena(capacity, _map(path, capacity), shared=shared, writable=True)
    except BaseException:
        shared.unlink()
        raise
    weakref.finalize(arena, shared.unlink)  # also at interpreter exit; a no-op once unlinked
    return arena


def attach_shared(path: str, capacity: int) -> HostArena:
    """Map the shared arena another process of this host made with ``create_shared``."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise PorosConfigError(f"the shared host store {path} is not there: this process does not see the "
                               f"{os.path.dirname(path)} of the process that made it (another container or IPC "
                               f"namespace?); give the ranks of one host one {os.path.dirname(path)} (Docker: "
                               f"--ipc=host or one container per host)") from None
    if size != capacity:
        raise PorosConfigError(f"the shared host store {path} holds {size} bytes, this process expects {capacity}: "
                               "the ranks were given different models or poros-fx versions")
    return HostArena(capacity, _map(path, capacity), shared=SharedFile(path=path, creator=False), writable=False)


def _map(path: str, capacity: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=capacity)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def remove_stale(directory: str | None = None, *, older_than: float = STALE_AFTER_S) -> list[str]:
    """Delete shared arena files in ``directory`` that no live process holds (their creator died before
    unlinking them) and that are older than ``older_than`` seconds; returns their paths."""
    directory = directory or shm_dir()
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SHM_PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if now - os.fstat(fd).st_mtime < older_than:
                continue  # its creator may be between creating and locking it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live creator holds it
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
