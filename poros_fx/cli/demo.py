"""``poros-fx demo``: the main job on an embedded default.

Builds a tiny model with a LoRA adapter (random-init from a config written here: nothing is downloaded),
trains it on a small built-in token set streamed through the poros backend, trains an independent copy
with ``stream=False`` as the reference, prints the exactness check and writes the streamed run's adapter
as a standard PEFT adapter.

    poros-fx demo                            # defaults: qwen2, 3 layers, 10 steps, dropout 0.1, accumulation 2
    poros-fx demo --nf4 --steps 20 --out my-adapter
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import typer

from .. import prepare, stats
from ..exactness.parity import SURFACES, compare, format_diffs, train
from ..families import VALIDATED
from ..models.tiny import demo_batches, tiny_lora_model
from ..units import format_bytes
from .options import CODEGEN_OPTION, DEVICE_OPTION, PREFETCH_OPTION


def family_value(value: str) -> str:
    if value not in VALIDATED:
        raise typer.BadParameter(f"--family must be one of {', '.join(sorted(VALIDATED))}, got {value!r}")
    return value


def demo(family: str = typer.Option("qwen2", callback=family_value,
                                    help=f"model family: {', '.join(sorted(VALIDATED))}"),
         nf4: bool = typer.Option(False, "--nf4", help="quantize the base to bitsandbytes NF4 (QLoRA)"),
         layers: int = typer.Option(3, min=1, help="decoder layers"),
         steps: int = typer.Option(10, min=1, help="optimizer steps"),
         accumulate: int = typer.Option(2, min=1, help="micro-batches per optimizer step"),
         block_size: int = typer.Option(1, min=1, help="decoder layers per streamed block"),
         prefetch: str = PREFETCH_OPTION, device: Optional[str] = DEVICE_OPTION,
         codegen: Optional[str] = CODEGEN_OPTION,
         out: Path = typer.Option(Path("poros-demo-adapter"), help="folder for the PEFT adapter")) -> None:
    """Train a tiny LoRA model streamed and again with stream=False, check that every step is bit-exact
    (torch.equal on loss, adapter weights, gradient norms and optimizer state), and write the streamed run's
    adapter. Random weights, nothing downloaded. Exit status 1 if the runs differ."""
    batches = demo_batches(steps * accumulate, seq=32, batch=2)
    runs = {}
    for mode in ("streamed", "stream=False"):
        torch._dynamo.reset()
        model = tiny_lora_model(family, nf4=nf4, layers=layers, dropout=0.1)
        prepare(model, device=device, block_size=block_size, prefetch=prefetch, codegen=codegen)
        on = next(p.device for p in model.parameters() if p.requires_grad)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
        start = time.perf_counter()
        # streamed, an optimizer step's micro-batches run block-major: each block loaded once for all of them
        trace = train(model, step_model, [{k: v.to(on) for k, v in b.items()} for b in batches],
                      accumulate=accumulate, block_major=mode == "streamed")
        seconds = time.perf_counter() - start
        s = stats(model)
        print(f"{mode:<13} {len(trace.weights)} steps in {seconds:5.1f} s (first step compiles)  "
              f"final loss {trace.losses[-1].item() * accumulate:.4f}  "
              # against what all blocks copy at once (layers are arena spans, alignment gaps included), not the
              # tensors' own bytes: with every block resident (stream=False) the peak is above those
              f"peak resident base {format_bytes(s['peak_resident_base_bytes'])} of {format_bytes(sum(s['block_bytes']))}  "
              f"loads {s['loads']}  recomputed blocks {s['recomputed_blocks']}")
        runs[mode] = (trace, model)
    diffs = compare(runs["streamed"][0], runs["stream=False"][0])
    print(format_diffs("exactness, streamed vs stream=False:", diffs))
    exact = all(diffs[s] == 0.0 for s in SURFACES)
    runs["streamed"][1].save_pretrained(out)
    print(f"adapter written to {out}/ (load it with peft.PeftModel.from_pretrained)")
    print("EXACT: torch.equal on loss, adapter weights, gradient norms and optimizer state at every step"
          if exact else "NOT EXACT")
    if not exact:
        raise typer.Exit(1)
