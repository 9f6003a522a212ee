"""Boundary offload: the block outputs a backward reads wait in host memory (``passes/offload.py``).

``offload`` copies a saved boundary activation to the host (page-locked, on the copy stream, on CUDA)
and ``reload`` copies it back before the backward reads it; the reload's copy joins the pending copies
that ``DeviceCopies.wait`` makes the compute stream wait for.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .arena import nbytes


class BoundaryOffload:
    """The offload and reload calls of a graph whose saved block outputs wait in host memory."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)
    _pending: dict[int, Any]  # DeviceCopies' copies not yet waited for

    def offload(self, saved: torch.Tensor) -> torch.Tensor:
        """A host copy of ``saved``, a boundary activation the backward reads (``passes/offload.py``): on
        CUDA a page-locked tensor filled by the copy stream once the compute stream has made ``saved``
        (the device memory is not reused before the copy read it); on the CPU a separate tensor."""
        store = self.store
        if saved.device.type == "cuda":
            host = torch.empty_strided(saved.shape, saved.stride(), dtype=saved.dtype, pin_memory=True)
            copy_stream = store.copy_stream()
            copy_stream.wait_event(torch.cuda.current_stream(saved.device).record_event())
            with torch.cuda.stream(copy_stream):
                host.copy_(saved, non_blocking=True)
            saved.record_stream(copy_stream)
        else:
            host = saved.clone()
        store.residency.ledger.offloads += 1
        store.residency.ledger.offloaded_bytes += nbytes(saved)
        store.offloaded.append(weakref.ref(host))  # the step's host copies (tests tamper with them)
        return host

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (an ``offload``'s copy) back on ``device``; on CUDA copied on the copy stream (after the
        offload's own copy: same stream) and waited for by ``wait`` before its first reader."""
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if device.type == "cuda":
            copy_stream = self.store.copy_stream()
            copy_stream.wait_event(torch.cuda.current_stream(device).record_event())
            with torch.cuda.stream(copy_stream):
                out.copy_(host, non_blocking=True)
            self._pending[id(out)] = copy_stream.record_event()
        else:
            out.copy_(host)
        return out
