"""``PorosTrainer``: the Hugging Face Trainer with the model streamed by the poros backend.

    python examples/trainer.py                   # CPU, a tiny built-in model, 4 steps

Everything but the forward is the Trainer's own code: loss, accumulation, clipping, logging, checkpoints.
"""

import tempfile

import torch
import transformers

from poros_fx.hf import PorosTrainer
from poros_fx.models.tiny import demo_batches, tiny_lora_model


def main() -> None:
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1)
    data = [{k: v[0] for k, v in b.items()} for b in demo_batches(16, seq=32, batch=1)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1,
                                              report_to=[], use_cpu=not torch.cuda.is_available(), save_strategy="no")
        trainer = PorosTrainer(model=model, args=args, train_dataset=data,
                               poros_options={"block_size": 1, "prefetch": 1})
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.4f}  grad_norm {entry['grad_norm']:.4f}")


if __name__ == "__main__":
    main()
