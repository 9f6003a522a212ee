"""``python -m poros_fx.bench``: the bench's command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

import torch

from .config import (DEFAULT_ACCUMS, DEFAULT_BLOCK_SIZES, DEFAULT_CHECKPOINTS, DEFAULT_METHODS, DEFAULT_MODELS,
                     DEFAULT_SEQS, NO_CUDA_MESSAGE, make_config)
from .methods import METHODS
from .run import run

DESCRIPTION = "The side-by-side benchmark (issue 3): PEFT baselines and poros in one process, one JSON matrix."

MODELS_HELP = "comma-separated: tiny, 0.5b, 7b, 32b, 72b (Qwen2.5 shapes), qwen3.5-27b, gemma-4-31b"
# each option's help, shared with `poros-fx bench` (cli/app.py): one text for the two parsers
HELP = {
    "models": MODELS_HELP,
    "methods": f"comma-separated: {', '.join(METHODS)}",
    "block_sizes": "poros block sizes (one row each)",
    "seqs": "sequence lengths; the first is the base",
    "accums": "gradient accumulation; the first is the base",
    "grid": "star: base pair + each other seq / accum alone; full: every pair",
    "steps": "timed optimizer steps per row",
    "warmup": "untimed steps first (the first compiles)",
    "device": "cuda, or cpu (with --models tiny) for a smoke run",
    "json": "results; merged into when it exists",
    "md": "markdown table (default: JSON path with .md)",
    "plot": "PNG plot (default: JSON path with .png)",
    "time_budget": "seconds; no new row starts after them",
    "profile": "profile one extra step per row: Chrome trace into DIR, summary into the row's 'profile'",
    "memory_budget": "poros_budget, poros_budget_saved and their _graphs rows: their memory_budget (e.g. 24GB)",
    "compiled_resident": "add compiled_resident (plain torch.compile/Inductor; 0.5B and 7B only)",
    "checkpoints": "unsloth_*: the random-init checkpoint of each model is written (once) under DIR",
    "unsloth_offload_layers": "unsloth_offload: decoder layers Unsloth swaps from host memory (default: all)",
    "compile_warm": "compiled rows: compile_s cold (a fresh Inductor cache) and warm (a second process, same cache)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m poros_fx.bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS, help=HELP["models"])
    p.add_argument("--methods", default=DEFAULT_METHODS, help=HELP["methods"])
    p.add_argument("--block-sizes", default=DEFAULT_BLOCK_SIZES, help=HELP["block_sizes"])
    p.add_argument("--seqs", default=DEFAULT_SEQS, help=HELP["seqs"])
    p.add_argument("--accums", default=DEFAULT_ACCUMS, help=HELP["accums"])
    p.add_argument("--grid", default="star", choices=("star", "full"), help=HELP["grid"])
    p.add_argument("--steps", type=int, default=10, help=HELP["steps"])
    p.add_argument("--warmup", type=int, default=1, help=HELP["warmup"])
    p.add_argument("--device", default="cuda", help=HELP["device"])
    p.add_argument("--json", default="poros-bench.json", help=HELP["json"])
    p.add_argument("--md", default=None, help=HELP["md"])
    p.add_argument("--plot", default=None, help=HELP["plot"])
    p.add_argument("--time-budget", type=float, default=None, help=HELP["time_budget"])
    p.add_argument("--profile", default=None, metavar="DIR", help=HELP["profile"])
    p.add_argument("--memory-budget", default=None, help=HELP["memory_budget"])
    p.add_argument("--compiled-resident", action="store_true", help=HELP["compiled_resident"])
    p.add_argument("--checkpoints", default=DEFAULT_CHECKPOINTS, metavar="DIR", help=HELP["checkpoints"])
    p.add_argument("--unsloth-offload-layers", type=int, default=None, metavar="N", help=HELP["unsloth_offload_layers"])
    p.add_argument("--compile-warm", action="store_true", help=HELP["compile_warm"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m poros_fx.bench``; returns the exit status (2: no CUDA without --device cpu, bad options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    try:
        config = make_config(models=args.models, methods=args.methods, block_sizes=args.block_sizes, seqs=args.seqs,
                             accums=args.accums, grid=args.grid, steps=args.steps, warmup=args.warmup,
                             device=args.device, json_path=args.json, md_path=args.md, plot_path=args.plot,
                             time_budget=args.time_budget, compiled_resident=args.compiled_resident,
                             profile_dir=args.profile, memory_budget=args.memory_budget,
                             checkpoints=args.checkpoints, unsloth_offload_layers=args.unsloth_offload_layers,
                             compile_warm=args.compile_warm,
                             command=shlex.join(["python", "-m", "poros_fx.bench", *argv]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0
