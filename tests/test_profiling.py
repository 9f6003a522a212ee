"""``poros_fx.bench.profiling.summarize`` on a hand-made trace: stream roles, idle split, H2D rate."""

from pathlib import Path

import torch

from poros_fx.bench.profiling import summarize


def _ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_summarize_splits_compute_idle_into_cpu_and_waiting_on_copy():
    trace = {"traceEvents": [
        _ev("cuda_runtime", "cudaLaunchKernel", 0, 5, correlation=1),
        _ev("kernel", "sm90_xmma_gemm_bf16", 10, 100, stream=7, correlation=1),
        _ev("cuda_runtime", "cudaMemcpyAsync", 6, 4, correlation=2),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 200, stream=21, correlation=2, bytes=2_000_000),
        # launched early (t=12), but runs only after the copy: the compute stream waited on it
        _ev("cuda_runtime", "cudaLaunchKernel", 12, 3, correlation=3),
        _ev("kernel", "kDequantizeBlockwise", 230, 50, stream=7, correlation=3),
        # launched late (t=300, after the stream ran dry at 280): a CPU gap
        _ev("cuda_runtime", "cudaLaunchKernel", 300, 10, correlation=4),
        _ev("kernel", "elementwise", 320, 30, stream=7, correlation=4),
        _ev("cuda_runtime", "cudaStreamSynchronize", 312, 40),
        _ev("cuda_runtime", "cudaMalloc", 290, 6),
    ]}
    s = summarize(trace)
    assert s["compute_stream"] == 7 and s["copy_streams"] == [21]
    assert s["wall_ms"] == 0.352  # 0 .. 352 us
    assert s["idle"]["waiting_ms"] == 0.12  # 110 -> 230
    assert s["idle"]["waiting_on_copy_ms"] == 0.11  # the copy ran 20 -> 220
    assert s["idle"]["cpu_ms"] == 0.04  # 280 -> 320
    assert s["h2d"] == {"bytes": 2_000_000, "ms": 0.2, "count": 1, "gbps": 10.0}
    assert s["categories_ms"] == {"gemm": 0.1, "dequantize": 0.05, "other": 0.03}
    assert s["cpu_sync_ms"] == 0.04
    assert s["cuda_malloc"] == {"calls": 1, "ms": 0.006}
    assert s["streams"]["21"] == {"busy_ms": 0.2, "kernels": 0, "copies": 1}


def test_summarize_of_a_cpu_trace_says_so():
    s = summarize({"traceEvents": [_ev("cpu_op", "aten::mm", 0, 10)]})
    assert s["wall_ms"] == 0.01 and "CPU run" in s["note"]


def test_memory_summary_lists_what_is_alive_at_the_peak():
    """``bench.memory_profile.summarize_memory`` on a hand-made allocator trace: the peak counts from the
    bytes allocated before the step, and only the allocations alive at that moment are listed, by line."""
    from poros_fx.bench.memory_profile import summarize_memory

    here = {"filename": __file__, "line": 1, "name": "step"}
    torch_frame = {"filename": str(Path(torch.__file__).parent / "nn" / "functional.py"), "line": 5, "name": "linear"}
    unit = 10**8  # 0.1 GB
    trace = [
        {"action": "alloc", "addr": 1, "size": 3 * unit, "frames": [torch_frame, here]},
        {"action": "alloc", "addr": 2, "size": 5 * unit, "frames": [{"filename": "gen.py", "line": 7, "name": "call"}]},
        {"action": "free_requested", "addr": 1, "size": 3 * unit, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 3 * unit, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * unit, "frames": [here]},
        {"action": "alloc", "addr": 4, "size": 2 * unit, "frames": [here]},  # the peak: 10 + 5 + 2 + 2
        {"action": "free_completed", "addr": 2, "size": 5 * unit, "frames": []},
        {"action": "alloc", "addr": 5, "size": 4 * unit, "frames": [here]},  # 10 + 2 + 2 + 4: below it
    ]
    s = summarize_memory(trace, before=10 * unit)
    assert (s["peak_gb"], s["before_step_gb"], s["from_before_at_peak_gb"]) == (1.9, 1.0, 1.0)
    assert [(a["gb"], a["count"], a["where"].split(":")[0]) for a in s["at_peak"]] == [
        (0.5, 1, "gen.py"), (0.4, 2, "test_profiling.py")]
    assert s["at_peak"][1]["where"].startswith("test_profiling.py:1 step: ")  # the line's source is read
