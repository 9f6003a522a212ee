"""TRL's SFTTrainer on one GPU: ``PorosSFTTrainer`` (streamed) next to a plain ``SFTTrainer`` with PEFT and
bitsandbytes (gradient checkpointing on, TRL's default), in one process.

    python benchmarks/scripts/sft_bench.py OUT_DIR [--model 7b] [--steps 20] [--seq 512] [--methods poros,plain]

Qwen2.5 shapes with random weights (``poros_fx.models.tiny.qwen25_config``; no hub), NF4 base, LoRA r16 alpha 32
on all seven projections, batch 1, sequences of ``--seq`` tokens (random ids, so every row is full length),
AdamW lr 1e-4, TRL's own loss (its fused LM head). The tokenizer is the small one built locally
(``poros_fx/models/tiny_tokenizer.py``): the data is pre-tokenized, TRL only needs its pad token.

Per method: median s/step over the steps after the first two (the first compiles), the first step's
seconds, ``torch.cuda.max_memory_allocated`` over the run, and the losses; for poros also its ledger
(peak resident base bytes, loads, eager loads of the head). Writes ``OUT_DIR/sft_bench.json`` and
``OUT_DIR/sft_bench.md``. Needs CUDA, trl (1.15+) and bitsandbytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import poros_fx  # noqa: E402  (first: it filters bitsandbytes' CPU-kernel log line before bitsandbytes loads)
import datasets  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

from poros_fx import PorosSFTTrainer  # noqa: E402
from poros_fx.io.quantize import quantize_nf4  # noqa: E402
from poros_fx.units import format_bytes  # noqa: E402
from poros_fx.models.tiny import lora_targets, qwen25_config  # noqa: E402
from poros_fx.models.tiny_tokenizer import tiny_tokenizer  # noqa: E402

WARMUP = 2  # steps left out of the median: the first compiles (poros), both warm their allocators


class StepTimes(transformers.TrainerCallback):
    """Wall seconds of every optimizer step, the device synchronized at both ends."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=lora_targets("qwen2"))


def sft_config(out: str, steps: int, seq: int, checkpointing: bool) -> trl.SFTConfig:
    return trl.SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-4,
                         logging_steps=1, report_to=[], save_strategy="no", bf16=True, max_length=seq, packing=False,
                         gradient_checkpointing=checkpointing, seed=0, dataloader_num_workers=0)


def dataset(vocab: int, seq: int, rows: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list([{"input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist()}
                                       for _ in range(rows)])


def run_poros(size: str, steps: int, seq: int) -> dict:
    config = qwen25_config(size)
    base = poros_fx.from_config(config, quantization="nf4", device="cuda", seed=0)  # prepared, base on the host
    with tempfile.TemporaryDirectory() as out:
        times = StepTimes()
        trainer = PorosSFTTrainer(model=base, args=sft_config(out, steps, seq, checkpointing=False),
                                  train_dataset=dataset(config.vocab_size, seq, steps), processing_class=tiny_tokenizer(),
                                  peft_config=lora(), callbacks=[times])
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
    s = poros_fx.stats(trainer.model)
    row = summary("poros (PorosSFTTrainer, streamed)", trainer, times)
    row.update(peak_resident_base_bytes=s["peak_resident_base_bytes"], host_bytes=s["host_bytes"], loads=s["loads"],
               eager_loads=s["eager_loads"], bytes_loaded=s["bytes_loaded"])
    return row


def run_plain(size: str, steps: int, seq: int) -> dict:
    config = qwen25_config(size)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantize_nf4(model, compute_dtype=torch.bfloat16, device="cuda")  # bitsandbytes Linear4bit, as QLoRA loads it
    model.config.use_cache = False
    with tempfile.TemporaryDirectory() as out:
        times = StepTimes()
        trainer = trl.SFTTrainer(model=model, args=sft_config(out, steps, seq, checkpointing=True),
                                 train_dataset=dataset(config.vocab_size, seq, steps), processing_class=tiny_tokenizer(),
                                 peft_config=lora(), callbacks=[times])
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
    return summary("plain SFTTrainer + PEFT + bitsandbytes, gradient checkpointing", trainer, times)


def summary(name: str, trainer, times: StepTimes) -> dict:
    timed = times.seconds[WARMUP:] or times.seconds
    return {"method": name, "steps": len(times.seconds), "s_per_step_median": statistics.median(timed),
            "first_step_s": times.seconds[0] if times.seconds else None,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "step_seconds": times.seconds}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def markdown(result: dict) -> str:
    lines = [f"# TRL SFTTrainer, Qwen2.5-{result['model']} shape (random init), NF4, LoRA r16 x7, seq {result['seq']}, "
             f"batch 1, {result['steps']} steps", "",
             f"{result['gpu']}; torch {result['torch']}, transformers {result['transformers']}, trl {result['trl']}, "
             f"peft {result['peft']}", "",
             "| method | s/step (median, steps 3+) | first step s | peak allocated | final loss |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['method']} | failed: {row['error']} | | | |")
            continue
        loss = row["losses"][-1] if row["losses"] else float("nan")
        lines.append(f"| {row['method']} | {row['s_per_step_median']:.3f} | {row['first_step_s']:.1f} | "
                     f"{format_bytes(row['peak_allocated_bytes'])} | {loss:.4f} |")
    poros = next((r for r in result["rows"] if r["method"].startswith("poros") and "error" not in r), None)
    if poros is not None:
        lines += ["", f"poros ledger: peak resident base {format_bytes(poros['peak_resident_base_bytes'])} of "
                      f"{format_bytes(poros['host_bytes'])} in the host store; {poros['loads']} loads "
                      f"({format_bytes(poros['bytes_loaded'])}), of which {poros['eager_loads']} eager (TRL's head "
                      f"weight, forward and backward)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for sft_bench.json and sft_bench.md")
    parser.add_argument("--model", default="7b", help="Qwen2.5 shape: 0.5b, 7b, 32b, 72b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--methods", default="poros,plain", help="comma-separated: poros, plain")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: sft_bench needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "seq": args.seq, "steps": args.steps, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
              "peft": peft.__version__, "python": platform.python_version(), "rows": []}
    runners = {"poros": run_poros, "plain": run_plain}
    for method in args.methods.split(","):
        try:
            row = runners[method](args.model, args.steps, args.seq)
        except Exception as e:  # one method failing (an OOM) still leaves the other's row
            row = {"method": method, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "step_seconds")}), flush=True)
        free()
    (args.out / "sft_bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "sft_bench.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
