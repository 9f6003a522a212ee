"""Tiny real architectures built from ``transformers`` configs, with a LoRA adapter attached.

Nothing is downloaded: the config is written here, the weights are random-init from a seed. Used by
the demo (``poros-fx demo``), the parity example and the tests.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from torch import nn

from ..io.loader import quiet_peft
from ..io.nf4_experts import quantize_experts_nf4
from ..io.quantize import quantize_nf4

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 fuses q/k/v into one projection and gate/up into another
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# Qwen3.5: every linear of both layer kinds, the gated full attention's seven projections and the
# Gated DeltaNet's five (in_proj_b / in_proj_a give the update and decay gates, one value per head)
QWEN3_5_TARGETS = (*TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Gemma 4: the seven projections; the per-layer-input gate and projection are frozen base (a full
# layer with attention_k_eq_v has no v_proj; PEFT then finds six in that layer). The MLP's three by their
# parent: with its mixture-of-experts block, NF4 experts are parametrized modules named like them
# (experts.parametrizations.down_proj), which PEFT cannot adapt
GEMMA4_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Mixture-of-experts families: the attention's four projections (and Qwen3.5-MoE's shared expert's three).
# Their experts are 3-D parameters named like the dense MLP's linears (experts.gate_up_proj, experts.down_proj),
# which PEFT would adapt as parameters (target_parameters) if these names were given bare; the routers are
# not adapted
MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# LoRA on the experts themselves: PEFT's target_parameters (a float experts weight matches by its name's end; an
# NF4 one, parametrized, only by its full path: expert_parameter_paths)
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
QWEN3_5_MOE_TARGETS = (*MOE_TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                       "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")

# LoRA on every linear of a decoder layer, per model_type
FAMILY_TARGETS: types.MappingProxyType[str, tuple[str, ...]] = types.MappingProxyType({
    "qwen2": TARGETS, "llama": TARGETS, "mistral": TARGETS, "qwen3": TARGETS, "gemma3_text": TARGETS,
    "phi3": FUSED_TARGETS, "qwen3_5_text": QWEN3_5_TARGETS, "qwen3_5": QWEN3_5_TARGETS,
    "gemma4_text": GEMMA4_TARGETS, "qwen3_moe": MOE_TARGETS, "mixtral": MOE_TARGETS, "gpt_oss": MOE_TARGETS,
    "qwen3_5_moe_text": QWEN3_5_MOE_TARGETS,
})

_CONFIGS: types.MappingProxyType[str, type] = types.MappingProxyType({
    "qwen2": transformers.Qwen2Config,
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen3": transformers.Qwen3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "phi3": transformers.Phi3Config,
    "qwen3_5_text": transformers.Qwen3_5TextConfig,
    "gemma4_text": transformers.Gemma4TextConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "gpt_oss": transformers.GptOssConfig,
    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
})
EXPERTS, EXPERTS_PER_TOKEN = 4, 2  # the tiny mixture-of-experts configs' (each token's two of four)


def lora_targets(model_type: str) -> list[str]:
    """The LoRA target modules for ``model_type``: all linears of a decoder layer (the seven
    projections, or Phi-3's four fused ones)."""
    return list(FAMILY_TARGETS.get(model_type, TARGETS))


def tiny_config(family: str = "qwen2", *, layers: int = 3, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = 256, attn: str = "sdpa", tie_word_embeddings: bool = False, intermediate: int | None = None,
                attention_dropout: float = 0.0, **overrides: object) -> transformers.PretrainedConfig:
    """A small config of ``family``: ``intermediate`` (default ``2 * hidden``) and ``hidden`` need not be
    multiples of anything; ``attention_dropout`` > 0 draws random numbers inside the attention;
    ``overrides`` are set on the config last (Gemma 4's options, say)."""
    if family not in _CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; known: {sorted(_CONFIGS)}")
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
                  attention_dropout=attention_dropout)
    if family in ("qwen3", "gemma3_text", "qwen3_5_text", "gemma4_text", "qwen3_moe", "gpt_oss", "qwen3_5_moe_text"):
        kwargs["head_dim"] = hidden // heads
    if family == "gemma3_text":
        # both attention kinds, and a window shorter than the test sequences so the sliding mask matters
        kwargs.update(sliding_window=8, layer_types=[("full_attention" if i % 2 else "sliding_attention")
                                                     for i in range(layers)])
    expert_width = intermediate or 2 * hidden
    if family == "qwen3_moe":  # every layer sparse
        kwargs.update(moe_intermediate_size=expert_width, num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                      mlp_only_layers=[], decoder_sparse_step=1)
    if family == "mixtral":  # intermediate_size is each expert's width
        kwargs.update(num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN)
    if family == "gpt_oss":
        # sliding and full layers as in the real models; transformers runs its attention sinks with eager
        # attention only (no SDPA path)
        kwargs.update(num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, sliding_window=8,
                      max_position_embeddings=32 * 4096,  # its YaRN factor 32 over 4096 original positions
                      layer_types=[("full_attention" if i % 2 else "sliding_attention") for i in range(layers)])
        attn = "eager" if attn == "sdpa" else attn
    if family == "qwen3_5_moe_text":
        kwargs.update(moe_intermediate_size=expert_width, shared_expert_intermediate_size=expert_width + 8,
                      num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN)
    if family in ("qwen3_5_text", "qwen3_5_moe_text"):
        # three Gated DeltaNet layers to one gated full-attention layer (the real models' pattern), the
        # last layer full as in the real models (two layers: one of each)
        kwargs.update(linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads,
                      linear_num_key_heads=kv_heads, linear_num_value_heads=heads,
                      layer_types=[("full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention")
                                   for i in range(layers)])
    if family == "gemma4_text":
        # sliding and full layers of different shapes (a full layer's head_dim doubled, fewer KV heads);
        # per-layer inputs and KV sharing off unless overridden (gemma4_options: all of them on)
        kwargs.update(sliding_window=8, global_head_dim=2 * hidden // heads, num_global_key_value_heads=2,
                      vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=0,
                      layer_types=[("full_attention" if i % 2 else "sliding_attention") for i in range(layers)])
    if family == "phi3":
        # Phi3Config's default special tokens (32000) lie outside a tiny vocabulary
        kwargs.update(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config = _CONFIGS[family](**kwargs)
    config._attn_implementation = attn
    return config


def gemma4_options(layers: int = 4, moe: bool = True) -> dict[str, object]:
    """Every Gemma 4 option a tiny config can switch on: per-layer embeddings (one 16-wide input per
    layer), KV sharing (the last ``layers // 2`` layers read the keys and values earlier layers
    stored), keys equal to values in the full layers (no v_proj), a double-wide MLP (in the KV-shared
    layers, where Gemma 4 puts it) and (``moe``) the mixture-of-experts block beside each MLP."""
    options: dict[str, object] = dict(hidden_size_per_layer_input=16, num_kv_shared_layers=layers // 2,
                                      attention_k_eq_v=True, use_double_wide_mlp=True)
    if moe:
        options.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return options


def qwen25_config(size: str = "0.5b") -> transformers.PretrainedConfig:
    """Qwen2.5 shapes (random-init; no hub needed)."""
    shapes = {  # hidden, intermediate, layers, heads, kv heads, tied embeddings
        "0.5b": (896, 4864, 24, 14, 2, True),
        "7b": (3584, 18944, 28, 28, 4, False),
        "32b": (5120, 27648, 64, 40, 8, False),
        "72b": (8192, 29568, 80, 64, 8, False),
    }
    if size not in shapes:
        raise ValueError(f"unknown Qwen2.5 size {size!r}; known: {sorted(shapes)}")
    hidden, inter, layers, heads, kv, tied = shapes[size]
    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=tied)
    config._attn_implementation = "sdpa"
    return config


# real shapes written from the published sizes (models/configs/README.md says where each number comes from)
SHAPE_CONFIGS = ("qwen3.5-27b", "gemma-4-31b", "qwen3-30b-a3b", "gpt-oss-120b")


def shape_config(name: str) -> transformers.PretrainedConfig:
    """A real model's shape (random-init; no hub needed): one of ``SHAPE_CONFIGS`` (``models/configs/``)."""
    if name not in SHAPE_CONFIGS:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPE_CONFIGS)}")
    config = transformers.AutoConfig.from_pretrained(Path(__file__).parent / "configs" / name)
    # gpt-oss's attention sinks have no SDPA path in transformers
    config._attn_implementation = "eager" if config.model_type == "gpt_oss" else "sdpa"
    return config


def base_model(config: transformers.PretrainedConfig, *, dtype: torch.dtype = torch.float32, nf4: bool = False,
               nested: bool = True, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """A random-init causal LM from ``config`` (``nf4``: its decoder linears quantized, ``nested``: with the
    quantization state quantized too, as ``bnb_4bit_use_double_quant``, and its fused expert weights
    quantized per expert matrix, always nested: ``io/nf4_experts.py``)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if nf4:
        quantize_nf4(model, compute_dtype=dtype, nested=nested, device=device)
        quantize_experts_nf4(model)  # a mixture of experts' fused 3-D weights, one NF4 matrix per expert
    return model


# where a family's experts module sits in a decoder layer
EXPERTS_MODULE = types.MappingProxyType({"qwen3_moe": "mlp.experts", "mixtral": "mlp.experts", "gpt_oss": "mlp.experts",
                                         "qwen3_5_moe_text": "mlp.experts", "gemma4_text": "experts"})


def expert_paths_of_config(config: transformers.PretrainedConfig, names: Sequence[str] = EXPERT_PARAMETERS) -> list[str]:
    """PEFT ``target_parameters`` naming the experts weights ``names`` of every decoder layer of a model built
    from ``config`` by full path (``model.layers.{i}.mlp.experts.gate_up_proj``): PEFT matches NF4 experts only
    so, float ones too. Empty for a model without experts."""
    text = config.get_text_config()
    module = EXPERTS_MODULE.get(text.model_type)
    if module is None or (text.model_type == "gemma4_text" and not getattr(text, "enable_moe_block", False)):
        return []
    return [f"model.layers.{i}.{module}.{name.rpartition('.')[2]}" for i in range(text.num_hidden_layers) for name in names]


def expert_parameter_paths(model: nn.Module, names: Sequence[str] = EXPERT_PARAMETERS) -> list[str]:
    """PEFT ``target_parameters`` for the experts weights ``names`` of every layer: the name's end for float
    experts, the full path of each layer's weight for NF4 (parametrized) experts, which PEFT matches only so."""
    paths = []
    for module_name, module in model.named_modules():
        for name in names:
            owner, _, tensor = name.rpartition(".")
            if module_name == owner or module_name.endswith("." + owner):
                parametrizations = getattr(module, "parametrizations", {})
                if tensor in parametrizations:
                    paths.append(f"{module_name}.{tensor}")
                elif tensor in module._parameters and name not in paths:
                    paths.append(name)
    return paths


def add_lora(model: nn.Module, *, rank: int = 8, alpha: float | None = None, dropout: float = 0.1,
             targets: list[str] | None = None, dora: bool = False, seed: int = 0,
             parameters: Sequence[str] = ()) -> nn.Module:
    """``model`` with a LoRA adapter (``targets``: default every decoder-layer linear; ``parameters``: PEFT's
    ``target_parameters``, e.g. ``expert_parameter_paths(model)``) whose B is non-zero, so every adapter
    weight has a gradient from the first step."""
    import peft

    torch.manual_seed(seed + 1)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=dropout,
                           target_modules=targets or lora_targets(model.config.model_type),
                           target_parameters=list(parameters) or None, init_lora_weights="gaussian", use_dora=dora)
    with quiet_peft():  # peft's read of a property transformers deprecated (see quiet_peft)
        model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    return model


def lora_model(config: transformers.PretrainedConfig, *, dtype: torch.dtype = torch.float32, nf4: bool = False,
               dropout: float = 0.1, rank: int = 8, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """A random-init causal LM from ``config`` with LoRA on every decoder-layer linear (``nf4``: QLoRA base)."""
    return add_lora(base_model(config, dtype=dtype, nf4=nf4, seed=seed, device=device), rank=rank, dropout=dropout,
                    seed=seed)


def tiny_lora_model(family: str = "qwen2", *, dtype: torch.dtype = torch.float32, nf4: bool = False,
                    dropout: float = 0.1, rank: int = 8, seed: int = 0, device: str | torch.device = "cpu",
                    **config_kwargs) -> nn.Module:
    """A tiny random-init causal LM of ``family`` with LoRA on every decoder-layer linear."""
    return lora_model(tiny_config(family, **config_kwargs), dtype=dtype, nf4=nf4, dropout=dropout, rank=rank,
                      seed=seed, device=device)


def demo_batches(count: int, *, vocab: int = 256, seq: int = 32, batch: int = 2, seed: int = 0) -> list[dict]:
    """``count`` batches of token ids (labels = inputs), the same for every run with the same seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def attention_batches(count: int, *, seq: int, mode: str, vocab: int = 256, batch: int = 2, pad: int = 5,
                      device: str | torch.device = "cpu", seed: int = 0) -> list[dict]:
    """``count`` batches for the attention-mask cases: ``mode`` ``none`` (no attention_mask), ``ones`` (a
    mask without padding), ``pad`` (the last row left-padded by ``pad`` tokens, their labels -100) or
    ``packed`` (two sequences per row, told by position_ids)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        b = {"input_ids": ids, "labels": ids.clone()}
        if mode == "ones":
            b["attention_mask"] = torch.ones_like(ids)
        elif mode == "pad":
            mask = torch.ones_like(ids)
            mask[-1, :pad] = 0
            b.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        elif mode == "packed":
            half = seq // 2
            b["position_ids"] = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(batch, -1)
        elif mode != "none":
            raise ValueError(f"mode must be none, ones, pad or packed, got {mode!r}")
        out.append({k: v.to(device) for k, v in b.items()})
    return out
