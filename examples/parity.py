"""Train one recipe three ways and print the per-surface max difference of the streamed run.

    python examples/parity.py                        # tiny Qwen2 on the CPU, 20 steps, dropout 0.1, accumulation 2
    python examples/parity.py --nf4 --family llama   # QLoRA base (bitsandbytes NF4)
    python examples/parity.py --shape 0.5b --device cuda --dtype bfloat16 --nf4 --seq 512 --deterministic
    python examples/parity.py --codegen inductor     # the layers' regions compiled by Inductor

Runs: streamed (poros backend), stream=False (same graphs, base resident: the guarantee's reference)
and the plain eager PEFT loop. Each run builds its own model from the same seeds. Exit status 1 when
streamed != stream=False on any surface.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

import poros_fx
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import demo_batches, lora_model, qwen25_config, tiny_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--shape", default="tiny", help="tiny, or a Qwen2.5 size: 0.5b, 7b")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--nf4", action="store_true")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--codegen", default=None, choices=["inductor", "eager"],
                    help="how the decoder-layer regions run (default: the device's)")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    config = tiny_config(args.family) if args.shape == "tiny" else qwen25_config(args.shape)
    config._attn_implementation = args.attn
    batches = demo_batches(args.steps * args.accumulate, vocab=config.vocab_size, seq=args.seq, batch=args.batch,
                           seed=7)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]

    def run(mode: str) -> tuple:
        torch._dynamo.reset()
        gc.collect()  # the previous run's model sits in reference cycles; free it before measuring this one
        leftover = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        model = lora_model(config, dtype=dtype, nf4=args.nf4, dropout=args.dropout, device=device)
        step_model = model
        if mode != "eager":
            poros_fx.prepare(model, device=device, block_size=args.block_size, prefetch=args.prefetch,
                             codegen=args.codegen)
            step_model = torch.compile(model, backend="poros", options={"stream": mode == "streamed"})
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        trace = train(model, step_model, batches, accumulate=args.accumulate)
        info = {"seconds": round(time.perf_counter() - start, 2)}
        if device.type == "cuda":
            torch.cuda.synchronize()
            info.update(peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3),
                        model_resident_gb=round(base / 1e9, 3), leftover_before_build_gb=round(leftover / 1e9, 3))
        if mode != "eager":
            s = poros_fx.stats(model)
            info.update(peak_resident_base_bytes=s["peak_resident_base_bytes"], loads=s["loads"],
                        recomputed_blocks=s["recomputed_blocks"])
        del model, step_model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return trace, info

    streamed, s_info = run("streamed")
    resident, r_info = run("resident")
    result = {"args": vars(args), "torch": torch.__version__, "runs": {"streamed": s_info, "stream=False": r_info},
              "streamed_vs_resident": compare(streamed, resident)}
    print(format_diffs("streamed vs stream=False", result["streamed_vs_resident"]))
    if not args.skip_eager:
        eager, e_info = run("eager")
        result["runs"]["eager"] = e_info
        result["streamed_vs_eager"] = compare(streamed, eager)
        result["resident_vs_eager"] = compare(resident, eager)
        print(format_diffs("streamed vs eager", result["streamed_vs_eager"]))
    for name, info in result["runs"].items():
        print(f"  {name:<14} " + "  ".join(f"{k}={v}" for k, v in info.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    exact = all(result["streamed_vs_resident"][s] == 0.0 for s in SURFACES)
    print("exact: streamed == stream=False on all surfaces" if exact else "NOT EXACT")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
