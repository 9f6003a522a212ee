"""What holds the device memory at a step's peak: one step under the CUDA caching allocator's history,
reduced to the allocations alive at the moment the step's allocated bytes peaked, grouped by the
Python line that made them.

``memory_step(step, path)`` runs ``step()`` once while the allocator records every allocation and
free with its Python stack, writes the snapshot (``path``, a pickle that PyTorch's memory viewer
opens: https://pytorch.org/memory_viz) and returns ``summarize_memory`` of it::

    {"peak_gb": 5.01,                   # allocated bytes at the step's peak (the history's own count)
     "before_step_gb": 1.37,            # allocated when the step began (the model's resident tensors, ...)
     "from_before_at_peak_gb": 1.37,    # of those, still alive at the peak
     "at_peak": [                       # the allocations of the step alive at the peak, largest first
        {"gb": 0.805, "count": 1, "where": "cq3x.py:412 call: buf7 = torch.ops.bitsandbytes.dequantize_4bit..."},
        ...]}

``where`` is the innermost frame outside PyTorch's own Python (Inductor's generated code is kept: its
line names the kernel or op), with that line's source where it can be read.
"""

from __future__ import annotations

import linecache
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

_TORCH_DIR = str(Path(torch.__file__).parent)


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame not in PyTorch's own files, as ``file:line function: source``."""
    chosen = next((f for f in frames if not f.get("filename", "").startswith(_TORCH_DIR)
                   and not f.get("filename", "").startswith("<")), frames[0] if frames else None)
    if chosen is None:
        return "(no Python frame)"
    filename, line = chosen.get("filename", "?"), chosen.get("line", 0)
    source = linecache.getline(filename, line).strip()
    label = f"{Path(filename).name}:{line} {chosen.get('name', '?')}"
    return f"{label}: {source[:160]}" if source else label


def summarize_memory(trace: list[dict[str, Any]], before: int, top: int = 15) -> dict[str, Any]:
    """The module docstring's numbers from one device's allocator trace (``device_traces[i]`` of a
    snapshot) that began with ``before`` bytes allocated. An allocation counts until its
    ``free_completed`` (a block freed on one stream and used on another is reused only then)."""
    total = peak = before
    peak_index = -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif event["action"] == "free_completed":
            total -= event["size"]
    live: dict[int, dict[str, Any]] = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[_where(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {"peak_gb": round(peak / 1e9, 3), "before_step_gb": round(before / 1e9, 3),
            "from_before_at_peak_gb": round((peak - sum(e["size"] for e in live.values())) / 1e9, 3),
            "at_peak": [{"gb": round(size / 1e9, 3), "count": count, "where": where}
                        for where, (size, count) in ranked[:top]]}


def memory_step(step: Callable[[], Any], path: str | Path | None, device: torch.device, top: int = 15) -> dict[str, Any]:
    """Run ``step()`` once under the allocator's history on ``device`` (CUDA); the snapshot goes to
    ``path`` (unless ``None``), its summary is returned."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", device=device)
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
    traces = snapshot.get("device_traces", [])
    return summarize_memory(traces[index] if index < len(traces) else [], before, top)
