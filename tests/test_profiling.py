"""``poros_fx.bench.profiling.summarize`` on a hand-made trace: stream roles, idle split, H2D rate."""

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
