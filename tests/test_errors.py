"""Bad input raises an error that says what to do; prepare/unprepare round trip."""

import pytest
import torch
import transformers

import poros_fx
from poros_fx.models.tiny import demo_batches, tiny_config, tiny_lora_model


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(block_size=1.5), "block_size must be an integer >= 1"),
    (dict(prefetch=-1), "prefetch must be an integer >= 0"),
    (dict(device="mps"), "device must be 'cpu' or 'cuda'"),
])
def test_bad_prepare_options(kwargs, match):
    with pytest.raises(poros_fx.PorosConfigError, match=match):
        poros_fx.prepare(tiny_lora_model(layers=1), **kwargs)


@pytest.mark.parametrize("options,match", [
    ({"block_size": 0}, "block_size"),
    ({"prefetch": -2}, "prefetch"),
    ({"stream": "yes"}, "stream must be True or False"),
    ({"group_copies": 1}, "group_copies must be True or False"),
    ({"prefetch": "deep"}, "prefetch must be an integer >= 0 .* or 'auto'"),
    ({"blocksize": 2}, "unknown poros option"),
    ({"cuda_graphs": 1}, "cuda_graphs must be True or False"),
    ({"cuda_graphs": True}, "captures CUDA kernels; this model computes on cpu"),
])
def test_bad_backend_options(options, match):
    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    step_model = torch.compile(model, backend="poros", options=options)
    with pytest.raises(Exception, match=match):
        step_model(**demo_batches(1)[0], use_cache=False)


def test_nothing_frozen_is_refused_and_a_frozen_base_is_prepared():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(layers=1))
    with pytest.raises(poros_fx.PorosConfigError, match="nothing to stream: every parameter of the model is trainable"):
        poros_fx.prepare(model)
    poros_fx.prepare(model.requires_grad_(False))  # a base without adapter: attach one after, or evaluate


def test_unvalidated_architecture_names_validated_families():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(poros_fx.UnsupportedArchitectureError) as err:
        poros_fx.prepare(model)
    for family in ("qwen2", "llama", "mistral", "qwen3", "qwen3_5_text", "gemma4_text"):
        assert family in str(err.value)
    assert "user_asserted" in str(err.value)
    assert "layers='transformer.h'" in str(err.value)  # GPT-2's own layer list, not model.layers


def test_user_asserted_family_without_blocks():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(poros_fx.NoBlocksError, match="found no decoder layers") as err:
        poros_fx.prepare(model, family=poros_fx.user_asserted("gpt2", layers="model.layers"))
    assert "this model's layer list is 'transformer.h'" in str(err.value)


def test_user_asserted_layer_that_does_not_fit_a_region():
    """GPT-2 with attention dropout: refused by prepare (attention dropout on SDPA). Switched on after
    prepare, its layer cannot be traced as a region (the attention's branches alias), and one
    PorosConfigError says so, and what to do, instead of Dynamo's traceback alone."""
    import peft

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)  # attn_pdrop 0.1
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    family = poros_fx.user_asserted("gpt2", layers="transformer.h", embed="transformer.wte", norm="transformer.ln_f")
    with pytest.raises(poros_fx.PorosConfigError, match="attn_pdrop=0.1"):
        poros_fx.prepare(model, device="cpu", family=family)
    model.base_model.model.config.attn_pdrop = 0.0
    poros_fx.prepare(model, device="cpu", family=family)
    model.base_model.model.transformer.h[0].attn.attn_dropout.p = 0.1
    ids = torch.randint(0, 64, (1, 16))
    with pytest.raises(Exception) as err:  # a padding mask: the attention branches on it (a cond)
        torch.compile(model, backend="poros")(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                                              use_cache=False)
    assert "decoder layer 0 (GPT2Block) does not fit a poros region" in str(err.value)
    assert "regions=False" in str(err.value)


def test_user_asserted_family_streams():
    """GPT-2 keeps its blocks at transformer.h; registered by the user it streams like a validated family."""
    import peft

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, attn_pdrop=0, resid_pdrop=0,
                                     embd_pdrop=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    family = poros_fx.user_asserted("gpt2", layers="transformer.h", embed="transformer.wte", norm="transformer.ln_f")
    poros_fx.prepare(model, device="cpu", family=family)
    ids = torch.randint(0, 64, (1, 8))
    torch.compile(model, backend="poros")(input_ids=ids, labels=ids).loss.backward()
    assert poros_fx.stats(model)["recomputed_blocks"] == 3


def test_prepare_twice_and_compile_first():
    model = tiny_lora_model(layers=1)
    poros_fx.prepare(model)
    with pytest.raises(poros_fx.PorosConfigError, match="already prepared"):
        poros_fx.prepare(model)
    with pytest.raises(poros_fx.PorosConfigError, match="before torch.compile"):
        poros_fx.prepare(torch.compile(tiny_lora_model(layers=1), backend="poros"))


def test_unprepare_round_trip_dense_and_nf4():
    for nf4 in (False, True):
        model = tiny_lora_model(layers=2, nf4=nf4)
        before = {n: (type(m), ) for n, m in model.named_modules()}
        state = {k: v.clone() for k, v in model.state_dict().items()}
        poros_fx.prepare(model, device="cpu")
        assert poros_fx.stats(model)["host_bytes"] > 0
        poros_fx.unprepare(model)
        assert {n: (type(m), ) for n, m in model.named_modules()} == before
        after = model.state_dict()
        assert state.keys() == after.keys()
        assert all(torch.equal(state[k], after[k]) for k in state)
        with pytest.raises(poros_fx.PorosConfigError, match="not prepared"):
            poros_fx.unprepare(model)
        # it trains resident again, like a model that was never prepared
        model(**demo_batches(1)[0], use_cache=False).loss.backward()


def test_unprepared_model_warns_and_runs_with_block_recompute():
    """Not prepared: a warning, then the same step as eager (fp32), with the base left where it was."""
    model = tiny_lora_model(layers=2)
    reference = tiny_lora_model(layers=2)
    batch = demo_batches(1)[0]
    with pytest.warns(UserWarning, match="was not prepared"):
        torch.manual_seed(0)
        loss = torch.compile(model, backend="poros")(**batch, use_cache=False).loss
    loss.backward()
    torch.manual_seed(0)
    ref_loss = reference(**batch, use_cache=False).loss
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if p.requires_grad]
    assert grads and all(torch.equal(a, b) for a, b in grads)
    with pytest.raises(poros_fx.PorosConfigError, match="not prepared"):
        poros_fx.stats(model)


def test_a_prepared_model_whose_base_was_moved_is_refused():
    """``model.to(device)`` after prepare moves the host store's tensors too (``Module._apply`` sets
    each parameter's ``.data``); the backend refuses instead of streaming device-to-device with the
    base resident. This machine has no second device, so the entry's tensor is swapped for a meta one
    (test_gpu_parity moves a model with ``.cuda()``)."""
    from poros_fx.prepare import get_store
    from poros_fx.runtime.executor import GraphRuntime

    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    store = get_store(model)
    entry = next(e for e in store.host.tensors() if "q_proj" in e.name)
    moved = entry.host.to("meta")
    runtime = GraphRuntime(store, stream=True, phase="forward")
    with pytest.raises(poros_fx.PorosConfigError, match=r"left the host store .*model.to"):
        runtime.load_group([moved], torch.device("cpu"), 1)
    entry.host = moved
    step_model = torch.compile(model, backend="poros")
    with pytest.raises(Exception, match=r"left the host store \(.*q_proj.*\).*model.to"):
        step_model(**demo_batches(1)[0], use_cache=False)
