"""``poros_fx.report(model)``: what ``prepare`` made of a model, in the seed's short form.

    poros-fx prepared model
      model_type  qwen2
          family  validated (tests/test_parity.py)
         adapter  lora r=16 alpha=32 dropout=0.05 (7 target modules)
       precision  NF4 (bitsandbytes) + bfloat16
      block_size  1 (prefetch 1), 26 blocks, largest 259.7 MiB (head)
       host base  453.4 MiB (pinned), compute device cuda:0
            ends  embedding rows gathered from the host store; head block loaded whole (259.7 MiB)
       guarantee  streamed == stream=False, torch.equal on loss, adapter, grad norms and optimizer state ...

``prepare`` logs it at INFO on the ``poros_fx`` logger; the CLI prints it.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from .errors import PorosConfigError
from .handles import causal_lm, get_store, unwrap
from .options import PorosOptions, cuda_graphs_choice
from .runtime.budget import describe as describe_budget
from .units import format_bytes


def _adapter(model: nn.Module) -> str:
    configs = getattr(unwrap(model), "peft_config", None)
    if not configs:
        if not any(p.requires_grad for p in unwrap(model).parameters()):
            return "none (the base alone: evaluation or inference; attach one with peft.PeftModel.from_pretrained)"
        return "none found (trainable parameters without a PEFT config)"
    parts = []
    for name, cfg in configs.items():
        kind = str(getattr(cfg, "peft_type", "?")).split(".")[-1].lower()
        targets = getattr(cfg, "target_modules", None) or ()
        parts.append(f"{kind} r={getattr(cfg, 'r', '?')} alpha={getattr(cfg, 'lora_alpha', '?')} "
                     f"dropout={getattr(cfg, 'lora_dropout', '?')} ({len(targets)} target modules)"
                     + ("" if name == "default" else f" [{name}]"))
    frozen = not any(p.requires_grad for p in unwrap(model).parameters())
    return "; ".join(parts) + (" (frozen: evaluation or inference)" if frozen else "")


def _precision(model: nn.Module) -> str:
    store = get_store(model)
    nf4 = any(".quant_state." in e.name for e in store.host.tensors())
    dtypes = Counter(str(e.host.dtype).replace("torch.", "") for e in store.host.tensors()
                     if ".quant_state." not in e.name and e.host.dtype.is_floating_point)
    dense = "+".join(d for d, _ in dtypes.most_common())
    return f"NF4 (bitsandbytes) + {dense}" if nf4 else dense


def _ends(store) -> str:
    """How the embedding and the head reach the device."""
    gathered = any(not e.blocks for e in store.host.tensors())
    head = store.host.block_bytes()[-1]
    chunks = store.host.head_chunks
    return ("embedding rows gathered from the host store" if gathered else "embedding table loaded as a block") + (
        f"; lm_head in {chunks} row chunks of ~{format_bytes(head / chunks)}" if chunks > 1 else
        f"; head block loaded whole ({format_bytes(head)})")


def _layers(store) -> str:
    """How decoder layers run under torch.compile."""
    if store.regions is None:
        return "traced into the step's graph one by one (regions=False)"
    return (f"compiled regions, codegen {store.codegen} (one compile per distinct layer structure; "
            f"{len(store.regions.regions)} traced so far)")


def _graphs(store) -> str:
    """Whether region calls replay from CUDA graphs: the last compiled step's choice, or before any the
    default for this store."""
    if store.schedules:
        return store.schedules[-1].graphs_note
    on, note = cuda_graphs_choice(PorosOptions(), store.device, store.offload_boundaries, store.sequence_chunks)
    return note + " (the step's options may say otherwise)"


def report(model: nn.Module) -> str:
    """A short plain-text report of a prepared model: type, family status, adapter, precision, blocks,
    host bytes and the guarantee that applies."""
    store = get_store(model)
    if store is None:
        raise PorosConfigError("model is not prepared; call poros_fx.prepare(model) first")
    fam = store.family
    sizes = store.host.block_bytes()
    guarantee = ("streamed == stream=False, torch.equal on loss, adapter, grad norms and optimizer state "
                 "(validated family, parity-tested in CI)" if fam.status == "validated" else
                 "user_asserted: streamed through the same passes, but no parity test of poros-fx has run on "
                 "this family")
    rows = [
        ("model_type", getattr(getattr(causal_lm(model), "config", None), "model_type", "?")),
        ("family", f"{fam.status}" + (f" ({fam.test})" if fam.test else "")),
        ("adapter", _adapter(model)),
        ("precision", _precision(model)),
        ("block_size", f"{store.host.block_size} (prefetch {store.prefetch}), {len(sizes)} blocks, largest "
                       f"{format_bytes(max(sizes))} ({store.host.block_names[sizes.index(max(sizes))]})"),
        ("host base", format_bytes(store.host.host_bytes()) + (" (pinned)" if store.host.pinned() else "")
         + f", compute device {store.device}"),
        ("ends", _ends(store)),
        ("layers", _layers(store)),
        ("memory", describe_budget(store)),
        ("cuda graphs", _graphs(store)),
        ("guarantee", guarantee),
    ]
    width = max(len(k) for k, _ in rows)
    return "poros-fx prepared model\n" + "\n".join(f"  {k:>{width}}  {v}" for k, v in rows)
