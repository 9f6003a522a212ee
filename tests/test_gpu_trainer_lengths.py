"""GPU (``pytest -m gpu``): ``PorosTrainer`` with a different sequence length per micro-batch on the
default CUDA path (Inductor regions, no deterministic algorithms), streamed against ``stream=False``,
each run in a process of its own with an Inductor cache of its own, so that each compiles, and times,
its own kernels: the per-step log and the adapter are equal bit for bit.

Qwen2, 4 layers, hidden 512, ``intermediate_size`` 1376, NF4, LoRA r8 dropout 0.1, batch 1, gradient
accumulation 2, lengths 160-384 grouped by length, ``max_grad_norm=1.0``. Without Inductor's
deterministic mode a region's reduction kernels chose their block sizes by timing them on the device,
each run its own way (``poros_fx/compiler/regions/compile.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _train(stream: bool, out: Path) -> None:
    import transformers

    from poros_fx.hf import PorosTrainer
    from poros_fx.models.tiny import lora_model, tiny_config

    config = tiny_config("qwen2", layers=4, hidden=512, heads=8, kv_heads=2, vocab=2048, intermediate=1376)
    model = lora_model(config, dtype=torch.bfloat16, nf4=True, dropout=0.1, rank=8, device="cuda")
    g = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(160, 385, (16,), generator=g).tolist(), reverse=True)  # length-grouped
    rows = [torch.randint(1, 2048, (n,), generator=g) for n in lengths]
    dataset = [{"input_ids": r, "labels": r.clone()} for r in rows]
    args = transformers.TrainingArguments(output_dir=str(out.parent / f"run-{stream}"), per_device_train_batch_size=1,
                                          gradient_accumulation_steps=2, max_steps=8, max_grad_norm=1.0,
                                          logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0,
                                          learning_rate=1e-3, bf16=True)
    trainer = PorosTrainer(model=model, args=args, train_dataset=dataset,
                           data_collator=lambda items: {k: torch.stack([i[k] for i in items]) for k in items[0]},
                           poros_options={"stream": stream})
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.save({"losses": losses, "adapter": {n: p.detach().cpu() for n, p in model.named_parameters()
                                              if p.requires_grad}}, out)


def _run_in_own_process(stream: bool, tmp_path: Path) -> dict:
    out = tmp_path / f"stream-{stream}.pt"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{stream}")}
    subprocess.run([sys.executable, __file__, str(stream), str(out)], env=env, check=True, timeout=1200)
    return torch.load(out)


def test_gpu_trainer_lengths_per_micro_batch_on_the_default_path(tmp_path):
    streamed = _run_in_own_process(True, tmp_path)
    resident = _run_in_own_process(False, tmp_path)
    assert streamed["losses"] == resident["losses"]
    a, b = streamed["adapter"], resident["adapter"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


if __name__ == "__main__":
    _train(sys.argv[1] == "True", Path(sys.argv[2]))
