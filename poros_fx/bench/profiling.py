"""Where a step's time and a process's memory go: one step under ``torch.profiler`` reduced to a few
numbers, a sampler of this process's host memory, and a measurement run in a fresh process.

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

Host memory (``Sampler``): a thread reads ``/proc/self/status`` (VmRSS, RssAnon, RssFile) and
``/proc/meminfo`` (MemAvailable) every few ms and keeps the peaks and named marks; ``reset_peak_rss``
resets VmHWM. ``run_child`` runs a measurement in a fresh process (no peak of one case leaks into the
next) and reads its one JSON result line (``result_stream`` in the child keeps stdout for it).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import torch

from ..runtime.host_ram import proc_meminfo
from ..units import table_gb, table_gib

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


# -- host memory of this process (/proc, no psutil) --------------------------------------------------

def proc_status(path: str = "/proc/self/status") -> dict[str, int]:
    """The memory lines of /proc/self/status in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem, VmLck, VmPin)."""
    out = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key.startswith(("Vm", "Rss")):
                    parts = rest.split()
                    if len(parts) == 2 and parts[1] == "kB":
                        out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (write "5" to /proc/self/clear_refs, Linux >= 4.0); True if it took."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    now = proc_status()
    return "VmHWM" in now and now["VmHWM"] <= now.get("VmRSS", 0) + (1 << 20)


class Sampler:
    """A thread reading /proc/self/status and /proc/meminfo every ``interval`` s; keeps the peaks.

    ``extra()`` adds readings to each named mark (GPU memory); ``log(line)`` reports each mark."""

    def __init__(self, interval: float, extra: Callable[[], dict[str, Any]] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.interval = interval
        self.extra = extra
        self.log = log
        self.peak: dict[str, int] = {}
        self.min_available: int | None = None
        self.samples = 0
        self.started = time.perf_counter()
        self.timeline: list[tuple[float, int | None, int | None]] = []
        self.marks: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, int]:
        now = proc_status()
        for k, v in now.items():
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem") and v > self.peak.get(k, -1):
                self.peak[k] = v
        avail = proc_meminfo("MemAvailable")
        if avail is not None and (self.min_available is None or avail < self.min_available):
            self.min_available = avail
        self.samples += 1
        t = round(time.perf_counter() - self.started, 3)
        self.timeline.append((t, now.get("RssAnon"), now.get("RssFile")))
        return now

    def mark(self, name: str) -> None:
        """Record the memory at a named point (and the peaks so far)."""
        now = self._sample()
        extra = self.extra() if self.extra is not None else {}
        self.marks.append({"phase": name, "t": self.timeline[-1][0], "rss": now.get("VmRSS"),
                           "anon": now.get("RssAnon"), "file": now.get("RssFile"),
                           "anon_peak_so_far": self.peak.get("RssAnon"), "file_peak_so_far": self.peak.get("RssFile"),
                           **extra})
        if self.log is not None:
            gpu = "".join(f", {k} {table_gb(v)} GB" for k, v in extra.items())
            self.log(f"  {name}: +{self.timeline[-1][0]:.1f} s, anon {table_gib(now.get('RssAnon'))} GiB (peak so far "
                     f"{table_gib(self.peak.get('RssAnon'))}), file-backed {table_gib(now.get('RssFile'))} GiB{gpu}")

    def coarse_timeline(self, points: int = 120) -> list[tuple[float, int | None, int | None]]:
        """At most ``points`` (seconds, RssAnon, RssFile) samples, evenly spread, keeping the anon peak."""
        step = max(1, -(-len(self.timeline) // points))
        keep = set(range(0, len(self.timeline), step)) | {len(self.timeline) - 1}
        anon = [a or 0 for _, a, _ in self.timeline]
        if anon:
            keep.add(anon.index(max(anon)))
        return [self.timeline[i] for i in sorted(keep)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@contextlib.contextmanager
def sampling(interval: float, extra: Callable[[], dict[str, Any]] | None = None,
             log: Callable[[str], None] | None = None) -> Iterator[Sampler]:
    """A running ``Sampler`` for the block, stopped (with a last sample) after it."""
    sampler = Sampler(interval, extra, log)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()


# -- one measurement in a fresh process --------------------------------------------------------------

def child_env(root: Path, extra: list[str] | None = None) -> dict[str, str]:
    """This process's environment for a measured child: ``extra`` KEY=VALUE items, the hub offline and
    quiet, and ``root`` (the checkout) on ``PYTHONPATH``."""
    env = dict(os.environ)
    for item in extra or ():
        key, _, value = item.partition("=")
        env[key] = value
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def run_child(cmd: list[str], mark: str, timeout: float | None, env: dict[str, str],
              cwd: Path) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``cmd`` in a fresh process: (the JSON it printed on a line starting with ``mark``, or an error)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, f"timed out after {timeout:.0f} s (killed)"
    found = None
    for line in out.splitlines():
        if line.startswith(mark):
            found = json.loads(line[len(mark):])
    if found is not None:
        return found, None
    why = f"child exited with {proc.returncode} and no result"
    if proc.returncode == -9:
        why += " (SIGKILL: host out of memory?)"
    return None, why


def result_stream() -> TextIO:
    """In a measured child: the original stdout, kept for the one result line; everything else anything
    prints (libraries too) goes to stderr from now on."""
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return result
