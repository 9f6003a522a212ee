"""Model families poros-fx knows how to cut into blocks.

A family says where the decoder layers of a ``transformers`` causal LM live and which status its
exactness has: ``validated`` (a parity test in this repository's CI proves streamed == resident ==
eager, bit for bit) or ``user_asserted`` (the user registered it; nothing here has checked it).
The validated table is a constant; a user family is passed to ``prepare(..., family=...)``.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Literal

from torch import nn

from .errors import PorosConfigError, UnsupportedArchitectureError

Status = Literal["validated", "user_asserted"]


@dataclasses.dataclass(frozen=True)
class Family:
    """Where a causal LM keeps its blocks, as attribute paths from the ``*ForCausalLM`` module."""

    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    norm: str = "model.norm"
    lm_head: str = "lm_head"
    status: Status = "validated"
    test: str = ""  # the CI test that validates it
    # modules besides ``embed`` that run before the first layer (Gemma 4's per-layer embedding table,
    # its projection and norm): part of the embed block
    embed_extras: tuple[str, ...] = ()
    # the decoder layer's feed-forward submodule, applied to each token on its own (sequence_chunks runs it a
    # token chunk at a time); "" where the layer has none
    mlp: str = "mlp"

    @property
    def layer_attr(self) -> str:
        """Last component of the layer-list path (``layers``), used to read node module paths."""
        return self.layers.rsplit(".", 1)[-1]


def _validated(model_type: str, test: str = "tests/test_parity.py", **paths: object) -> Family:
    return Family(model_type=model_type, test=test, **paths)  # type: ignore[arg-type]


GEMMA4_EMBED_EXTRAS = ("model.embed_tokens_per_layer", "model.per_layer_model_projection",
                       "model.per_layer_projection_norm")


VALIDATED: types.MappingProxyType[str, Family] = types.MappingProxyType({f.model_type: f for f in (
    _validated("qwen2"), _validated("llama"), _validated("mistral"), _validated("qwen3"),
    # Gemma 3 text (Gemma3ForCausalLM: scaled embedding, sliding + full attention, four norms per layer)
    _validated("gemma3_text", "tests/test_families.py"),
    # Phi-3 (fused qkv_proj / gate_up_proj; LoRA targets those)
    _validated("phi3", "tests/test_families.py"),
    # Qwen3.5 / Qwen3.6 dense: three Gated DeltaNet layers to one gated full-attention layer (two region
    # structures); "qwen3_5" is the multimodal checkpoints' type, whose text model AutoModelForCausalLM
    # builds (Qwen3_5ForCausalLM, the same layers)
    _validated("qwen3_5_text", "tests/test_families.py"),
    _validated("qwen3_5", "tests/test_families.py"),
    # Gemma 4 text: sliding and full layers of different shapes, per-layer embeddings and KV sharing
    # (keys and values cross layers as region outputs), keys equal to values, double-wide MLP
    _validated("gemma4_text", "tests/test_families.py", embed_extras=GEMMA4_EMBED_EXTRAS),
    # mixture-of-experts: fused 3-D expert parameters (streamed with the layer, bf16 or fp32 as loaded),
    # the router and its top-k inside the region; LoRA on the attention (Qwen3.5-MoE: and the shared expert)
    _validated("qwen3_moe", "tests/test_families.py"),
    _validated("mixtral", "tests/test_families.py"),
    _validated("gpt_oss", "tests/test_families.py"),  # attention sinks: eager attention
    _validated("qwen3_5_moe_text", "tests/test_families.py"),  # Gated DeltaNet + MoE with a shared expert
)})


def user_asserted(model_type: str, *, layers: str = "model.layers", embed: str = "model.embed_tokens",
                  norm: str = "model.norm", lm_head: str = "lm_head", embed_extras: tuple[str, ...] = (),
                  mlp: str = "mlp") -> Family:
    """A family the user vouches for. ``prepare(model, family=user_asserted("mytype"))`` streams it,
    and ``prepare``'s report labels the guarantee ``user_asserted`` (no parity test has run here)."""
    return Family(model_type=model_type, layers=layers, embed=embed, norm=norm, lm_head=lm_head,
                  status="user_asserted", embed_extras=tuple(embed_extras), mlp=mlp)


def layer_list(model: nn.Module | None) -> str | None:
    """The attribute path of ``model``'s decoder-layer list as ``user_asserted(layers=...)`` wants it:
    the longest ``nn.ModuleList`` whose modules share one class (GPT-2's ``transformer.h``), or ``None``."""
    if model is None:
        return None
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            if best is None or len(module) > best[0]:
                best = (len(module), name)
    return best[1] if best else None


def resolve(model_type: str | None, family: Family | str | None = None, model: nn.Module | None = None) -> Family:
    """The family for ``model_type``: the user's if given (a ``Family``, or the name of a validated
    one such as ``"qwen2"``), else the validated one, else raise (``model``: the causal LM, whose real
    layer list the error then names)."""
    if isinstance(family, str):
        if family not in VALIDATED:
            raise PorosConfigError(f"family={family!r} is not a registered family name; pass one of "
                                   f"{', '.join(repr(k) for k in sorted(VALIDATED))}, a poros_fx.user_asserted(...) "
                                   "family, or None (the model's own config.model_type)")
        family = VALIDATED[family]
    elif family is not None and not isinstance(family, Family):
        raise PorosConfigError(f"family must be a family name ({', '.join(sorted(VALIDATED))}), a "
                               f"poros_fx.user_asserted(...) family or None, got {type(family).__name__}")
    if family is not None:
        if model_type is not None and family.model_type != model_type:
            raise UnsupportedArchitectureError(
                f"family {family.model_type!r} was given for a model of type {model_type!r}; "
                f"pass poros_fx.user_asserted({model_type!r}, ...) instead")
        return family
    if model_type in VALIDATED:
        return VALIDATED[model_type]
    names = ", ".join(sorted(VALIDATED))
    found = layer_list(model)
    where = (f"Its decoder layers are the list {found!r}; you can stream it at your own risk with "
             f"poros_fx.prepare(model, family=poros_fx.user_asserted({model_type!r}, layers={found!r}, embed=..., "
             "norm=...)) (the paths of its token embedding and final norm; parity is then yours to check)."
             if found else
             f"If its decoder layers live in a list (such as model.layers), you can stream it at your own risk with "
             f"poros_fx.prepare(model, family=poros_fx.user_asserted({model_type!r}, layers='<path of that list>')).")
    raise UnsupportedArchitectureError(
        f"model type {model_type!r} is not a validated poros-fx family (validated: {names}). {where}")
