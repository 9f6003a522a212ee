"""Where a long sequence's device memory goes: peak, step time and the largest live tensors at the peak.

One process, a Qwen2.5-shaped model cut to ``--layers`` decoder layers (random-init NF4, LoRA r16 on the
seven projections), streamed with the given options, one training step per length (after a warm-up
step at the first length). For each length: step seconds, peak allocated bytes, and, with
``--snapshot``, the tensors alive at the moment of the peak (from ``torch.cuda.memory._record_memory_history``),
grouped by the innermost frame of this project, transformers, peft or torch that allocated them.
A length that fails records its error (with ``CUDA_LAUNCH_BLOCKING=1`` the failing kernel's stack).
Writes ``probe.json`` and ``probe.md`` to the folder given.

    python benchmarks/scripts/long_context_probe.py OUT [--size 7b] [--layers 2] [--seqs 32768,65536]
        [--options chunked_loss=1,offload_boundaries=1,sequence_chunks=8] [--codegen inductor] [--snapshot] [--mask]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path

import peft
import torch

import poros_fx
from poros_fx.bench import environment
from poros_fx.models.tiny import lora_targets, qwen25_config

FRAME_KEYS = ("poros_fx", "passes/", "transformers/", "peft/", "torch/")


def parse_options(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = bool(int(value)) if value in ("0", "1") else int(value) if value.isdigit() else value
    return out


def peak_tensors(snapshot: dict, top: int = 15) -> list[dict]:
    """The allocations alive when the allocated total peaked, grouped by allocating frame."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            total += e["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for size, where in best_live.values():
        groups[where].append(size)
    rows = [{"where": w, "count": len(s), "gb": sum(s) / 1e9, "largest_gb": max(s) / 1e9} for w, s in groups.items()]
    return sorted(rows, key=lambda r: -r["gb"])[:top]


def top_kernels(prof: torch.profiler.profile, top: int = 40) -> list[dict]:
    """The device kernels with the most total time in a profiled step, and their share of all device time."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) or 1
    rows = [{"kernel": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3,
             "share": e.self_device_time_total / total} for e in events]
    return [{"kernel": "ALL", "calls": 0, "ms": total / 1e3, "share": 1.0}] + sorted(rows, key=lambda r: -r["ms"])[:top]


def _where(frames: list[dict]) -> str:
    picked = [f for f in frames if any(k in f["filename"] for k in FRAME_KEYS)]
    ours = [f for f in picked if "poros_fx" in f["filename"] or "passes/" in f["filename"]
            or "transformers/" in f["filename"] or "peft/" in f["filename"]]
    chosen = (ours or picked or frames or [{"filename": "?", "line": 0, "name": "?"}])[:2]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seqs", type=lambda t: [int(x) for x in t.split(",")], default=[32768, 65536])
    parser.add_argument("--options", type=parse_options, default={"chunked_loss": True, "offload_boundaries": True})
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--snapshot", action="store_true")
    parser.add_argument("--mask", action="store_true", help="pass an all-ones attention_mask")
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--profile", action="store_true", help="the timed step of each length under torch.profiler: "
                        "the kernels with the most device time")
    parser.add_argument("--cap-gb", type=float, default=None, help="cap this process's device memory "
                        "(torch.cuda.set_per_process_memory_fraction)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cap_gb:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total))
    config = qwen25_config(args.size)
    config.num_hidden_layers = args.layers
    config.max_position_embeddings = max(args.seqs)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=args.dropout, target_modules=lora_targets("qwen2"))
    model = poros_fx.from_config(config, "nf4", device="cuda", seed=0, lora=lora, codegen=args.codegen,
                                 progress=False, **{k: v for k, v in args.options.items() if k != "codegen"})
    step_model = torch.compile(model, backend="poros")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    doc = {"command": "python " + " ".join(sys.argv), "env": environment(torch.device("cuda")),
           "size": args.size, "layers": args.layers, "options": args.options, "rows": []}

    def step(seq: int, seed: int) -> float:
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seed)).cuda()
        batch = {"input_ids": ids, "labels": ids}
        if args.mask:
            batch["attention_mask"] = torch.ones_like(ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step_model(**poros_fx.mark_dynamic(batch), use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for i, seq in enumerate(args.seqs):
        row = {"seq": seq}
        try:
            if i == 0:
                row["first_step_s"] = step(seq, 0)
            torch.cuda.reset_peak_memory_stats()
            if args.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=200000)
            if args.profile:
                row["step_s"] = step(seq, 1 + i)  # unprofiled, then the same length profiled
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    row["profiled_step_s"] = step(seq, 1 + i)
                row["kernels"] = top_kernels(prof)
            else:
                row["step_s"] = step(seq, 1 + i)
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            row["tokens_per_s"] = seq / row["step_s"]
            if args.snapshot:
                row["at_peak"] = peak_tensors(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as e:  # noqa: BLE001 (the probe records what failed and goes on)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-6000:]
            doc["rows"].append(row)
            break
        doc["rows"].append(row)
        (args.out / "probe.json").write_text(json.dumps(doc, indent=1, default=str))
        print(json.dumps({k: v for k, v in row.items() if k not in ("at_peak", "kernels")}), flush=True)
        for r in row.get("kernels", []):
            print(f"   {r['ms']:9.1f} ms {r['share']:6.1%} x{r['calls']:<5} {r['kernel']}", flush=True)
        for r in row.get("at_peak", []):
            print(f"   {r['gb']:7.2f} GB  x{r['count']:<4} {r['where']}", flush=True)
    (args.out / "probe.json").write_text(json.dumps(doc, indent=1, default=str))
    lines = [f"# Long-context probe: Qwen2.5-{args.size} shape, {args.layers} layers", "", f"`{doc['command']}`", "",
             "| seq | step s | peak GB | tokens/s | error |", "|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['seq']} | {r.get('step_s', float('nan')):.2f} | {r.get('peak_gb', float('nan')):.2f} | "
                     f"{r.get('tokens_per_s', float('nan')):.0f} | {r.get('error', '')[:120]} |")
    (args.out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
