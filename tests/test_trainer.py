"""PorosTrainer == transformers.Trainer, to the bit: per-step log, adapter weights, optimizer state,
checkpoints and resume.

Two independent model copies from the same seeds (never one run compared with itself): a plain eager
Trainer and a PorosTrainer (streamed, block_size 1, prefetch 1), fp32 tiny Qwen2, LoRA dropout 0.1,
AdamW with the Trainer's linear schedule, clipping at 0.5 (below every step's norm, so it scales), gradient accumulation 2 and the Trainer's
``num_items_in_batch`` loss scaling.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.hf import PorosTrainer
from poros_fx.prepare import get_store
from poros_fx.models.tiny import demo_batches, tiny_config, tiny_lora_model

STEPS = 6
SAVE_EVERY = 3
LAYERS = 2
LOG_KEYS = ("loss", "grad_norm", "learning_rate", "epoch")


class Rows(torch.utils.data.Dataset):
    """Rows of input_ids / labels, plus a column the model does not take (the Trainer must drop it)."""

    def __init__(self, count: int) -> None:
        batches = demo_batches(count, vocab=256, seq=24, batch=1, seed=7)
        self.rows = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0], "row_id": i}
                     for i, b in enumerate(batches)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class Snapshot(transformers.TrainerCallback):
    """The adapter weights after optimizer step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.weights: dict[str, torch.Tensor] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            self.weights = adapter(model)


def adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def training_args(out: pathlib.Path, save: bool) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1, seed=1, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="steps" if save else "no", save_steps=SAVE_EVERY)


def train(cls: type[transformers.Trainer], out: pathlib.Path, *, save: bool = False, resume: str | None = None,
          **kwargs: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", dtype=torch.float32, dropout=0.1, layers=LAYERS)
    snap = Snapshot(SAVE_EVERY)
    trainer = cls(model=model, args=training_args(out, save), train_dataset=Rows(4 * STEPS),
                  eval_dataset=Rows(4), callbacks=[snap], **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "eval_loss": trainer.evaluate()["eval_loss"],  # prediction_step -> compute_loss, under no_grad
        "log": [{k: h[k] for k in LOG_KEYS} for h in trainer.state.log_history if "loss" in h],
        "weights": adapter(model),
        "optimizer": [t.detach().clone() for state in trainer.optimizer.state_dict()["state"].values()
                      for t in state.values()],
        "at_save": snap.weights,
        "model": model,
    }


def assert_same_tensors(a: dict[str, torch.Tensor] | list[torch.Tensor], b: dict[str, torch.Tensor] | list[torch.Tensor]):
    assert len(a) == len(b) > 0
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
    bad = [i for i, (x, y) in enumerate(pairs) if not torch.equal(x, y)]
    assert not bad, f"{len(bad)} tensors differ, first at index {bad[0]}"


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train(transformers.Trainer, tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="module")
def poros(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("poros")
    run = train(PorosTrainer, out, save=True, poros_options={"device": "cpu", "block_size": 1, "prefetch": 1})
    run["out"] = out
    return run


def test_log_weights_and_optimizer_equal_eager_trainer(eager, poros):
    assert len(poros["log"]) == len(eager["log"]) == STEPS
    for step, (p, e) in enumerate(zip(poros["log"], eager["log"]), start=1):
        assert p == e, f"optimizer step {step}: PorosTrainer {p} != Trainer {e}"  # floats compared with ==
    assert_same_tensors(poros["weights"], eager["weights"])
    assert_same_tensors(poros["optimizer"], eager["optimizer"])
    assert poros["eval_loss"] == eager["eval_loss"]
    assert all(h["grad_norm"] > 0.5 for h in eager["log"])  # clipping scaled every step
    # not vacuous: the adapter trained, and the base really streamed (each block recomputed in the backward)
    initial = adapter(tiny_lora_model("qwen2", dtype=torch.float32, dropout=0.1, layers=LAYERS))
    assert all(not torch.equal(initial[n], w) for n, w in poros["weights"].items())
    stats = poros_fx.stats(poros["model"])
    assert stats["backward_runs"] == 2 * STEPS
    assert stats["recomputed_blocks"] == stats["backward_runs"] * (len(stats["block_bytes"]) - 1)


def test_checkpoint_adapter_loads_on_an_ordinary_model(poros):
    import peft

    ckpt = poros["out"] / f"checkpoint-{SAVE_EVERY}"
    assert (ckpt / "adapter_model.safetensors").is_file()
    torch.manual_seed(0)  # tiny_lora_model's base seed: the same random-init base, never prepared
    base = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=LAYERS), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(ckpt))
    assert get_store(loaded) is None
    assert_same_tensors(adapter(loaded), poros["at_save"])


def test_resume_from_checkpoint_continues_like_uninterrupted(poros, tmp_path):
    ckpt = poros["out"] / f"checkpoint-{SAVE_EVERY}"
    resumed = train(PorosTrainer, tmp_path, resume=str(ckpt), poros_options={"device": "cpu"})
    assert len(resumed["log"]) == STEPS  # steps 1..3 come from the checkpoint's trainer_state.json
    for step, (r, p) in enumerate(zip(resumed["log"], poros["log"]), start=1):
        assert r == p, f"optimizer step {step}: resumed {r} != uninterrupted {p}"
    assert_same_tensors(resumed["weights"], poros["weights"])
    assert_same_tensors(resumed["optimizer"], poros["optimizer"])


def test_bad_settings_raise(tmp_path):
    model = tiny_lora_model("qwen2", layers=1)
    with pytest.raises(PorosConfigError, match="unknown poros option"):
        PorosTrainer(model=model, args=training_args(tmp_path, False), poros_options={"blocksize": 2})
    args = training_args(tmp_path, False)
    args.gradient_checkpointing = True
    with pytest.raises(PorosConfigError, match="gradient_checkpointing"):
        PorosTrainer(model=model, args=args)
    assert get_store(model) is None  # refused before anything was prepared
