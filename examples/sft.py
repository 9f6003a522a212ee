"""TRL's ``SFTTrainer`` on chat data, the model streamed by poros: ``poros_fx.PorosSFTTrainer``.

    pip install poros-fx[trl]
    python examples/sft.py                   # CPU: a tiny model and tokenizer built here, 4 steps

Everything but the forward's backbone is TRL's: the chat template, assistant-only loss, packing, its loss
and metrics, logging and checkpoints (docs/trainer.md).
"""

import tempfile

import datasets
import peft
import torch
import trl

from poros_fx import PorosSFTTrainer
from poros_fx.models.tiny import lora_targets, tiny_config
from poros_fx.io.loader import from_config
from poros_fx.models.tiny_tokenizer import chat_records, tiny_tokenizer


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = from_config(tiny_config("qwen2", layers=2, vocab=320), quantization="bf16", device=device, seed=0)
    with tempfile.TemporaryDirectory() as out:
        args = trl.SFTConfig(output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=device == "cpu", bf16=False, save_strategy="no",
                             assistant_only_loss=True, max_length=64)
        trainer = PorosSFTTrainer(model=base, args=args, train_dataset=datasets.Dataset.from_list(chat_records(16)),
                                  processing_class=tiny_tokenizer(),
                                  peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=lora_targets("qwen2")))
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.4f}  token accuracy {entry['mean_token_accuracy']:.3f}")


if __name__ == "__main__":
    main()
