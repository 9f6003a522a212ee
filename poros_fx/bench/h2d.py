"""Host-to-device bandwidth per GPU from the memory poros-fx streams from, each GPU alone and all at once.

The source is what the runtime copies from: a host arena page-locked with one ``cudaHostRegister``,
in shared memory (``/dev/shm``) where there is room, as the ranks of a multi-GPU job map it (else a
private arena, and the report says so). With several GPUs on one host their copies share the CPU's
memory and PCIe/NVLink-C2C links, so the bandwidth each one gets while all copy together is the
number that bounds a multi-GPU streamed step; ``poros-fx doctor`` and the multi-GPU benchmark show
both. Under ``torchrun`` each rank measures its own GPU from its own mapping of one shared arena
(``measure_ranks``).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any

import torch

from ..distributed import HostShare, rank_device
from ..runtime.arena import HostArena, create_shared, shm_free_bytes


@dataclasses.dataclass(frozen=True)
class H2D:
    """Measured pinned host-to-device bandwidth of one GPU, in GB/s (1e9 bytes per second)."""

    device: str
    alone: float  # this GPU copying, the others idle
    together: float | None  # while every GPU measured copies at the same time (None: one GPU)
    source: str  # "shared" (a /dev/shm arena) or "private"


def source_arena(nbytes: int) -> tuple[HostArena, str]:
    """``nbytes`` of host arena to copy from: shared memory when it has room (its name unlinked at once,
    as a job's shared store is), else private memory."""
    free = shm_free_bytes()
    if free is not None and free >= 2 * nbytes:
        arena = create_shared(nbytes)
        arena.shared.unlink()
        kind = "shared"
    else:
        arena, kind = HostArena(nbytes), "private"
    arena.place(torch.zeros(nbytes, dtype=torch.uint8))
    return arena, kind


def copy_seconds(host: torch.Tensor, device: torch.device, reps: int,
                 barrier: threading.Barrier | None = None) -> list[float]:
    """Wall seconds of ``reps`` asynchronous copies of ``host`` to ``device`` (one warm-up first);
    ``barrier``: wait for the other measuring threads before each copy."""
    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def copy_back_seconds(host: torch.Tensor, device: torch.device, reps: int) -> list[float]:
    """Wall seconds of ``reps`` asynchronous device-to-host copies into ``host`` (page-locked; one warm-up
    first): the direction offloaded boundaries take."""
    dev = torch.zeros(host.shape, dtype=host.dtype, device=device)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def measure_gpus(mib: int = 256, reps: int = 5) -> list[H2D]:
    """Every visible GPU of this process: alone (one after the other), then all at once (one thread
    each, a barrier before every copy). Needs CUDA."""
    nbytes = mib * 2**20
    count = torch.cuda.device_count()
    arena, kind = source_arena(nbytes * count)
    arena.pin()
    try:
        hosts = [arena.buffer[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        devices = [torch.device("cuda", i) for i in range(count)]
        alone = [_gbps(nbytes, copy_seconds(h, d, reps)) for h, d in zip(hosts, devices)]
        together: list[float | None] = [None] * count
        if count > 1:
            barrier = threading.Barrier(count)
            results: dict[int, list[float]] = {}

            def run(i: int) -> None:
                results[i] = copy_seconds(hosts[i], devices[i], reps, barrier)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            together = [_gbps(nbytes, results[i]) for i in range(count)]
        return [H2D(str(d), a, t, kind) for d, a, t in zip(devices, alone, together)]
    finally:
        arena.unpin()


def measure_ranks(mib: int = 256, reps: int = 5) -> list[dict[str, Any]]:
    """Under torch.distributed (collective: every rank calls it): each rank's own GPU, from its own
    mapping of one shared arena per host (``HostShare``), alone (rank by rank) and with every rank
    copying at once. Returns every rank's ``H2D`` as a dict, by rank."""
    import torch.distributed as dist

    nbytes = mib * 2**20
    device = rank_device()
    share = HostShare.open(nbytes)
    try:
        if share is None:
            arena, kind = HostArena(nbytes), "private"
        else:
            arena, kind = share.arena, "shared"
            share.from_leader(lambda: arena.place(torch.zeros(nbytes, dtype=torch.uint8)) is not None,
                              "filling the bandwidth test buffer")
        if kind == "private":
            arena.place(torch.zeros(nbytes, dtype=torch.uint8))
        arena.pin()
        alone = 0.0
        for r in range(dist.get_world_size()):
            dist.barrier()
            if r == dist.get_rank():
                alone = _gbps(nbytes, copy_seconds(arena.buffer, device, reps))
        dist.barrier()
        together = _gbps(nbytes, copy_seconds(arena.buffer, device, reps))
        out: list[Any] = [None] * dist.get_world_size()
        own = H2D(f"rank {dist.get_rank()} ({device})", alone, together, kind)
        dist.all_gather_object(out, dataclasses.asdict(own))
        arena.unpin()
        return out
    finally:
        if share is not None:
            share.close()
