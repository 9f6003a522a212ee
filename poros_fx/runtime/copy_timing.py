"""Timing a graph's first streamed run: when each prefetch group's copy ran on the copy stream, and how
long the compute stream waited for it, measured with CUDA events; ``depth.summarize_timing`` turns them
into the store's ``timing``, from which prefetch "auto" chooses its depth (``depth.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .depth import summarize_timing


class CopyTiming:
    """The timing events of a graph's measured run: (start, done) of each group's copy on the copy stream,
    (before, after) of each group's wait on the compute stream, and whether the next run measures."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)

    def _init_timing(self, measure: bool) -> None:
        # time the first run's copies and blocks with CUDA events (prefetch "auto", runtime/depth.py)
        self.measure = measure
        self._copy_times: list[tuple[Any, Any]] = []  # (start, done) on the copy stream, per group
        self._wait_times: list[tuple[Any, Any]] = []  # (before, after) each group's wait, compute stream

    def _timing_event(self, stream: Any) -> Any:
        """A timing event recorded on ``stream`` while measuring, else ``None``."""
        if not self.measure:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _finish_measuring(self) -> None:
        """After the first measured run: block copy and compute times into ``store.timing``."""
        torch.cuda.synchronize(self.store.device)
        copy_ms = [a.elapsed_time(b) for a, b in self._copy_times]
        # a block computes from the end of its group's wait to the start of the next group's wait
        compute_ms = [after.elapsed_time(nxt) for (_, after), (nxt, _) in zip(self._wait_times, self._wait_times[1:])]
        stall_ms = [a.elapsed_time(b) for a, b in self._wait_times]
        self.store.timing = summarize_timing(copy_ms, compute_ms, stall_ms)
        self.measure = False
        self._copy_times, self._wait_times = [], []
