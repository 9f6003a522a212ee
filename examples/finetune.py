"""The five-line path: ``FineTuner.from_pretrained(...)`` -> ``.train(...)`` -> ``.save(...)``.

    python examples/finetune.py                       # CPU: a tiny checkpoint built here, 4 steps
    python examples/finetune.py --model Qwen/Qwen2.5-7B --data chat.jsonl --steps 200   # yours (cached id or folder)

The same loop as ``poros-fx train`` (``poros_fx/training/loop.py``); ``save`` writes the PEFT adapter, the
tokenizer and ``run.toml`` (``poros-fx train --config DIR/run.toml`` repeats the run).
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers

from poros_fx import FineTuner
from poros_fx.models.tiny import tiny_config
from poros_fx.models.tiny_tokenizer import chat_records, tiny_tokenizer


def tiny_checkpoint(folder: Path) -> tuple[str, str]:
    """A 2-layer Qwen2 checkpoint with a chat tokenizer, and a small chat data file, in ``folder``."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, vocab=320)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(16)), encoding="utf-8")
    return str(folder), str(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or cached hub id (default: a tiny one built here)")
    parser.add_argument("--data", default="synthetic", help="data file, dataset folder, cached dataset id, or synthetic")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="finetune-adapter")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, data = (args.model, args.data) if args.model else tiny_checkpoint(Path(tmp))
        quantization = "nf4" if torch.cuda.is_available() else "bf16"

        tuner = FineTuner.from_pretrained(model, quantization=quantization, lora_rank=16, lora_alpha=32)
        result = tuner.train(data, steps=args.steps, seq_len=args.seq_len, warmup_steps=1, schedule="cosine")
        tuner.save(args.out)
    print(f"losses {[round(loss, 4) for loss in result.losses]}; adapter, tokenizer and run.toml in {args.out}/")


if __name__ == "__main__":
    main()
