"""The residency ledger: what of the frozen base is on the compute device, measured as it happens.

Every runtime load adds the bytes of the tensor it handed out, every evict removes them; the peak is
taken after each load. Nothing here is derived from a formula: if a schedule keeps two blocks
resident, the ledger sees two blocks. Loads made outside the poros graphs (``poros::load``'s own
implementation: a prepared model called without ``torch.compile``, or code Dynamo ran eagerly) are
booked too, also under ``eager_loads``, and evicted when autograd and the caller let go of the tensor. (A streamed group's tensors share one device buffer, freed with
the last of them, so the device may hold up to one group's bytes more than the ledger says while a
block's last tensors are still in use.)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ResidencyLedger:
    resident_bytes: int = 0
    peak_resident_base_bytes: int = 0
    bytes_loaded: int = 0
    loads: int = 0
    copies: int = 0  # host-to-device copy calls (a group's tensors share one per contiguous host range)
    bytes_copied: int = 0  # what those calls moved (a range may span a few bytes no load reads)
    evictions: int = 0
    eager_loads: int = 0  # of ``loads``: made outside the poros graphs (neither streamed nor recomputed)
    recomputed_blocks: int = 0
    forward_runs: int = 0
    backward_runs: int = 0
    block_major_steps: int = 0  # accumulation steps whose micro-batches ran block-major (runtime/accumulate.py)
    block_major_micro_batches: int = 0  # the micro-batches of those steps
    offloads: int = 0  # boundary activations copied to host memory for the backward (passes/offload.py)
    offloaded_bytes: int = 0  # their bytes (each is copied back once, in the backward)
    step_peak: int = 0  # the peak since ``start_step`` (a memory budget's measurement window, runtime/budget.py)

    def on_load(self, nbytes: int) -> None:
        self.loads += 1
        self.bytes_loaded += nbytes
        self.resident_bytes += nbytes
        self.peak_resident_base_bytes = max(self.peak_resident_base_bytes, self.resident_bytes)
        self.step_peak = max(self.step_peak, self.resident_bytes)

    def on_eager_load(self, nbytes: int) -> None:
        """A base tensor copied to the device by ``poros::load`` run eagerly (one copy of its own)."""
        self.eager_loads += 1
        self.on_load(nbytes)
        self.on_copy(1, nbytes)

    def on_copy(self, calls: int, nbytes: int) -> None:
        self.copies += calls
        self.bytes_copied += nbytes

    def on_evict(self, nbytes: int) -> None:
        self.evictions += 1
        self.resident_bytes -= nbytes
        if self.resident_bytes < 0:
            raise AssertionError("residency ledger went negative: an evict without its load")

    def start_step(self) -> None:
        """Start a new ``step_peak`` window at what is resident now."""
        self.step_peak = self.resident_bytes

    def reset(self) -> None:
        """Zero the counters (the resident set itself is what it is)."""
        resident = self.resident_bytes
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        self.resident_bytes = resident
        self.peak_resident_base_bytes = self.step_peak = resident
