"""What the host does per step, timed on the CPU with a tiny model (pytest-benchmark).

A streamed step on the GPU waits for Python (docs/benchmarks.md): the host time of a step is what a change
to the executor, the passes or the regions moves first. On the CPU a tiny model's kernels take almost
nothing, so these timings are host time: a change to the host path is measured here before it costs
device time. ``make bench-cpu`` writes ``docs/bench/cpu/host_cost.{json,md}`` (``benchmarks/report.py``).

- ``test_step``: one training step (forward, backward, AdamW) of a tiny Qwen2 with LoRA and a bf16 base
  (bitsandbytes' NF4 dequantize on the CPU costs milliseconds a layer, which would hide the host's
  share), at 2 and 6 layers: PEFT eager, poros ``stream=False`` and streamed. The report takes each
  mode's growth per layer over eager PEFT's and divides it by the region calls a layer adds (streamed:
  forward, recompute, backward; resident: forward, backward): what poros costs per region call, its
  loads, bookkeeping and the recompute's few kernels included (from the minimum step: the machine is
  shared, and a neighbour's work only ever adds time).
- ``test_load_group``: ``GraphRuntime.load_group`` for one block's base, as one span of the arena (the
  regions' layout), as its separate tensors, and as the span into a load slot (under CUDA graphs: a free
  slot found instead of an allocation); on the CPU it copies the bytes too (a few hundred kB).
- ``test_graph_replay``: the host work of one region call replayed from a CUDA graph
  (``runtime/cuda_graphs.py``: the checks that its inputs are where it was recorded, the copy into its
  buffer, its outputs), with a stand-in whose replay does nothing; on the GPU the replay is one launch.
- ``test_guard_check``: Dynamo's guards on the compiled model's call, checked once per step.
- ``test_compile_phases``: the first step of a fresh model in a fresh Inductor cache (one round: it is
  the cold compile), with Dynamo's phase times (``compile_times``) and the region's trace and compile
  seconds (``poros_fx.stats``) in ``extra_info``, for the eager and the Inductor codegens at 4 layers, and
  for the eager codegen at 32: one region serves every layer, so what the first step gains per layer is
  the compile's cost per layer outside the region (Dynamo tracing each layer's call, AOTAutograd's joint
  trace and partition of the outer graph, guards) — at 80 layers (72B), most of a first step.
"""

import gc
import inspect
import types

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._inductor.utils import fresh_cache

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.runtime.cuda_graphs import WARMUP_RUNS, RegionGraphs
from poros_fx.runtime.executor import GraphRuntime
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

SEQ = 32
PHASES = ("bytecode_tracing", "aot_collect_metadata", "aot_trace_joint_graph", "create_aot_dispatcher_function",
          "OutputGraph.call_user_compiler", "build_guards", "_compile.compile_inner")


def _model(layers: int, nf4: bool):
    torch.manual_seed(0)
    return lora_model(tiny_config("qwen2", layers=layers), dropout=0.05, nf4=nf4, dtype=torch.bfloat16)


def _trainer(mode: str, layers: int, codegen: str | None = None, nf4: bool = True):
    """A step function over a fresh tiny model in ``mode`` (eager, resident, streamed) and the model."""
    model = _model(layers, nf4)
    if mode == "eager":
        forward = model
    else:
        poros_fx.prepare(model, device="cpu", **({"codegen": codegen} if codegen else {}))
        forward = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = demo_batches(1, seq=SEQ)[0]

    def step():
        forward(**batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, batch


@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("mode", ["eager", "resident", "streamed"])
def test_step(benchmark, mode, layers):
    step, model, _ = _trainer(mode, layers, nf4=False)  # bitsandbytes' CPU dequantize is not free: a bf16 base
    for _ in range(3):  # the first compiles; then warm
        step()
    benchmark.extra_info.update(layers=layers, mode=mode, region_calls_per_layer={"eager": 0, "resident": 2,
                                                                                  "streamed": 3}[mode])
    benchmark.pedantic(step, rounds=40, iterations=1, warmup_rounds=3)


@pytest.mark.parametrize("layout", ["span", "tensors", "slots"])
def test_load_group(benchmark, layout):
    step, model, _ = _trainer("streamed", 2)
    step()
    store = get_store(model)
    block = 1  # layers.0
    entries = [e for e in store.host.entries.values() if block in e.blocks and e.spans == (layout != "tensors")]
    hosts = [e.host for e in entries]
    schedule = None
    if layout == "slots":  # as under CUDA graphs: the span lands in a load slot (runtime/load_slots.py)
        store.residency.region_graphs = RegionGraphs(torch.device("cpu"), backend=_ReplayNothing())
        schedule = types.SimpleNamespace(options=types.SimpleNamespace(cuda_graphs=True, block_major=False))
    runtime = GraphRuntime(store, stream=True, phase="forward", schedule=schedule)
    runtime.load_group(hosts, torch.device("cpu"), block)  # plans the group's layout once, as a step does
    benchmark.extra_info.update(tensors=len(hosts), bytes=sum(e.nbytes for e in entries))
    benchmark(runtime.load_group, hosts, torch.device("cpu"), block)
    if layout == "slots":  # each call found the slot the call before it freed
        assert store.residency.region_graphs.load_slots.as_dict()["slots"] <= 2


class _ReplayNothing:
    """A stand-in for ``CudaGraphs`` whose replay does nothing: what is left is ``RegionGraphs``' own host work."""

    def capture(self, make_inputs, fn):
        inputs = make_inputs()
        outputs = fn(list(inputs))
        return (inputs, outputs), inputs, outputs  # the graph holds their memory, as the pool holds a graph's

    def replay(self, graph):
        pass

    def pool_bytes(self):
        return 0


def test_graph_replay(benchmark):
    """One replayed region call's bookkeeping (``RegionGraphs.call``): a 7B-like call of 20 inputs (the hidden
    state copied into the graph's buffer, 18 adapter tensors and a kept block read in place) and 50 outputs."""
    params = [torch.zeros(4, requires_grad=True) for _ in range(18)]
    block = torch.zeros(64)

    def region(inputs):
        inputs.clear()
        return [torch.zeros(4) for _ in range(50)]

    graphs = RegionGraphs(torch.device("cpu"), backend=_ReplayNothing())
    for _ in range(2 + WARMUP_RUNS):  # warm-up, record, then the run whose calls replay
        graphs.begin("run", lambda t: t is block)
        graphs.call("layer", region, [torch.ones(8), *params, block])
    assert graphs.counters.replays == 1
    hidden = torch.ones(8)
    benchmark.extra_info.update(inputs=20, outputs=50)
    benchmark(lambda: graphs.call("layer", region, [hidden, *params, block]))


def test_guard_check(benchmark):
    step, model, batch = _trainer("streamed", 2)
    step()
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    assert len(entries) == 1  # one graph, no recompiles
    bound = inspect.signature(type(model).forward).bind(model, **batch, use_cache=False)
    bound.apply_defaults()
    f_locals = dict(bound.arguments)
    manager = entries[0].guard_manager
    assert manager.check(f_locals)
    benchmark.extra_info.update(guards=len(str(manager).splitlines()))
    benchmark(manager.check, f_locals)


@pytest.mark.parametrize("codegen,layers", [("eager", 4), ("inductor", 4), ("eager", 32)])
def test_compile_phases(benchmark, codegen, layers):
    result = {}

    def first_step():
        torch._dynamo.reset()
        gc.collect()  # an earlier round's model, alive in a reference cycle, would hand this one its region
        torch._dynamo.utils.compilation_time_metrics.clear()
        with fresh_cache():
            step, model, _ = _trainer("streamed", layers, codegen)
            step()
        result["model"] = model

    benchmark.pedantic(first_step, rounds=1, iterations=1)
    times = {name: round(sum(v), 3) for name, v in torch._dynamo.utils.compilation_time_metrics.items()
             if name in PHASES}
    region = poros_fx.stats(result["model"])["regions"][0]
    assert region["trace_s"] > 0, "the region came from another live model: not a cold first step"
    benchmark.extra_info.update(layers=layers, codegen=codegen, phases_s=times, region_layers=len(region["layers"]),
                                region_trace_s=region["trace_s"], region_compile_s=region["compile_s"][codegen])
