"""The bookkeeping of CUDA graphs of region calls (``runtime/cuda_graphs.py``), on the CPU.

``RegionGraphs`` is driven with a stand-in for ``CudaGraphs``: its capture runs the call once (and puts
the random generator back, as a capture draws nothing), its replay runs the call again on the buffers it
was captured with and writes the results over the captured outputs — as a CUDA graph writes where its
capture allocated. Two calls per run (the second reads the first's output in place), a parameter read in
place, an input that is a new tensor every run (copied into the graph's buffer), dropout (the generator
at replay time): every run equals the same calls made directly; tensors a run returns survive the next
run's replays (they were copied out); a parameter that moved makes its calls run uncaptured, still equal.
The real capture is tested on the H200 (``tests/test_gpu_cuda_graphs.py``).
"""

from __future__ import annotations

import torch

from poros_fx.runtime.cuda_graphs import RERECORDS, WARMUP_RUNS, RegionGraphs


class Replayer:
    """A stand-in for ``CudaGraphs`` (see the module docstring)."""

    def capture(self, make_inputs, fn):
        rng = torch.get_rng_state()
        inputs = make_inputs()
        outputs = fn(list(inputs))
        torch.set_rng_state(rng)
        return (fn, inputs, outputs), inputs, outputs  # the graph holds its outputs' memory, as the pool does

    def replay(self, graph):
        fn, inputs, outputs = graph
        for out, new in zip(outputs, fn(list(inputs))):
            out.copy_(new)

    def pool_bytes(self):
        return 0


def region(inputs: list) -> list:
    """A boxed region call: releases its inputs, draws dropout masks."""
    x, w = inputs
    inputs.clear()
    h = torch.nn.functional.dropout(x @ w, 0.5, training=True)
    return [torch.tanh(h), h * 2]


def step(graphs: RegionGraphs | None, x: torch.Tensor, w: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """One outer run: two region calls, the second on the first's output; returns both calls' second output."""
    torch.manual_seed(seed)

    def call(site, inputs):
        return region(inputs) if graphs is None else graphs.call(site, region, inputs)

    def body():
        a = call("layer0", [x.clone(), w])  # a new tensor every run: copied into the graph's buffer
        b = call("layer1", [a[0], w])  # the first call's output: read in place
        return [b[0], a[1]]

    return body() if graphs is None else graphs.around(("run", tuple(x.shape)), lambda t: False, body)


def test_runs_warm_up_record_replay_and_equal_the_direct_calls():
    w = torch.randn(8, 8, requires_grad=True)  # a parameter: read in place
    x = torch.randn(4, 8)
    graphs = RegionGraphs(torch.device("cpu"), backend=Replayer())
    kept = []
    for run in range(6):
        got = step(graphs, x, w, seed=run)
        want = step(None, x, w, seed=run)
        assert all(torch.equal(g, e) for g, e in zip(got, want)), f"run {run} differs"
        kept.append((got, [t.clone() for t in got]))
    c = graphs.counters
    assert (c.uncaptured, c.captures, c.replays, c.fallbacks) == (2 * WARMUP_RUNS, 2, 2 * (6 - WARMUP_RUNS - 1), 0)
    assert c.escaped > 0
    for got, snapshot in kept:  # what a run returned is its own memory: later replays did not write it
        assert all(torch.equal(g, s) for g, s in zip(got, snapshot))
    recorded = next(iter(graphs.chains.values())).graphs
    assert [s.kind for s in recorded[("layer1", ())].inputs] == ["direct", "direct"]
    assert [s.kind for s in recorded[("layer0", ())].inputs] == ["copy", "direct"]


def test_a_moved_parameter_runs_uncaptured_then_is_recorded_again():
    """A parameter read in place that moved: its calls run uncaptured (still equal), the next run records the
    chain again and later runs replay it; after ``RERECORDS`` of those, a move runs uncaptured for good."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    graphs = RegionGraphs(torch.device("cpu"), backend=Replayer())
    for run in range(3):
        step(graphs, x, w, seed=run)
    c = graphs.counters
    for i in range(RERECORDS + 1):
        w = w.detach().clone().requires_grad_()  # the same values at another address
        for run in range(3):  # falls back (the first call; the second reads its output), records, replays
            got = step(graphs, x, w, seed=10 * i + run)
            assert all(torch.equal(g, e) for g, e in zip(got, step(None, x, w, seed=10 * i + run)))
    assert c.rerecorded == RERECORDS and c.captures == 2 * (1 + RERECORDS)
    assert c.fallbacks == 2 * RERECORDS + 2 * 3 and c.replays == 2 * (1 + RERECORDS)


def test_each_input_shape_is_a_chain_of_its_own():
    w = torch.randn(8, 8, requires_grad=True)
    graphs = RegionGraphs(torch.device("cpu"), backend=Replayer())
    for run in range(8):
        x = torch.randn(4 if run % 2 else 6, 8)
        got = step(graphs, x, w, seed=run)
        assert all(torch.equal(g, e) for g, e in zip(got, step(None, x, w, seed=run)))
    assert len(graphs.chains) == 2 and graphs.counters.captures == 4 and graphs.counters.replays == 8


def test_an_input_of_another_dtype_or_layout_is_not_copied_into_the_graph():
    """A replay copies a moved input into the graph's buffer; one of another dtype or strides would be converted
    or laid out anew by that copy: such a call runs uncaptured instead."""

    def double(inputs):
        (x,) = inputs
        inputs.clear()
        return [x * 2]

    graphs = RegionGraphs(torch.device("cpu"), backend=Replayer())
    x = torch.arange(12.0).reshape(3, 4)
    for _ in range(2 + WARMUP_RUNS):
        graphs.around("run", lambda t: False, lambda: graphs.call("site", double, [x.clone()]))
    assert graphs.counters.replays == 1
    for other in (x.double(), x.t().contiguous().t()):
        got = graphs.around("run", lambda t: False, lambda: graphs.call("site", double, [other]))
        assert got[0].dtype == other.dtype and torch.equal(got[0], other * 2)
    assert graphs.counters.fallbacks == 2 and graphs.counters.replays == 1


def test_an_expanded_input_is_copied_into_the_graph_by_its_storage():
    """A new input each run whose elements share memory (a mask expanded over the batch: stride 0) is laid
    out alike in the graph's buffer, which ``copy_`` cannot write element by element: its span is copied."""

    def scale(inputs):
        x, w = inputs
        inputs.clear()
        return [x * w]

    graphs = RegionGraphs(torch.device("cpu"), backend=Replayer())
    w = torch.randn(4, 8)
    for run in range(3 + WARMUP_RUNS):
        x = torch.randn(1, 8).expand(4, 8)  # a new tensor every run, four rows over one
        got = graphs.around("run", lambda t: False, lambda: graphs.call("site", scale, [x, w]))
        assert torch.equal(got[0], x * w), run
    assert graphs.counters.captures == 1 and graphs.counters.replays >= 2, graphs.counters
