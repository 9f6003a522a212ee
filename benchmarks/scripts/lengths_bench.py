"""Steps of many sequence lengths at a real shape: what a new length costs after the first step.

One process, one random-init model (Qwen2.5 shape, NF4, LoRA r16 on the seven projections): a fixed
length trained for a few steps (the reference step time), then one step at each of several other
lengths, timed one by one (``torch.cuda.synchronize`` around each). Run once with the batches marked
dynamic (``poros_fx.mark_dynamic``, what ``@poros_fx.step``, ``PorosTrainer`` and ``poros-fx train`` do)
and once as a plain ``torch.compile`` call, where Dynamo compiles the second length once more with
symbolic sizes. Writes ``lengths.json`` and ``lengths.md`` to the folder given.

    python benchmarks/scripts/lengths_bench.py OUT [--size 7b] [--codegen inductor] [--fixed 512]
        [--lengths 384,640,256,1024,448,768,320,576]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import peft
import torch

import poros_fx
from poros_fx.prepare import get_store
from poros_fx.bench import environment
from poros_fx.models.tiny import lora_targets
from poros_fx.models.tiny import qwen25_config


class GcClock:
    """Seconds Python's garbage collector ran (gc.callbacks), to tell a collection from a compile."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


GC = GcClock()


def timed_step(step_model, model, optimizer, batch, mark: bool) -> tuple[float, float]:
    """Seconds of one step, and of those the garbage collector's."""
    collected = GC.seconds
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = step_model(**(poros_fx.mark_dynamic(batch) if mark else batch), use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start, GC.seconds - collected


def batch_of(length: int, vocab: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).cuda()
    return {"input_ids": ids, "labels": ids.clone()}


def run(args: argparse.Namespace, mark: bool) -> dict:
    torch._dynamo.reset()
    config = qwen25_config(args.size)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=lora_targets("qwen2"))
    model = poros_fx.from_config(config, "nf4", device="cuda", seed=0, lora=lora, codegen=args.codegen, progress=False)
    step_model = torch.compile(model, backend="poros")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = config.vocab_size
    rows = []
    steps = [(args.fixed, 0)] + [(args.fixed, i) for i in range(1, 6)] + [
        (length, i) for i, length in enumerate(args.lengths, start=6)]
    for length, i in steps:
        seconds, collected = timed_step(step_model, model, optimizer, batch_of(length, vocab, i), mark)
        rows.append({"step": i, "seq": length, "seconds": seconds, "gc_seconds": collected,
                     "schedules": len(get_store(model).schedules)})
    first = rows[0]["seconds"]
    reference = statistics.median(r["seconds"] for r in rows[1:6])
    again = [timed_step(step_model, model, optimizer, batch_of(length, vocab, 100 + i), mark)[0]
             for i, length in enumerate(args.lengths)]
    store = get_store(model)
    result = {"mark_dynamic": mark, "first_step_s": first, "fixed_step_s": reference,
              "same_lengths_again_s": dict(zip(map(str, args.lengths), again)),
              "max_extra_s_of_a_new_length": max(r["seconds"] for r in rows if r["seq"] != args.fixed) - reference,
              "graphs": len(store.schedules), "regions": len(store.regions.regions),
              "regions_dynamic": [r.signature.dynamic for r in store.regions.regions],
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "rows": rows}
    poros_fx.unprepare(model)
    del model, step_model, optimizer, store
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


def markdown(doc: dict) -> str:
    lines = [f"# New sequence lengths at the Qwen2.5-{doc['size']} shape ({doc['codegen']} codegen, NF4, LoRA r16 x7, "
             "batch 1)", "", f"Command: `{doc['command']}`", "",
             f"Device: {doc['env'].get('gpu', '?')}, torch {doc['env'].get('torch', '?')}", ""]
    for result in doc["runs"]:
        how = "batches marked dynamic (the surfaces)" if result["mark_dynamic"] else "plain torch.compile"
        lines += [f"## {how}", "",
                  f"first step {result['first_step_s']:.1f} s; fixed-length step (median of 5) "
                  f"{result['fixed_step_s']:.3f} s; largest extra cost of a new length "
                  f"{result['max_extra_s_of_a_new_length']:.3f} s; graphs compiled {result['graphs']}, regions "
                  f"{result['regions']}", "", "| step | seq | s | of which Python GC, s | graphs so far |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['seq']} | {r['seconds']:.3f} | {r['gc_seconds']:.3f} | {r['schedules']} |"
                  for r in result["rows"]]
        lines += ["", "same lengths again: " + ", ".join(f"{k}: {v:.3f} s" for k, v in
                                                          result["same_lengths_again_s"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="7b")
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--fixed", type=int, default=512)
    parser.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")],
                        default=[384, 640, 256, 1024, 448, 768, 320, 576])
    parser.add_argument("--plain", action="store_true", help="also run a plain torch.compile (no mark_dynamic)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"size": args.size, "codegen": args.codegen, "command": "python " + " ".join(sys.argv),
           "env": environment(torch.device("cuda")), "runs": []}
    for mark in (True, False) if args.plain else (True,):
        doc["runs"].append(run(args, mark))
        (args.out / "lengths.json").write_text(json.dumps(doc, indent=1, default=str))
        (args.out / "lengths.md").write_text(markdown(doc))
        print(markdown(doc), flush=True)


if __name__ == "__main__":
    main()
