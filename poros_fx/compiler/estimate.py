"""What a streamed training step holds on the device, estimated from a config alone (``poros-fx check``).

The memory budget (``runtime/budget.py``) plans from the *measured* peak of the first step; this is
the number ``check`` can give before any weight is read, so a user can pick a budget. Each part is a
plain product of sizes:

* base window: ``(1 + prefetch)`` x the largest load (a block, ``io/sizes.py``, or a row chunk of the
  lm_head);
* adapter: ``r x (in + out)`` fp32 values per LoRA target in every decoder layer, times four (the
  weights, their gradients, AdamW's two moments);
* boundaries: what the block DAG (``compiler/block_graph.py``, from the config: ``config_block_graph``)
  holds at its worst point, per micro-batch in flight (every micro-batch of the step when they run
  block-major): one hidden state per block (``batch x seq x hidden`` at 2 bytes), and for Gemma 4 the
  per-layer inputs (embed to every layer) and the keys and values KV-shared layers read; with
  ``offload_boundaries`` the hidden states wait in host memory and two per micro-batch in flight are on
  the device (the one being copied out or back and the one in use);
* logits: ``batch x seq x vocab`` per micro-batch in flight at 2 bytes (bf16) and 4 (the fp32 values
  the loss keeps), plus one micro-batch's fp32 gradient; with ``chunked_loss`` one vocabulary chunk's
  (``loss.py``: its bf16 and fp32 logits and their fp32 and bf16 gradients, 12 bytes a value) plus
  one fp32 ``logsumexp`` per token and chunk for every micro-batch in flight; and the last hidden state
  with its fp32 norm and fp32 gradient (10 bytes a value);
* one layer's recomputed activations: ``batch x seq x (8 x hidden + 4 x intermediate)`` at 2 bytes
  (attention in/out and the MLP's three wide tensors, dropout masks, LoRA inputs); with
  ``sequence_chunks=K`` the MLP's wide tensors are one chunk's, ``batch x seq / K x 4 x intermediate``;
  with NF4 experts, the layer's experts dequantized to bf16 (``experts x 3 x width x hidden x 2``).

The logits and the layer's activations are not alive at once (the loss's are freed before the backward
reaches the last layer): the total takes the larger. Against the whole 7B shape under a 24 GB cap
(H100, chunked loss, offloaded boundaries, 8 sequence chunks; docs/bench/long_context/cap24/): 32768,
65536 and 131072 tokens measured 5.82, 10.68 and 20.39 GB, where the loss's moment is the peak.

``long_context_plan`` picks the fewest of the long-sequence options (``chunked_loss``, then
``offload_boundaries``, then ``sequence_chunks`` 2 to 32) under which the estimate fits a device's
memory, or the longest length that fits with all of them.

Measured against it (H200, Qwen2.5-72B NF4, seq 512, r16, one micro-batch): see docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from . import block_graph


@dataclasses.dataclass(frozen=True)
class StepMemory:
    base_window: int
    adapter: int  # weights + gradients + AdamW state
    boundaries: int
    logits: int  # the head and loss's moment: logits (or one vocabulary chunk's) and the last hidden state's copies
    layer: int  # one layer's recomputed activations

    @property
    def total(self) -> int:
        # the loss's logits are freed before the first layer's backward recomputes it: one of the two at a time
        return self.base_window + self.adapter + self.boundaries + max(self.logits, self.layer)


def lora_bytes(config: Any, family: Any, targets: list[str], r: int) -> int:
    """fp32 bytes of a LoRA adapter of rank ``r`` on ``targets`` in every decoder layer."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = 0
    for name, module in model.get_submodule(family.layers).named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            total += r * (module.in_features + module.out_features) * 4
    return total


def config_block_graph(config: Any, names: list[str], tokens: int) -> Any:
    """The block DAG of a model of ``config`` (one layer per block; ``names`` from ``io/sizes.py``) with
    the bytes a micro-batch of ``tokens`` puts on each edge: each layer's input hidden state; Gemma 4's
    per-layer inputs from the embed block to every layer; its stored keys and values from the last
    layer of each kind before the KV-shared ones to every shared layer of that kind."""
    layers = len(names) - 2
    hidden = tokens * config.hidden_size * 2
    # one hidden state per decoder layer, its input (the head's input counts in its logits' share)
    found = [block_graph.Crossing(f"{names[i]} output", i, (i + 1,), hidden) for i in range(len(names) - 2)]
    per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
    if per_layer:
        found.append(block_graph.Crossing("per-layer inputs", 0, tuple(range(1, layers + 1)), tokens * layers * per_layer * 2))
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    kinds = getattr(config, "layer_types", None) or []
    if shared and kinds and layers == len(kinds):
        first = layers - shared
        for kind in sorted(set(kinds[first:])):
            store = max(i for i in range(first) if kinds[i] == kind)
            readers = tuple(1 + i for i in range(first, layers) if kinds[i] == kind)
            per = getattr(config, "per_layer_config", {}).get(store) if hasattr(config, "per_layer_config") else None
            head_dim = getattr(per, "head_dim", None) or config.head_dim
            kv_heads = getattr(per, "num_key_value_heads", None) or config.num_key_value_heads
            found.append(block_graph.Crossing(f"{kind} keys and values", 1 + store, readers,
                                              2 * tokens * kv_heads * head_dim * 2))
    return block_graph.build(names, found)


def dequantized_expert_bytes(config: Any) -> int:
    """bf16 bytes of one layer's experts, all of them dequantized at once (NF4 experts: the region
    dequantizes the whole layer's before its experts run); 0 without a mixture of experts."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if not experts or getattr(config, "enable_moe_block", True) is False:
        return 0
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return experts * 3 * width * config.hidden_size * 2


def step_memory(config: Any, window: int, *, seq: int, batch: int, in_flight: int, adapter_bytes: int,
                names: list[str] | None = None, loss_chunks: int | None = None,
                offload_boundaries: bool = False, sequence_chunks: int = 1, nf4_experts: bool = False) -> StepMemory:
    """The estimate for ``in_flight`` micro-batches held at once (block-major: the accumulation);
    ``names``: the blocks (one layer each), for the block DAG's boundary bytes; ``loss_chunks``: the
    vocabulary chunks of a chunked loss (``None``: HF's loss over the whole logits); ``sequence_chunks``:
    the token chunks of each layer's MLP; ``nf4_experts``: the experts are NF4 (dequantized in the layer)."""
    hidden, vocab = config.hidden_size, config.vocab_size
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    tokens = batch * seq
    names = names or ["embed"] + [f"layers.{i}" for i in range(config.num_hidden_layers)] + ["head"]
    boundaries = block_graph.peak_live_bytes(config_block_graph(config, names, tokens))
    if offload_boundaries:  # the hidden states wait on the host: two on the device (see the module docstring)
        boundaries = min(2, config.num_hidden_layers) * tokens * hidden * 2
    if loss_chunks is None:
        logits = in_flight * tokens * vocab * (2 + 4) + tokens * vocab * 4
    else:
        logits = tokens * -(-vocab // loss_chunks) * (2 + 4 + 4 + 2) + in_flight * tokens * loss_chunks * 4
    logits += tokens * hidden * (2 + 4 + 4)  # the last hidden state, its fp32 norm and the fp32 gradient
    return StepMemory(
        base_window=window,
        adapter=4 * adapter_bytes,
        boundaries=in_flight * boundaries,
        logits=logits,
        layer=(tokens * 8 * hidden * 2 + -(-tokens // sequence_chunks) * 4 * intermediate * 2
               + (dequantized_expert_bytes(config) if nf4_experts else 0)),
    )


CHUNK_CHOICES = (2, 4, 8, 16, 32)  # sequence_chunks long_context_plan tries


@dataclasses.dataclass(frozen=True)
class LongContextPlan:
    options: dict[str, Any]  # the long-sequence options to set (empty: none needed)
    memory: StepMemory  # the estimate under them
    fits: bool
    longest: int | None  # when it does not fit: the longest length (a multiple of 1024) that does, if any


def long_context_plan(config: Any, window: int, *, seq: int, batch: int, adapter_bytes: int, device_memory: int,
                      names: list[str] | None = None, loss_chunks: int | None = None,
                      nf4_experts: bool = False) -> LongContextPlan:
    """The fewest long-sequence options whose estimate fits ``device_memory`` at ``seq`` (one micro-batch in
    flight): chunked_loss, then offload_boundaries, then sequence_chunks from 2 to 32; without a fit, all of
    them at 32 chunks and the longest length that fits. ``loss_chunks``: the chunked loss's vocabulary
    chunks (``loss.loss_chunk_count``)."""
    candidates: list[dict[str, Any]] = [{}]
    if loss_chunks:
        candidates.append({"chunked_loss": True})
    offloaded = {**candidates[-1], "offload_boundaries": True}
    candidates.append(offloaded)
    candidates += [{**offloaded, "sequence_chunks": k} for k in CHUNK_CHOICES]

    def estimate(options: dict[str, Any], tokens: int) -> StepMemory:
        return step_memory(config, window, seq=tokens, batch=batch, in_flight=1, adapter_bytes=adapter_bytes,
                           names=names, loss_chunks=loss_chunks if options.get("chunked_loss") else None,
                           offload_boundaries=bool(options.get("offload_boundaries")),
                           sequence_chunks=options.get("sequence_chunks", 1), nf4_experts=nf4_experts)

    for options in candidates:
        memory = estimate(options, seq)
        if memory.total <= device_memory:
            return LongContextPlan(options, memory, True, None)
    options = candidates[-1]
    low, high = 0, seq // 1024  # in units of 1024 tokens: the largest that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate(options, mid * 1024).total <= device_memory else (low, mid - 1)
    return LongContextPlan(options, estimate(options, seq), False, low * 1024 or None)


LONG_SEQUENCE_OPTIONS = ("chunked_loss", "offload_boundaries", "sequence_chunks")


def options_to_add(plan: LongContextPlan, given: dict[str, Any]) -> dict[str, Any]:
    """The options of a fitting ``plan`` to turn on, where every one of them that differs from ``given`` was
    left at its default (``None``); empty when the plan does not fit, needs nothing new, or would change an
    option given explicitly."""
    if not plan.fits:
        return {}
    added = {k: v for k, v in plan.options.items() if given.get(k) != v}
    return added if all(given.get(k) is None for k in added) else {}


def long_sequence_advice(plan: LongContextPlan, given: dict[str, Any]) -> str:
    """What to change when a step is estimated over the device memory with the options ``given``: the
    long-sequence options ``plan`` (``long_context_plan``'s for that length and memory) needs beyond those
    given, or the longest length that fits with all of them. One sentence, for an error message."""
    if plan.fits:
        wanted = {k: v for k, v in plan.options.items() if given.get(k) in (None, False, 1) or
                  (k == "sequence_chunks" and given.get(k, 1) < v)}
        if wanted:
            return (f"with {', '.join(f'{k}={v!r}' for k, v in wanted.items())} the estimate is "
                    f"{plan.memory.total / 1e9:.1f} GB, which fits")
    if plan.longest:
        chosen = ", ".join(f"{k}={v!r}" for k, v in plan.options.items())
        return f"the longest length estimated to fit is about {plan.longest} tokens (with {chosen})"
    return "no length fits: the base window and the adapter alone exceed it"
