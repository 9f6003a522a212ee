"""Never silently wrong (issue 13): each setup below either runs correctly or raises a clear error.

Gradient checkpointing left on, the device ``prepare`` puts the adapter on, family names, the
``@poros_fx.step`` prefetch default, one step at a time per prepared model, base loads outside the poros
graphs, and varying sequence lengths.
"""

import gc
import warnings

import pytest
import torch
import transformers

import poros_fx
from poros_fx.families import VALIDATED
from poros_fx.prepare import get_store
from poros_fx.models.tiny import demo_batches, tiny_lora_model


def poros_error(excinfo: pytest.ExceptionInfo) -> BaseException | None:
    """The ``PorosConfigError`` in a raised exception's chain (Dynamo wraps a backend's errors)."""
    e: BaseException | None = excinfo.value
    while e is not None and not isinstance(e, poros_fx.PorosConfigError):
        e = e.__cause__ or getattr(e, "inner_exception", None)
    return e


def enable_checkpointing(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def adapter_grads(model):
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


# -- 1. gradient checkpointing --------------------------------------------------------------------------

def test_checkpointing_on_at_prepare_is_refused():
    model = tiny_lora_model(layers=1)
    enable_checkpointing(model)
    with pytest.raises(poros_fx.PorosConfigError, match="checkpointing is on .*gradient_checkpointing_disable"):
        poros_fx.prepare(model, device="cpu")
    assert get_store(model) is None
    with torch.no_grad():  # refused before anything moved: the model still runs as it was
        model(**demo_batches(1, seq=8)[0], use_cache=False)


def test_checkpointing_switched_on_after_prepare_is_refused_by_the_backend():
    """Without the check the step compiled (the layers traced inline under the checkpoint wrapper) or
    failed in the partitioner; now the backend names the cause."""
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    enable_checkpointing(model)
    model.train()
    with pytest.raises(Exception) as excinfo:
        torch.compile(model, backend="poros")(**demo_batches(1, seq=8)[0], use_cache=False)
    err = poros_error(excinfo)
    assert err is not None and "torch.utils.checkpoint in the captured step" in str(err), excinfo.value


def test_step_and_trainer_refuse_checkpointing(tmp_path):
    from poros_fx.hf import PorosTrainer

    @poros_fx.step
    def train_step(model, batch):
        model(**batch).loss.backward()

    batch = demo_batches(1, seq=8)[0]
    unprepared = tiny_lora_model(layers=1)
    enable_checkpointing(unprepared)
    with pytest.raises(poros_fx.PorosConfigError, match="checkpointing is on"):
        train_step(unprepared, batch)
    prepared = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    enable_checkpointing(prepared)
    with pytest.raises(poros_fx.PorosConfigError, match="checkpointing is on"):
        train_step(prepared, batch)  # refused before compiling
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(poros_fx.PorosConfigError, match="checkpointing is on"):
        PorosTrainer(model=unprepared, args=args)


# -- 2. prepare puts what is not base on the compute device --------------------------------------------------

def test_prepare_places_adapter_and_buffers_on_the_device():
    """On this CPU machine the placement helper is run with the meta device as the target: the adapter's
    parameters (the same objects, an optimizer keeps working) and gradients and every buffer move, the
    frozen base stays for the host store."""
    from poros_fx.prepare import _place_on_device

    model = tiny_lora_model(layers=1)
    model(**demo_batches(1, seq=8)[0], use_cache=False).loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    _place_on_device(model, torch.device("meta"))
    assert {n: p for n, p in model.named_parameters() if p.requires_grad} == trainable  # same objects
    assert all(p.is_meta and p.grad.is_meta for p in trainable.values())
    assert all(p.device.type == "cpu" for p in frozen.values())
    buffers = dict(model.named_buffers())
    assert any("inv_freq" in n for n in buffers) and all(b.is_meta for b in buffers.values())


@pytest.mark.gpu
def test_a_cpu_built_model_prepared_for_cuda_trains():
    model = tiny_lora_model(layers=2)  # built on the CPU
    poros_fx.prepare(model, device="cuda")
    adapter = [p for p in model.parameters() if p.requires_grad]
    assert all(p.is_cuda for p in adapter)
    assert all(b.is_cuda for b in model.buffers())  # rotary inv_freq (a dense base has no host buffers)
    assert all(e.host.device.type == "cpu" for e in get_store(model).host.entries.values())
    batch = {k: v.cuda() for k, v in demo_batches(1, seq=16)[0].items()}
    step_model = torch.compile(model, backend="poros")
    for _ in range(2):  # the backward runs on autograd's device thread: still one step at a time
        step_model(**batch, use_cache=False).loss.backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in adapter)
    loss = step_model(**batch, use_cache=False).loss
    with pytest.raises(poros_fx.PorosConfigError, match="still waits for its backward"):
        step_model(**batch, use_cache=False)
    loss.backward()
    s = poros_fx.stats(model)
    assert s["backward_runs"] == 3 and s["eager_loads"] == 0 and s["resident_base_bytes"] == 0


# -- 3. family by name ------------------------------------------------------------------------------------

def test_family_by_name():
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu", family="qwen2")
    assert get_store(model).family is VALIDATED["qwen2"]
    with pytest.raises(poros_fx.PorosConfigError, match=r"family='qwen-2' is not a registered family name.*'llama'"):
        poros_fx.prepare(tiny_lora_model(layers=1), family="qwen-2")
    with pytest.raises(poros_fx.UnsupportedArchitectureError, match="family 'llama' was given for a model of type 'qwen2'"):
        poros_fx.prepare(tiny_lora_model(layers=1), family="llama")
    with pytest.raises(poros_fx.PorosConfigError, match="family must be a family name"):
        poros_fx.prepare(tiny_lora_model(layers=1), family=2)


# -- 4. @poros_fx.step prepares with the same defaults as every surface ----------------------------------------

def test_step_prepares_with_prefetch_auto():
    @poros_fx.step
    def train_step(model, batch):
        model(**batch, use_cache=False).loss.backward()

    model = tiny_lora_model(layers=1)
    train_step(model, demo_batches(1, seq=8)[0])
    assert poros_fx.stats(model)["prefetch"] == "auto"


# -- 5. one step at a time ----------------------------------------------------------------------------------

def test_forwards_interleaved_before_their_backwards_stay_exact():
    """Two forwards, then their backwards in reverse order (two losses with one backward each): each
    forward's boundary activations and RNG states are its own, so streamed == stream=False."""
    batches = demo_batches(2, seq=16)

    def run(stream):
        torch._dynamo.reset()
        model = poros_fx.prepare(tiny_lora_model(layers=2, dropout=0.1), device="cpu")
        step_model = torch.compile(model, backend="poros", options={"stream": stream})
        torch.manual_seed(0)
        first = step_model(**batches[0], use_cache=False).loss
        second = step_model(**batches[1], use_cache=False).loss
        second.backward()
        first.backward()
        return [first.detach(), second.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_a_graph_running_refuses_another():
    """Two threads on one model: a graph that starts while another graph of the model runs is refused
    (simulated here by marking a run in progress, as ``GraphRuntime`` does)."""
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    step_model = torch.compile(model, backend="poros")
    batch = demo_batches(1, seq=8)[0]
    step_model(**batch, use_cache=False).loss.backward()
    steps = get_store(model).residency.steps
    steps.begin()
    try:
        with pytest.raises(poros_fx.PorosConfigError, match="while another one was still running"):
            step_model(**batch, use_cache=False)
    finally:
        steps.end()
    step_model(**batch, use_cache=False).loss.backward()


# -- 6. base loads outside the poros graphs -------------------------------------------------------------------

def test_eager_training_forward_is_refused_and_no_grad_is_booked():
    """A prepared model called without the poros backend: under no_grad its loads are booked (and freed);
    with grad enabled the first base load raises, naming the fix, before anything is kept for a backward."""
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    batch = demo_batches(1, seq=8)[0]
    with torch.no_grad():  # generation, debugging: counted, not refused
        model(**batch, use_cache=False)
    s = poros_fx.stats(model)
    loads = s["eager_loads"]
    assert loads == s["loads"] > 0 and s["resident_base_bytes"] == 0
    with pytest.raises(poros_fx.PorosConfigError) as info:
        model(**batch, use_cache=False)
    message = str(info.value)
    assert "called without torch.compile" in message and "backend='poros'" in message
    assert "PorosSFTTrainer" in message and "@poros_fx.step" in message
    gc.collect()
    assert poros_fx.stats(model)["eager_loads"] == loads and poros_fx.stats(model)["resident_base_bytes"] == 0


def test_a_step_partly_run_by_eager_is_refused():
    """The head under ``torch.compiler.disable``: Dynamo would run it eagerly between two poros graphs,
    loading its weight unstreamed; that load raises. The graphs' own loads and gathers are fine."""
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    batch = demo_batches(1, seq=8)[0]
    torch.compile(model, backend="poros")(**batch, use_cache=False).loss.backward()
    assert poros_fx.stats(model)["eager_loads"] == 0
    torch._dynamo.reset()

    reference = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    head = reference.get_base_model().lm_head
    head.forward = torch.compiler.disable(head.forward)  # this module instance only
    with pytest.raises(poros_fx.PorosConfigError, match="Dynamo ran part of the step eagerly"):
        torch.compile(reference, backend="poros")(**batch, use_cache=False)


# -- 7. varying sequence lengths ------------------------------------------------------------------------------

def test_varying_lengths_stay_exact_and_schedules_do_not_pile_up():
    """A plain compile (no ``mark_dynamic``) over sequence lengths equals the eager loop step by step; a
    store keeps one schedule per graph the backend compiled (the first length's, then one with the length
    a symbol, which every later length runs, repeated or new), and at most ``SCHEDULES_KEPT`` of them; the
    region is traced once, with its sizes symbols."""
    from poros_fx.runtime.store import SCHEDULES_KEPT

    lengths = [8, 12, 8, 20]
    batches = [demo_batches(1, seq=s, seed=i)[0] for i, s in enumerate(lengths)]
    runs = {}
    for compiled in (True, False):
        model = tiny_lora_model(layers=1, dropout=0.1)
        step_model = model
        if compiled:
            poros_fx.prepare(model, device="cpu", codegen="eager")
            step_model = torch.compile(model, backend="poros")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.manual_seed(0)
        trace, schedules = [], []
        for batch in batches:
            loss = step_model(**batch, use_cache=False).loss
            loss.backward()
            trace.append((loss.detach(), adapter_grads(model)))
            opt.step()
            opt.zero_grad()
            if compiled:
                schedules.append(len(get_store(model).schedules))
        if compiled:
            assert schedules == [1, 2, 2, 2]  # the second length compiles a graph for every length
            store = get_store(model)
            (region,) = store.regions.regions
            assert region.signature.dynamic
            assert store.schedules.maxlen == SCHEDULES_KEPT
        runs[compiled] = trace
    for (loss, grads), (ref_loss, ref_grads) in zip(runs[True], runs[False], strict=True):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a build without CUDA")
def test_cuda_on_a_cpu_build_is_a_clear_error():
    model = tiny_lora_model("qwen2", layers=1)
    with pytest.raises(poros_fx.PorosConfigError, match="torch sees no CUDA device"):
        poros_fx.prepare(model, device="cuda")


# -- a graph break inside the decoder layers ------------------------------------------------------------------

def test_a_graph_break_inside_the_layers_is_warned_about_and_keeps_layer_blocks():
    """Dynamo split inside each layer (here a graph break before every MLP, regions off so Dynamo
    traces the layers): the backend says where and what it costs, once; a piece whose module paths
    name no layer still gets one block per layer from the base tensors it loads; and it equals the eager
    loop (the reference that costs no second split compile: each piece retraces the step up to its break)."""
    from poros_fx.exactness.parity import compare, train

    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=2, dropout=0.1), device="cpu", regions=False)
    for layer in model.base_model.model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streamed = train(model, torch.compile(model, backend="poros"), demo_batches(1, seq=16))
    split = [str(w.message) for w in caught if "split the step inside the decoder layers" in str(w.message)]
    blocks = [[b.name for b in s.blocks] for s in get_store(model).schedules]
    assert len(split) == 1 and "modeling_qwen2.py:" in split[0] and "no block is prefetched across pieces" in split[0]
    assert any(names.count("layers.0") and names.count("layers.1") for names in blocks), blocks
    eager = tiny_lora_model("qwen2", layers=2, dropout=0.1)
    assert all(v == 0.0 for v in compare(streamed, train(eager, eager, demo_batches(1, seq=16))).values())
