"""Where a step's time goes: one step under ``torch.profiler``, reduced to a few numbers.

``profile_step(step, path)`` runs ``step()`` once under the profiler (CPU and, on CUDA, GPU activity),
writes the Chrome trace (``.json.gz``, open it in Perfetto) and returns ``summarize`` of it:

    {"wall_ms": 676.0,                       # first to last event of the step
     "compute_stream": 7, "copy_streams": [21],
     "streams": {"7": {"busy_ms": 402.1, "kernels": 10413}, "21": {"busy_ms": 121.8, "copies": 2240}},
     "compute_idle_ms": 260.3,               # the compute stream did nothing
     "idle": {"cpu_ms": 180.2,               # ... because the CPU had not launched the next kernel yet
              "waiting_ms": 70.5,            # ... with the next kernel launched: it waited (an event, a copy)
              "waiting_on_copy_ms": 61.0},   # ... the part of "waiting" a host-to-device copy was running
     "h2d": {"bytes": 6.7e9, "ms": 121.8, "gbps": 55.0},
     "categories_ms": {"gemm": .., "dequantize": .., "attention": .., "other": ..},
     "top_kernels": [{"name": .., "ms": .., "count": ..}, ...],
     "cpu_sync_ms": 3.1,                     # CPU time blocked in synchronizing CUDA calls
     "cuda_malloc": {"calls": 0, "ms": 0.0}} # cudaMalloc/cudaFree in the step (0 once the allocator is warm)

The compute stream is the one with the most kernel time; copy streams are the others that run
host-to-device copies. A compute-stream gap counts as ``cpu`` when the next kernel's launch call
ended after the gap began (the GPU ran dry: the step is launch-bound there), else as ``waiting``.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

_MALLOC_CALLS = ("cudaMalloc", "cudaFree")  # the caching allocator growing or flushing: slow, and cudaFree syncs
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_CATEGORIES = (  # first match wins; lower-cased kernel names
    ("dequantize", re.compile(r"dequant|kdequantize")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa")),
    ("gemm", re.compile(r"gemm|cutlass|xmma|sm90_|cublas|nvjet")),
)


def _category(name: str) -> str:
    low = name.lower()
    for label, pattern in _CATEGORIES:
        if pattern.search(low):
            return label
    return "other"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000.0


def _overlap_us(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def summarize(trace: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """The numbers of the module docstring from a Chrome trace (``torch.profiler`` export)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"wall_ms": 0.0, "note": "empty trace"}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    out: dict[str, Any] = {"wall_ms": round((end - start) / 1000.0, 3)}
    out["cpu_sync_ms"] = round(sum(e["dur"] for e in events if e.get("cat") == "cuda_runtime"
                                   and e.get("name", "").startswith(_SYNC_CALLS)
                                   and not e["name"].startswith("cudaMemcpyAsync")) / 1000.0, 3)
    mallocs = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith(_MALLOC_CALLS)]
    out["cuda_malloc"] = {"calls": len(mallocs), "ms": round(sum(e["dur"] for e in mallocs) / 1000.0, 3)}
    if not kernels:
        out["note"] = "no GPU activity in the trace (a CPU run)"
        return out
    per_stream: dict[int, list[dict]] = defaultdict(list)
    for e in kernels + copies:
        per_stream[e["args"].get("stream", -1)].append(e)
    kernel_ms = defaultdict(float)
    for e in kernels:
        kernel_ms[e["args"].get("stream", -1)] += e["dur"] / 1000.0
    compute = max(kernel_ms, key=kernel_ms.get)
    h2d = [e for e in copies if "HtoD" in e.get("name", "") or e["args"].get("kind", "").startswith("HtoD")]
    copy_streams = sorted({e["args"].get("stream", -1) for e in h2d} - {compute})
    out["compute_stream"] = compute
    out["copy_streams"] = copy_streams
    out["streams"] = {str(s): {"busy_ms": round(_union_ms([(e["ts"], e["ts"] + e["dur"]) for e in evs]), 3),
                               "kernels": sum(e.get("cat") == "kernel" for e in evs),
                               "copies": sum(e.get("cat") == "gpu_memcpy" for e in evs)}
                      for s, evs in sorted(per_stream.items())}
    # compute-stream gaps, from its first to its last event
    on_compute = sorted(per_stream[compute], key=lambda e: e["ts"])
    copy_intervals = [(e["ts"], e["ts"] + e["dur"]) for e in h2d if e["args"].get("stream", -1) != compute]
    cpu_us = waiting_us = on_copy_us = 0.0
    busy_until = on_compute[0]["ts"] + on_compute[0]["dur"]
    for e in on_compute[1:]:
        gap = e["ts"] - busy_until
        if gap > 0:
            launch = launches.get(e["args"].get("correlation"))
            if launch is not None and launch["ts"] + launch["dur"] > busy_until:
                cpu_us += gap
            else:
                waiting_us += gap
                on_copy_us += _overlap_us(busy_until, e["ts"], copy_intervals)
        busy_until = max(busy_until, e["ts"] + e["dur"])
    idle_before = on_compute[0]["ts"] - start
    idle_after = end - busy_until
    out["compute_idle_ms"] = round((cpu_us + waiting_us + idle_before + idle_after) / 1000.0, 3)
    out["idle"] = {"cpu_ms": round(cpu_us / 1000.0, 3), "waiting_ms": round(waiting_us / 1000.0, 3),
                   "waiting_on_copy_ms": round(on_copy_us / 1000.0, 3),
                   "before_first_kernel_ms": round(idle_before / 1000.0, 3),
                   "after_last_kernel_ms": round(idle_after / 1000.0, 3)}
    h2d_bytes = sum(e["args"].get("bytes", 0) for e in h2d)
    h2d_ms = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
    out["h2d"] = {"bytes": h2d_bytes, "ms": round(h2d_ms, 3), "count": len(h2d),
                  "gbps": round(h2d_bytes / (h2d_ms * 1e6), 2) if h2d_ms else None}
    categories = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        categories[_category(e["name"])] += e["dur"] / 1000.0
        slot = by_name[e["name"][:120]]
        slot[0] += e["dur"] / 1000.0
        slot[1] += 1
    out["categories_ms"] = {k: round(v, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])}
    out["top_kernels"] = [{"name": n, "ms": round(ms, 3), "count": c}
                          for n, (ms, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    leads = sorted(e["ts"] - launches[e["args"]["correlation"]]["ts"] for e in kernels
                   if e["args"].get("correlation") in launches)
    if leads:  # how far ahead of the GPU the CPU ran: near zero means launch-bound
        out["launch_lead_ms"] = {"p10": round(leads[len(leads) // 10] / 1000.0, 3),
                                 "p50": round(leads[len(leads) // 2] / 1000.0, 3),
                                 "p90": round(leads[len(leads) * 9 // 10] / 1000.0, 3)}
    return out


def profile_step(step: Callable[[], Any], path: str | Path) -> dict[str, Any]:
    """Run ``step()`` once under ``torch.profiler``; write its Chrome trace to ``path`` (gzipped when
    the name ends in ``.gz``) and return ``summarize`` of it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_name(path.name.removesuffix(".gz"))
    with profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text(encoding="utf-8"))
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(trace, f)
        raw.unlink()
    return summarize(trace)
