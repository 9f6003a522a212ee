"""Regions: each decoder layer is one compiled region, traced once per structure and run by forward,
recompute and the ``stream=False`` reference alike (``poros_fx/compiler/regions/``,
``passes/lower_regions.py``). Exactness with both codegens, and tests that break the construction on
purpose (a recompute compiled apart, a recompute without the forward's generator state) and must see
the difference."""

import warnings

import pytest
import torch
import torch.fx as fx

import poros_fx
from poros_fx.compiler import backend as backend_module
from poros_fx.compiler import regions
from poros_fx.passes.rng import PHASE
from poros_fx.prepare import get_store
from poros_fx.runtime import rng as rng_impl
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

ZERO = {s: 0.0 for s in SURFACES}


def pair(layers=3, codegen="eager", family="qwen2", batches=None, nf4=False, dropout=0.1, accumulate=2, **config):
    """(streamed, stream=False, the streamed model) of one recipe on two fresh copies."""
    batches = batches or demo_batches(4, seq=16)
    out = []
    for stream in (True, False):
        torch._dynamo.reset()
        model = tiny_lora_model(family, layers=layers, nf4=nf4, dropout=dropout, **config)
        poros_fx.prepare(model, device="cpu", codegen=codegen)
        out.append(train(model, torch.compile(model, backend="poros", options={"stream": stream}), batches,
                         accumulate=accumulate))
        out.append(model)
    return out[0], out[2], out[1]


def test_layers_of_one_structure_share_a_region():
    """Every layer runs one region (layer 0 too: its input gradient is computed and dropped), at any
    depth; the step's graph calls it once per layer."""
    for layers in (3, 6):
        torch._dynamo.reset()
        model = tiny_lora_model("qwen2", layers=layers)
        poros_fx.prepare(model, device="cpu")
        torch.compile(model, backend="poros")(**demo_batches(1)[0], use_cache=False).loss.backward()
        store = get_store(model)
        (region,) = store.regions.regions
        assert region.layers == list(range(layers))
        (schedule,) = store.schedules
        calls = [regions.called_region(n) for n in schedule.graphs["forward"].graph.nodes]
        assert sum(c is not None for c in calls) == layers
        assert {u.name for u in schedule.regions.values()} == {"r0"}


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3_text", "phi3"])
def test_equal_fingerprints_trace_equal_graphs(family):
    """The fingerprint that lets layers share a region: each layer traced on its own, layers with equal
    fingerprints give the same graphs and layers with different ones do not (Gemma 3's sliding and
    full attention layers)."""
    # layers 1-2 of a one-structure family are an equal pair; Gemma 3's 1-3 are a pair of each kind
    layers = 4 if family == "gemma3_text" else 3
    model = tiny_lora_model(family, layers=layers)
    poros_fx.prepare(model, device="cpu")
    table = get_store(model).regions
    calls = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kwargs, i=i: calls.setdefault(i, (args, kwargs)),
                                             with_kwargs=True) for i, layer in enumerate(table.layers)]
    steps = get_store(model).residency.steps  # an eager forward with grad is refused unless a poros graph is running
    steps.begin()
    try:
        model(**demo_batches(1, seq=16)[0], use_cache=False)  # the calls the model makes, from a plain forward
    finally:
        steps.end()
    for h in hooks:
        h.remove()
    codes = {}
    for index, layer in enumerate(table.layers):
        if index == 0:
            continue  # layer 0's call differs (no input gradient) and is compared with nothing below
        tensors, call = regions.flatten_call(*calls[index])
        inputs = [*tensors, *layer._poros_own, layer._poros_block]  # what call_region hands the op
        grads = "".join("1" if t.requires_grad else "0" for t in inputs)
        region = regions.trace_region(layer, call, grads, [regions.meta_of(t) for t in inputs], index)
        codes[index] = region.forward.code + region.backward.code
    fingerprints = [regions.fingerprint(layer) for layer in table.layers]
    for i in range(1, layers):
        for j in range(1, layers):
            assert (fingerprints[i] == fingerprints[j]) == (codes[i] == codes[j]), (family, i, j)
    if family == "gemma3_text":
        assert fingerprints[1] != fingerprints[2]  # full and sliding attention


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_streamed_equals_stream_false(codegen):
    """Streamed == stream=False with either codegen; with the eager codegen, == the plain eager loop too
    (the same recipe on a third copy)."""
    batches = demo_batches(4, seq=16)
    streamed, resident, model = pair(codegen=codegen, batches=batches)
    assert compare(streamed, resident) == ZERO, format_diffs(f"streamed vs stream=False ({codegen})",
                                                              compare(streamed, resident))
    (schedule,) = get_store(model).schedules
    assert schedule.codegen == codegen and {u.codegen for u in schedule.regions.values()} == {codegen}
    if codegen == "eager":
        eager = tiny_lora_model("qwen2", layers=3, dropout=0.1)
        diffs = compare(streamed, train(eager, eager, batches, accumulate=2))
        assert diffs == ZERO, format_diffs("eager codegen vs the eager loop", diffs)


def test_inductor_keeps_every_output_in_its_traced_strides():
    """Phi-3 slices q, k and v out of one fused projection and concatenates each rotated head with its
    pass-through part (``cat([rot, pass])``, ``pass`` empty at full rotary). Inductor's decompositions make
    a ``cat`` of one non-empty tensor a ``clone`` of it, in the slice's [b, s, h, d] order, where the trace
    had it [b, h, s, d]; the region's backward takes it saved and asserted the traced strides (the
    ``assert_size_stride`` an NF4 Phi-3 on the H200 failed with, here at any width, fp32, no NF4). The compiled
    forward gives every output its traced strides, and streamed == stream=False."""
    streamed, resident, model = pair(layers=2, codegen="inductor", family="phi3", batches=demo_batches(2, seq=16))
    assert compare(streamed, resident) == ZERO, format_diffs("phi3 inductor", compare(streamed, resident))
    (region,) = get_store(model).regions.regions
    signature = region.signature
    sizes = {s: 8 + 3 * k for k, s in enumerate(signature.symbols)}  # other sizes than the step's
    inputs = [_zeros_strided([int(e.subs(sizes)) for e in spec.sizes], [int(e.subs(sizes)) for e in spec.strides],
                             spec.dtype) for spec in signature.inputs]
    values = signature.bind(inputs)
    assert values is not None
    outputs = regions.runners(region, "inductor")[0](inputs, 0, 0, "", "")
    for k, (out, (shape, stride, _, _)) in enumerate(zip(outputs, region.output_meta(values), strict=True)):
        assert tuple(out.shape) == shape
        assert all(a == b for a, b, n in zip(out.stride(), stride, shape) if n != 1), (k, out.stride(), stride)


def _zeros_strided(shape: list[int], stride: list[int], dtype: torch.dtype) -> torch.Tensor:
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    return torch.zeros(span, dtype=dtype).as_strided(shape, stride)


def _backward_pass(change):
    """A pass appended to the pipeline that applies ``change`` to every recompute of a region in the
    backward graph (a node calling a region's forward there)."""

    def tamper(gm: fx.GraphModule, schedule) -> fx.GraphModule:
        if gm.meta.get(PHASE) == "backward":
            for n in gm.graph.nodes:
                found = regions.called_region(n)
                if found is not None and found[1] == "forward":
                    change(n, found[0])
        return gm

    return tamper


def test_a_recompute_compiled_apart_is_caught(monkeypatch):
    """The construction under test: the recompute runs the artifact the forward ran. Here the forward
    runs the Inductor-compiled region and the recompute the same region's aten graph (other roundings,
    and Inductor's own random numbers): the parity check must see it."""

    def recompute_with_aten(node: fx.Node, region: regions.Region) -> None:
        regions.compile_for(region, "eager")
        wrapper = rng_impl.run_with_rng_state_cpu
        runner = regions.runners(region, "eager")[0]
        node.target = lambda state, *args: wrapper(state, runner, *args)

    monkeypatch.setattr(backend_module, "GRAPH_PASSES", (*backend_module.GRAPH_PASSES, _backward_pass(recompute_with_aten)))
    streamed, resident, _ = pair(codegen="inductor", dropout=0.0)
    diffs = compare(streamed, resident)
    # the adapter's weights differ; its gradient norm may round to the same float where the gradients differ
    # only in their last bits
    assert diffs["weights"] > 0, format_diffs("recompute compiled apart", diffs)


def test_a_recompute_without_the_generator_state_is_caught(monkeypatch):
    """The recompute must draw the forward's dropout masks: run it on the generator as it is instead of
    the state the forward saved, and the parity check sees other masks."""

    def fresh_randomness(node: fx.Node, region: regions.Region) -> None:
        runner = node.target
        node.target = lambda state, *args: runner(torch.get_rng_state(), *args)

    monkeypatch.setattr(backend_module, "GRAPH_PASSES", (*backend_module.GRAPH_PASSES, _backward_pass(fresh_randomness)))
    for codegen in ("eager", "inductor"):
        streamed, resident, _ = pair(codegen=codegen, dropout=0.1)
        diffs = compare(streamed, resident)
        assert diffs["grad_norms"] > 0, (codegen, format_diffs("fresh masks in the recompute", diffs))


def test_models_of_one_structure_share_the_trace():
    """A second live prepared model of the same structure (here the stream=False reference) takes the
    first one's region instead of tracing it again: the same graphs, its own index and layers; a model
    whose layers differ (another dropout rate) traces its own. Streamed == stream=False still. (Dropout
    rates no other test uses: conftest keeps earlier tests' traces alive.)"""
    batches = demo_batches(2, seq=16)
    models, traces = [], []
    for stream, dropout in ((True, 0.11), (False, 0.11), (True, 0.12)):
        torch._dynamo.reset()
        model = tiny_lora_model("qwen2", layers=2, dropout=dropout)
        poros_fx.prepare(model, device="cpu", codegen="eager")
        traces.append(train(model, torch.compile(model, backend="poros", options={"stream": stream}), batches))
        models.append(model)
    (first,), (second,), (other,) = (get_store(m).regions.regions for m in models)
    assert first.trace_seconds > 0 and second.trace_seconds == 0.0 and other.trace_seconds > 0
    assert second.forward is first.forward and second.backward is first.backward and second.layers == [0, 1]
    assert other.forward is not first.forward
    diffs = compare(traces[0], traces[1])
    assert diffs == ZERO, format_diffs("streamed vs stream=False sharing one trace", diffs)


def test_inference_runs_the_forward_region():
    model = tiny_lora_model("qwen2", layers=2)
    reference = tiny_lora_model("qwen2", layers=2)
    model.eval()
    reference.eval()
    poros_fx.prepare(model, device="cpu")
    batch = demo_batches(1, seq=16)[0]
    with torch.no_grad():
        out = torch.compile(model, backend="poros")(**batch, use_cache=False)
        expected = reference(**batch, use_cache=False)
    assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)
    (region,) = {r.index: r for r in get_store(model).regions.regions}.values()
    assert region.backward is None and region.layers == [0, 1]


def test_a_cache_object_runs_the_layers_inline():
    """A layer called with a KV cache object cannot be a region: the layers are traced into the graph,
    with a warning that says why, and the step is still exact."""
    model = tiny_lora_model("qwen2", layers=2)
    reference = tiny_lora_model("qwen2", layers=2)
    poros_fx.prepare(model, device="cpu")
    batch = demo_batches(1, seq=16)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        out = torch.compile(model, backend="poros")(**batch, use_cache=True)  # the model makes a DynamicCache
    assert any("KV cache object" in str(w.message) for w in caught)
    torch.manual_seed(0)
    expected = reference(**batch, use_cache=True)
    assert torch.equal(out.loss, expected.loss)
    assert not get_store(model).regions.regions


def test_dump_writes_each_region(tmp_path):
    model = tiny_lora_model("qwen2", layers=2)
    poros_fx.prepare(model, device="cpu")
    torch.compile(model, backend="poros", options={"dump": str(tmp_path)})(**demo_batches(1)[0],
                                                                            use_cache=False).loss.backward()
    folder = next(tmp_path.iterdir())
    names = sorted(p.name for p in (folder / "regions").iterdir())
    assert names == [f"r0_{g}.py" for g in ("backward", "forward", "joint")]
    assert "region r0 (eager): blocks 1..2 (2)" in (folder / "schedule.txt").read_text()


def test_unprepare_restores_the_layer_classes():
    model = tiny_lora_model("qwen2", layers=2)
    classes = [type(m) for m in model.modules()]
    poros_fx.prepare(model, device="cpu")
    assert all(hasattr(type(layer), "_poros_layer_class") for layer in get_store(model).regions.layers)
    poros_fx.unprepare(model)
    assert [type(m) for m in model.modules()] == classes
    assert not any(k.startswith("_poros") for m in model.modules() for k in vars(m))


def test_mode_guards_only_modules_whose_forward_can_read_their_mode():
    """``mode_entry`` (read while Dynamo traces, so each flag is a guard) lists the modules with a forward
    of their own — the layer, attention, MLP, norms, activation, each LoRA layer and its dropout — and
    leaves out containers and plain linears, which no ``training`` flag can change (a LoRA'd Qwen2 layer:
    83 modules, 20 listed). Every flag that matters is still read: tests/test_real_loops.py's
    ``test_mode_changes_reach_the_regions`` checks eval() and adapter toggles against the eager model."""
    from poros_fx.compiler.regions.key import mode_modules

    layer = tiny_lora_model("qwen2", layers=1, dropout=0.1).get_base_model().model.layers[0]
    modules, adapters = mode_modules(layer)
    kinds = sorted({type(m).__name__ for m in modules})
    assert len(list(layer.modules())) == 83 and len(modules) == 20 and len(adapters) == 7
    assert kinds == ["Dropout", "Linear", "Qwen2Attention", "Qwen2DecoderLayer", "Qwen2MLP", "Qwen2RMSNorm", "SiLUActivation"]
    assert all(type(m).__module__.startswith("peft") for m in modules if type(m).__name__ == "Linear")


def test_a_size_a_compile_fixed_narrows_what_the_region_takes() -> None:
    """What Inductor assumes while compiling a region (a guard, a size it specializes) becomes part of the
    region's signature: a call of another size no longer binds it, so the outer graph traces another."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from poros_fx.compiler.regions.compile import compile_conditions
    from poros_fx.compiler.regions.shapes import Signature, new_env, trace_inputs

    mode = FakeTensorMode(shape_env=new_env())
    env = mode.shape_env
    (x,) = trace_inputs(mode, [((2, 9, 4), (36, 4, 1), torch.float32, torch.device("cpu"))], [True])
    signature = Signature(env, [x])
    assert signature.bind([torch.empty(2, 13, 4)]) is not None
    guards_before, replacements_before = len(env.guards), dict(env.replacements)
    length = x.shape[1]
    symbol = length.node.expr
    assert int(length) == 9  # what a lowering that needs the value does: the size is fixed from now on
    conditions = compile_conditions(env, guards_before, replacements_before)
    assert [str(c) for c in conditions] == [f"Eq({symbol}, 9)"]
    assert signature.restrict(conditions) and not signature.restrict(conditions)
    assert signature.bind([torch.empty(2, 13, 4)]) is None
    assert signature.bind([torch.empty(2, 9, 4)]) is not None
