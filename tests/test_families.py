"""Families beyond tests/test_parity.py: streamed == stream=False == the plain eager PEFT loop.

Same recipe as the parity suite: three independent model copies from the same seeds, a tiny fp32
config, LoRA dropout 0.1 on every decoder-layer linear, gradient accumulation 2, 8 AdamW steps,
``torch.equal`` on loss, adapter weights, gradient norms and optimizer state.
"""

import warnings

import pytest
import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, adamw, compare, format_diffs, train
from poros_fx.compiler import block_graph
from poros_fx.prepare import get_store
from poros_fx.models.tiny import demo_batches, gemma4_options, lora_targets, tiny_config, tiny_lora_model

STEPS = 8
ACCUMULATE = 2
ZERO = {s: 0.0 for s in SURFACES}

CASES = {
    # Gemma 3 text ties lm_head to its scaled embedding; the tiny config mixes sliding (window 8 < seq 24)
    # and full attention layers
    "gemma3_text": dict(block_size=1, prefetch=1, config=dict(tie_word_embeddings=True)),
    # Phi-3: LoRA on the fused qkv_proj / gate_up_proj
    "phi3": dict(block_size=2, prefetch=0, config={}),
    # mixture-of-experts: fused 3-D experts, two of four per token, LoRA on the attention
    "qwen3_moe": dict(block_size=1, prefetch=1, config={}),
    "mixtral": dict(block_size=2, prefetch=0, config={}),
    "gpt_oss": dict(block_size=1, prefetch=1, config={}),  # sinks, sliding and full layers, expert biases
}
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
ADAPTED = {"gemma3_text": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
           "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
           "qwen3_moe": ATTENTION, "mixtral": ATTENTION, "gpt_oss": ATTENTION}


def run(mode, family, block_size, prefetch, config):
    model = tiny_lora_model(family, dtype=torch.float32, dropout=0.1, **config)
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cpu", block_size=block_size, prefetch=prefetch)  # validated: no family=
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(STEPS * ACCUMULATE, vocab=256, seq=24, batch=2, seed=7)
    return train(model, step_model, batches, accumulate=ACCUMULATE), model


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_streamed_equals_resident_and_eager(family):
    case = CASES[family]
    streamed, model = run("stream", family, **case)
    assert get_store(model).family is poros_fx.VALIDATED[family]
    assert poros_fx.VALIDATED[family].test == "tests/test_families.py"
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == ADAPTED[family]
    assert len(streamed.weights) == STEPS

    resident, _ = run("resident", family, **case)
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs stream=False", diffs)
    stats = poros_fx.stats(model)
    assert stats["backward_runs"] == STEPS * ACCUMULATE
    assert stats["recomputed_blocks"] == stats["backward_runs"] * (len(stats["block_bytes"]) - 1)

    eager, _ = run("eager", family, **case)
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs eager", diffs)


def test_gemma3_tiny_config_exercises_its_features():
    """The parity case above covers what sets Gemma 3 apart: both attention kinds with a window shorter
    than the sequence, a scaled embedding tied to lm_head, the pre/post feed-forward norms."""
    model = tiny_lora_model("gemma3_text", tie_word_embeddings=True)
    config = model.config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window < 24
    lm = model.get_base_model()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert float(lm.model.embed_tokens.embed_scale) != 1.0
    assert hasattr(lm.model.layers[0], "pre_feedforward_layernorm")


# -- Qwen3.5 and Gemma 4: layers of several structures, state that crosses layers --------------------------

NEW_STEPS = 6
NEW_CASES = {
    # three Gated DeltaNet layers (linear attention, 2-D padding mask) to one gated full-attention layer
    "qwen3_5_text": dict(layers=4),
    # sliding and full layers of different shapes, with every option on: per-layer embeddings, KV sharing
    # (layers 2-3 read the keys and values layers 0-1 stored), keys equal to values, double-wide MLP, MoE
    "gemma4_text": dict(layers=4, **gemma4_options()),
    # Qwen3.5's two layer kinds, each with a mixture of experts and a gated shared expert
    "qwen3_5_moe_text": dict(layers=4),
}
# regions per family: one per layer structure (Gemma 4: each of a sliding / full layer that stores its
# keys and values and one that reads them)
NEW_REGIONS = {"qwen3_5_text": 2, "gemma4_text": 4, "qwen3_5_moe_text": 2}


def run_new(mode, family, *, dtype=torch.float32, nf4=False, steps=NEW_STEPS, **config):
    model = tiny_lora_model(family, dtype=dtype, nf4=nf4, dropout=0.1, **config)
    step_model = model
    if mode != "eager":
        poros_fx.prepare(model, device="cpu", block_size=1, prefetch=1, codegen="eager")
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
    batches = demo_batches(steps * ACCUMULATE, vocab=256, seq=24, batch=2, seed=7)
    # the streamed run accumulates block-major (each block once for both micro-batches), the others in order
    return train(model, step_model, batches, accumulate=ACCUMULATE, block_major=mode == "stream"), model


@pytest.mark.parametrize("family", sorted(NEW_CASES))
def test_new_family_streamed_equals_resident_and_eager(family):
    """fp32, LoRA dropout 0.1 on every linear of both layer kinds, accumulation 2 block-major: streamed ==
    stream=False == the plain eager PEFT loop, every surface, every step; each layer a region of its own
    structure, compiled once per structure; what crosses layers saved as block outputs."""
    streamed, model = run_new("stream", family, **NEW_CASES[family])
    store = get_store(model)
    assert store.family is poros_fx.VALIDATED[family]
    assert store.residency.ledger.block_major_steps == NEW_STEPS
    regions = store.regions.regions
    assert len(regions) == NEW_REGIONS[family]
    assert sorted(i for r in regions for i in r.layers) == list(range(4))  # every layer a region
    schedule = store.schedules[0]
    graph = schedule.block_graph  # the block DAG: loads in its topological order, crossings saved
    assert block_graph.load_order(graph) == list(range(len(schedule.blocks)))
    if family == "gemma4_text":  # layers 0 and 1 hand their keys and values on as region outputs
        assert {r.writes for r in regions} == {(), (("sliding_attention", 2),), (("full_attention", 2),)}
        # ... which reach the KV-shared layers 2 and 3 (blocks 3, 4) as saved block outputs: DAG edges
        assert {(1, 3), (2, 4)} <= set(block_graph.extra_edges(graph))
        assert "held from layers.0's forward" in schedule.table()
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {t.rsplit(".", 1)[-1] for t in lora_targets(family)}

    resident, _ = run_new("resident", family, **NEW_CASES[family])
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs stream=False", diffs)
    eager, _ = run_new("eager", family, **NEW_CASES[family])
    diffs = compare(streamed, eager)
    assert diffs == ZERO, format_diffs(f"{family} streamed vs eager", diffs)


# (the generator draws these families with fp32, bf16 and NF4 bases too)
@pytest.mark.parametrize("family,base", [("qwen3_5_text", "nf4"), ("gemma4_text", "bf16")])
def test_new_family_nf4_and_bf16_bases(family, base):
    """An NF4 base (bf16 compute) and a bf16 base: streamed (block-major) == stream=False, two layers (one
    of each kind). Gemma 4 here with the 31B's options (keys equal to values; no per-layer inputs, KV
    sharing or MoE)."""
    config = dict(layers=2, attention_k_eq_v=True) if family == "gemma4_text" else dict(layers=2)
    kwargs = dict(dtype=torch.bfloat16, nf4=base == "nf4", steps=2, **config)
    streamed, model = run_new("stream", family, **kwargs)
    resident, _ = run_new("resident", family, **kwargs)
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs(f"{family} {base} streamed vs stream=False", diffs)


def test_gemma4_inductor_regions_take_their_keys_gradients_as_traced():
    """Gemma 4's layers hand their keys and values on as region outputs, transposed views; the regions'
    backward was traced with their gradients contiguous (AOTAutograd's choice), and Inductor's code
    asserts it (it crashed on the H200 before the region read its tangents' layout off the trace).
    Inductor codegen, block-major: streamed == stream=False."""
    def run(mode):
        model = tiny_lora_model("gemma4_text", dtype=torch.float32, dropout=0.1, layers=2, attention_k_eq_v=True)
        poros_fx.prepare(model, device="cpu", block_size=1, prefetch=1, codegen="inductor")
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "stream"})
        batches = demo_batches(2 * ACCUMULATE, vocab=256, seq=16, batch=1, seed=7)
        return train(model, step_model, batches, accumulate=ACCUMULATE, block_major=mode == "stream"), model

    # the streamed model stays alive, so stream=False takes its lowered regions (as in every parity test)
    # instead of tracing and compiling them with Inductor a second time
    streamed, model = run("stream")
    resident, _ = run("resident")
    diffs = compare(streamed, resident)
    assert diffs == ZERO, format_diffs("gemma4_text inductor streamed vs stream=False", diffs)


def test_new_family_configs_exercise_their_features():
    """What the parity cases above cover, read off the tiny models (no compile)."""
    qwen = tiny_lora_model("qwen3_5_text", layers=4).get_base_model()
    assert qwen.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert {type(m).__name__ for m in qwen.model.layers[0].modules()} >= {"Qwen3_5GatedDeltaNet"}
    assert {"A_log", "dt_bias"} <= {n.rsplit(".", 1)[-1] for n, _ in qwen.model.layers[0].named_parameters()}
    # the qwen3_5 (multimodal) checkpoints' type builds the same text model
    import transformers

    text = tiny_config("qwen3_5_text", layers=4).to_dict()
    wrapped = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5Config(text_config=text))
    assert wrapped.config.model_type == "qwen3_5_text" and len(wrapped.model.layers) == 4
    assert "qwen3_5" in poros_fx.VALIDATED

    gemma = tiny_lora_model("gemma4_text", layers=4, **gemma4_options()).get_base_model()
    config = gemma.config
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window < 24
    attn = [layer.self_attn for layer in gemma.model.layers]
    assert attn[1].head_dim == 2 * attn[0].head_dim  # full layers: global_head_dim
    assert attn[1].v_proj is None and attn[0].v_proj is not None  # attention_k_eq_v in the full layers
    assert [a.is_kv_shared_layer for a in attn] == [False, False, True, True]
    assert [a.store_full_length_kv for a in attn] == [True, True, False, False]
    assert gemma.model.embed_tokens_per_layer.weight.shape == (256, 4 * 16)  # per-layer embeddings
    assert gemma.model.layers[2].mlp.intermediate_size == 2 * gemma.model.layers[0].mlp.intermediate_size
    assert all(layer.enable_moe_block for layer in gemma.model.layers)


def test_gemma3_user_loop_without_use_cache_runs_layers_as_regions_and_is_exact():
    """A loop that leaves ``use_cache`` to transformers (a DynamicCache while training) with a batch
    shorter than the sliding window: the layers still run as regions, and every step is exact."""
    def run(mode):
        model = tiny_lora_model("gemma3_text", dtype=torch.bfloat16, dropout=0.0, tie_word_embeddings=True,
                                layer_types=["sliding_attention"] * 3, sliding_window=9)
        step_model = model
        if mode != "eager":
            poros_fx.prepare(model, device="cpu", block_size=1, prefetch=1)
            step_model = torch.compile(model, backend="poros", options={"stream": True, "codegen": "eager"})
        opt = adamw(model)
        g = torch.Generator().manual_seed(1)
        losses = []
        for length in (12, 4, 12):
            ids = torch.randint(0, 256, (2, length), generator=g)
            loss = step_model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*traced into this graph one by one.*")
        warnings.filterwarnings("error", message=".*Dynamo split the step.*")
        streamed = run("stream")
    eager = run("eager")
    assert all(torch.equal(a, b) for a, b in zip(streamed[0], eager[0]))
    assert all(torch.equal(a, b) for a, b in zip(streamed[1], eager[1]))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_a_mixture_of_experts_compiles_one_step_for_every_length(family):
    """A mixture of experts' layer makes a tensor from a size (the grouped expert matmul's ``arange`` over
    token-expert pairs). Its region's trace runs the traced graph once; outside the region's fake mode that
    factory op ran for real and fixed the size to the first call's, and every new length compiled the whole
    step again (a few lengths later, Dynamo's recompile limit left the step uncompiled). One graph now."""
    torch._dynamo.reset()
    model = poros_fx.prepare(tiny_lora_model(family, layers=2, dropout=0.0), device="cpu")
    step = torch.compile(model, backend="poros")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for length in (9, 12, 15, 20):
        ids = torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(length))
        step(**poros_fx.mark_dynamic({"input_ids": ids, "labels": ids})).loss.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
