"""Whole training configurations, drawn by Hypothesis: the generator behind the exactness property.

One ``TrainingConfig`` is a complete training run a user could write: the family at a tiny shape whose
widths are not multiples of 8 (hidden, intermediate, head dims, vocabulary; Gemma 4's and Qwen3.5's
layer patterns), the base (fp32, bf16, NF4 with or without nested quantization state), the adapter
(rank, alpha, dropout, a subset of targets, DoRA, LoRA on a mixture of experts' fused weights, attached
after ``prepare``), the data (a fixed length
or a new one per step, longer ones with ``sequence_chunks``, padded batches with an attention mask,
labels with -100, ``num_items_in_batch``),
the surface the user trains through, accumulation (block-major or not), clipping, mode toggles and an
in-place edit of an adapter weight between steps, a resume mid-run, every poros option, and the
process's numeric modes. ``configs(device)`` is the Hypothesis strategy; ``exactness/config_runs.py`` runs one
and checks the property (streamed == ``stream=False``, == the eager loop with the eager codegen, or a
``PorosError`` before the first optimizer step).

Sizes stay tiny on purpose: an example is a whole training run, and CI runs dozens of them on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from ..models.tiny import FAMILY_TARGETS

FAMILIES = ("qwen2", "llama", "mistral", "qwen3", "gemma3_text", "phi3", "qwen3_5_text", "gemma4_text",
            "qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text")
# mixture-of-experts families and the config key of their expert count
EXPERT_COUNT = {"qwen3_moe": "num_experts", "qwen3_5_moe_text": "num_experts", "mixtral": "num_local_experts",
                "gpt_oss": "num_local_experts"}
SURFACES = ("compile", "step", "trainer", "sft")
BASES = ("fp32", "bf16", "nf4", "nf4-nested")
# head dims of the form 2 * odd (rotary embeddings need an even one): heads * head_dim is never a
# multiple of 8 for a head count that is not a multiple of 4
HEAD_DIMS = (6, 10, 14, 18)
HEAD_COUNTS = (1, 2, 3, 5, 6)
TOGGLES = ("eval_with_grad", "eval_no_grad", "adapter_off")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A tiny model of ``family``: ``hidden = heads * head_dim``; ``config`` holds the family's own keys."""

    family: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    config: tuple[tuple[str, Any], ...] = ()  # extra config keys (layer types, Gemma 4 options), sorted

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Data:
    """The batches of a run: ``lengths`` one per micro-batch; ``padding`` "none", "right" or "left" (rows of
    a batch cut short by a mask of zeros, their labels -100); ``ignored`` labels set to -100 at random;
    ``num_items``: the loss is a sum divided by the step's count of trained tokens (the Trainer's way)."""

    batch: int
    lengths: tuple[int, ...]
    padding: str
    ignored: bool
    num_items: bool
    seed: int


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    shape: Shape
    base: str  # fp32 | bf16 | nf4 | nf4-nested (NF4 bases compute in bf16)
    rank: int
    alpha: int
    dropout: float
    targets: tuple[str, ...]
    expert_lora: bool  # LoRA on the experts' fused weights too (PEFT's target_parameters)
    dora: bool
    attach_after_prepare: bool
    data: Data
    surface: str
    accumulate: int
    steps: int  # optimizer steps
    block_major: bool
    clip: float | None  # max gradient norm
    toggles: tuple[str, ...]  # between the first and second optimizer steps, in order
    edit_adapter: bool  # an adapter weight scaled in place between steps
    resume_at: int | None  # the run is stopped after this optimizer step and resumed in a fresh process state
    options: tuple[tuple[str, Any], ...]  # poros options (block_size, prefetch, codegen, memory budget, ...)
    deterministic: bool
    tf32: bool
    autocast: bool  # torch.autocast in bf16 around the forward (the Trainer's bf16=True)
    fast_sdpa: bool  # CUDA's flash / memory-efficient SDPA kernels allowed (off: the math kernel only)
    seed: int

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def describe(self) -> str:
        """One line for a table: what was drawn, shortest first."""
        s, d = self.shape, self.data
        extra = ",".join(f"{k}={v}" for k, v in s.config if k != "layer_types")
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        modes = "".join(m for m, on in (("D", self.deterministic), ("T", self.tf32), ("A", self.autocast),
                                        ("F", self.fast_sdpa)) if on)
        return (f"{self.surface} {s.family} L{s.layers} h{s.hidden}/{s.heads}x{s.head_dim} kv{s.kv_heads} "
                f"i{s.intermediate} v{s.vocab}{' ' + extra if extra else ''} | {self.base} r{self.rank} a{self.alpha} "
                f"p{self.dropout} t{len(self.targets)}{' experts' if self.expert_lora else ''}{' dora' if self.dora else ''}"
                f"{' attach-after' if self.attach_after_prepare else ''} | b{d.batch} len{list(d.lengths)} "
                f"pad={d.padding}{' ign' if d.ignored else ''}{' nib' if d.num_items else ''} | acc{self.accumulate}"
                f"x{self.steps}{' bm' if self.block_major else ''}{f' clip{self.clip}' if self.clip else ''}"
                f"{' ' + '+'.join(self.toggles) if self.toggles else ''}{' edit' if self.edit_adapter else ''}"
                f"{f' resume@{self.resume_at}' if self.resume_at else ''} | {opts}{' ' + modes if modes else ''}")


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    family = draw(st.sampled_from(FAMILIES))
    heads = draw(st.sampled_from(HEAD_COUNTS))
    kv_heads = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    hidden = heads * head_dim
    # not a multiple of 8: an odd number past the hidden size
    intermediate = draw(st.integers(hidden // 2, 3 * hidden).map(lambda n: n | 1))
    gemma4_experts = family == "gemma4_text" and draw(st.booleans())
    if family in EXPERT_COUNT or gemma4_experts:
        # transformers' grouped expert matmul (torch._grouped_mm) takes 16-byte strides only, in the eager
        # model too: expert widths and the hidden size a multiple of 8 (bf16)
        head_dim = draw(st.sampled_from([8, 16]))
        hidden = heads * head_dim
        intermediate = -(-intermediate // 8) * 8
    vocab = draw(st.integers(67, 211).map(lambda n: n | 1))
    layers = draw(st.integers(2, 3))
    config: dict[str, Any] = {}
    if family in EXPERT_COUNT:  # each token through top-k of the experts (k may be all of them)
        experts = draw(st.integers(2, 5))
        config[EXPERT_COUNT[family]] = experts
        config["num_experts_per_tok"] = draw(st.integers(1, min(3, experts)))
        if draw(st.booleans()):  # the router logits recorded, and the auxiliary load-balancing loss added
            config.update(output_router_logits=True, router_aux_loss_coef=draw(st.sampled_from([0.001, 0.5])))
    if family == "gpt_oss":
        config["layer_types"] = tuple(draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                                    min_size=layers, max_size=layers)))
        config["sliding_window"] = draw(st.sampled_from([5, 9]))
    if family in ("qwen3_5_text", "qwen3_5_moe_text"):
        # Gated DeltaNet and gated full attention layers in any order (the real models: three to one)
        config["layer_types"] = tuple(draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]),
                                                    min_size=layers, max_size=layers)))
    if family in ("gemma3_text", "gemma4_text"):
        config["layer_types"] = tuple(draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                                    min_size=layers, max_size=layers)))
        config["sliding_window"] = draw(st.sampled_from([5, 9]))
    if family == "gemma4_text":
        config["global_head_dim"] = 2 * head_dim
        config["num_global_key_value_heads"] = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
        config["attention_k_eq_v"] = draw(st.booleans())
        config["hidden_size_per_layer_input"] = draw(st.sampled_from([0, 0, 6]))
        shared = draw(st.integers(0, layers // 2))
        types = config["layer_types"]
        # a KV-shared layer reads the keys and values of the last earlier layer of its kind
        config["num_kv_shared_layers"] = shared if set(types[layers - shared:]) <= set(types[:layers - shared]) else 0
        config["use_double_wide_mlp"] = draw(st.booleans())
        if gemma4_experts:
            config.update(enable_moe_block=True, num_experts=3, top_k_experts=2, moe_intermediate_size=head_dim + 8)
    if family == "gemma3_text":
        config["tie_word_embeddings"] = draw(st.booleans())
    if draw(st.integers(0, 5)) == 0:  # refused with SDPA (attention.py), exact with eager attention
        config["attention_dropout"] = 0.1
    if draw(st.integers(0, 3)) == 0 or "attention_dropout" in config and draw(st.integers(0, 3)) > 0:
        config["attn"] = "eager"  # transformers' eager attention instead of SDPA
    return Shape(family=family, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 intermediate=intermediate, vocab=vocab, config=tuple(sorted(config.items())))


def has_experts(shape: Shape) -> bool:
    """A mixture-of-experts family, or Gemma 4 with its experts block."""
    return shape.family in EXPERT_COUNT or bool(dict(shape.config).get("enable_moe_block"))


@st.composite
def configs(draw: st.DrawFn, device: str = "cpu") -> TrainingConfig:
    """A whole training run for ``device`` ("cpu" or "cuda"); CUDA-only options are drawn on CUDA only."""
    surface = draw(st.sampled_from(SURFACES))
    shape = draw(shapes())
    targets_all = FAMILY_TARGETS[shape.family]
    targets = tuple(sorted(draw(st.sets(st.sampled_from(targets_all), min_size=1, max_size=len(targets_all)))))
    rank = draw(st.sampled_from([1, 3, 8]))
    accumulate = draw(st.sampled_from([1, 2, 2, 4]))
    steps = draw(st.sampled_from([2, 2, 3]))
    batch = draw(st.integers(1, 3))
    fixed = draw(st.booleans())
    # sequence_chunks: each layer's MLP and projections in token chunks, drawn with longer sequences (at most 48 tokens here)
    chunks = draw(st.integers(2, 4)) if draw(st.integers(0, 3)) == 0 else 1
    shortest, longest = (3, 23) if chunks == 1 else (chunks + 8, 48)
    length = draw(st.integers(shortest, longest))
    lengths = tuple([length] * (steps * accumulate) if fixed else
                    draw(st.lists(st.integers(shortest, longest), min_size=steps * accumulate,
                                  max_size=steps * accumulate)))
    data = Data(batch=batch, lengths=lengths, padding=draw(st.sampled_from(["none", "right", "left"])) if batch > 1
                else "none", ignored=draw(st.booleans()), num_items=draw(st.booleans()), seed=draw(st.integers(0, 99)))
    codegen = draw(st.sampled_from(["eager"] * 5 + ["inductor"] if device == "cpu" else ["eager", "inductor"]))
    options: dict[str, Any] = {"codegen": codegen}
    options["block_size"] = draw(st.integers(1, 2))
    options["prefetch"] = draw(st.sampled_from([0, 1, "auto"]))
    if draw(st.booleans()):  # a memory budget a few blocks fit in (on the CPU the ledger counts the base)
        options["memory_budget"] = draw(st.sampled_from(["tiny", "some", "all"]))
    if draw(st.integers(0, 3)) == 0:
        options["save_activations"] = draw(st.integers(1, shape.layers))
    if draw(st.integers(0, 3)) == 0:
        options["chunked_loss"] = True
    if draw(st.integers(0, 3)) == 0:
        options["offload_boundaries"] = True
    if chunks > 1:
        options["sequence_chunks"] = chunks
    if device == "cuda":
        options["cuda_graphs"] = draw(st.booleans())
    base = draw(st.sampled_from(BASES))
    surface_attach = surface == "compile" and draw(st.integers(0, 3)) == 0
    # DoRA attached to an already prepared NF4 base fails inside PEFT's own DoRA set-up (it dequantizes the
    # host weight); prepare refuses DoRA on NF4 when the adapter is there first
    dora = draw(st.integers(0, 7)) == 0 and not (surface_attach and base.startswith("nf4"))
    dropout = draw(st.sampled_from([0.0, 0.1]))
    # PEFT's LoRA on a parameter takes neither dropout nor DoRA
    expert_lora = has_experts(shape) and draw(st.integers(0, 2)) == 0
    if expert_lora:
        dropout, dora = 0.0, False
    toggles = tuple(draw(st.lists(st.sampled_from(TOGGLES), max_size=3))) if surface == "compile" else ()
    return TrainingConfig(
        shape=shape, base=base, rank=rank, alpha=draw(st.sampled_from([rank, 2 * rank, 16])),
        dropout=dropout, targets=targets, expert_lora=expert_lora, dora=dora,
        attach_after_prepare=surface_attach, data=data, surface=surface,
        accumulate=accumulate, steps=steps, block_major=draw(st.booleans()),
        clip=draw(st.sampled_from([None, 0.05, 1.0])), toggles=toggles,
        edit_adapter=surface in ("compile", "step") and draw(st.integers(0, 3)) == 0,
        resume_at=1 if surface in ("compile", "step") and draw(st.integers(0, 3)) == 0 else None,
        options=tuple(sorted(options.items(), key=lambda kv: kv[0])),
        deterministic=draw(st.booleans()), tf32=device == "cuda" and draw(st.booleans()),
        autocast=base != "fp32" and draw(st.integers(0, 3)) == 0, fast_sdpa=device == "cuda" and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)))
