"""``python -m poros_fx``: the main job on an embedded default.

Builds a tiny Qwen2 with a LoRA adapter (random-init from a config written here: nothing is
downloaded), trains it on a small built-in token set streamed through the poros backend, trains an
independent copy with ``stream=False`` as the reference, prints the exactness check and writes the
streamed run's adapter as a standard PEFT adapter.

    python -m poros_fx                       # defaults: 3 layers, 10 steps, dropout 0.1, accumulation 2
    python -m poros_fx --nf4 --steps 20 --out my-adapter
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .. import prepare, stats
from ..errors import PorosConfigError
from ..exactness.parity import SURFACES, compare, format_diffs, train
from ..families import VALIDATED
from ..models.tiny import demo_batches, tiny_lora_model
from ..options import device_problem, parse_prefetch, resolve_device
from ..units import format_bytes


def _at_least(low: int) -> "argparse._TypeFunc":
    """An argparse type: an integer >= ``low`` (argparse names the option and exits with code 2)."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return integer


def _prefetch(text: str) -> int | str:
    try:
        return parse_prefetch(text)
    except PorosConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("prefetch ")) from None


def _device(text: str) -> str:
    problem = device_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    try:
        resolve_device(text)
    except PorosConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m poros_fx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2", choices=sorted(VALIDATED))
    ap.add_argument("--nf4", action="store_true", help="quantize the base to bitsandbytes NF4 (QLoRA)")
    ap.add_argument("--layers", type=_at_least(1), default=3, help="decoder layers (>= 1)")
    ap.add_argument("--steps", type=_at_least(1), default=10, help="optimizer steps (>= 1)")
    ap.add_argument("--accumulate", type=_at_least(1), default=2, help="micro-batches per optimizer step (>= 1)")
    ap.add_argument("--block-size", type=_at_least(1), default=1, help="decoder layers per streamed block (>= 1)")
    ap.add_argument("--prefetch", type=_prefetch, default="auto", help="an integer >= 0, or auto (measured)")
    ap.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--codegen", default=None, choices=["inductor", "eager"],
                    help="how the decoder-layer regions run (default: the device's, see prepare)")
    ap.add_argument("--out", default="poros-demo-adapter", help="folder for the PEFT adapter")
    args = ap.parse_args(argv)

    batches = demo_batches(args.steps * args.accumulate, seq=32, batch=2)
    runs = {}
    for mode in ("streamed", "stream=False"):
        torch._dynamo.reset()
        model = tiny_lora_model(args.family, nf4=args.nf4, layers=args.layers, dropout=0.1)
        prepare(model, device=args.device, block_size=args.block_size, prefetch=args.prefetch, codegen=args.codegen)
        device = next(p.device for p in model.parameters() if p.requires_grad)
        step_model = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
        start = time.perf_counter()
        # streamed, an optimizer step's micro-batches run block-major: each block loaded once for all of them
        trace = train(model, step_model, [{k: v.to(device) for k, v in b.items()} for b in batches],
                      accumulate=args.accumulate, block_major=mode == "streamed")
        seconds = time.perf_counter() - start
        s = stats(model)
        print(f"{mode:<13} {len(trace.weights)} steps in {seconds:5.1f} s (first step compiles)  "
              f"final loss {trace.losses[-1].item() * args.accumulate:.4f}  "
              # against what all blocks copy at once (layers are arena spans, alignment gaps included), not the
              # tensors' own bytes: with every block resident (stream=False) the peak is above those
              f"peak resident base {format_bytes(s['peak_resident_base_bytes'])} of {format_bytes(sum(s['block_bytes']))}  "
              f"loads {s['loads']}  recomputed blocks {s['recomputed_blocks']}")
        runs[mode] = (trace, model)
    diffs = compare(runs["streamed"][0], runs["stream=False"][0])
    print(format_diffs("exactness, streamed vs stream=False:", diffs))
    exact = all(diffs[s] == 0.0 for s in SURFACES)
    model = runs["streamed"][1]
    model.save_pretrained(args.out)
    print(f"adapter written to {args.out}/ (load it with peft.PeftModel.from_pretrained)")
    print("EXACT: torch.equal on loss, adapter weights, gradient norms and optimizer state at every step"
          if exact else "NOT EXACT")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
