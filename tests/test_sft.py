"""``PorosSFTTrainer`` (TRL's SFTTrainer, streamed) against a plain ``trl.SFTTrainer``, bit for bit.

Two independent model copies from the same seeds (tiny Qwen2, fp32, LoRA r4 on every projection,
dropout 0.1), a real byte-level tokenizer with a chat template built here; CPU, checkpointing off on
both, TRL's own loss (its fused LM head) on both. Per-step log entries are compared with ``==`` and
adapters with ``torch.equal``.
"""

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import peft  # noqa: E402

import poros_fx  # noqa: E402
from poros_fx import PorosSFTTrainer  # noqa: E402
from poros_fx.models.tiny import lora_model, lora_targets, tiny_config  # noqa: E402
from poros_fx.models.tiny_tokenizer import chat_records, tiny_tokenizer  # noqa: E402

VOCAB = 320


def model(dropout: float = 0.1):
    return lora_model(tiny_config("qwen2", layers=2, vocab=VOCAB), dropout=dropout, rank=4, seed=0)


def sft_args(tmp_path, name: str, **kw) -> "trl.SFTConfig":
    kw = {"max_steps": 3, "per_device_train_batch_size": 2, "max_length": 64, **kw}
    return trl.SFTConfig(output_dir=str(tmp_path / name), logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                         gradient_checkpointing=False, save_strategy="no", seed=0, **kw)


def logs(trainer) -> list[dict]:
    timing = ("runtime", "per_second")
    return [{k: v for k, v in entry.items() if not any(t in k for t in timing)} for entry in trainer.state.log_history]


def adapter(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}


def assert_same_run(plain, ours, m_plain, m_ours) -> None:
    assert logs(plain) == logs(ours)
    a, b = adapter(m_plain), adapter(m_ours)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert any(not torch.equal(a[n], v) for n, v in adapter(model()).items())  # it trained
    s = poros_fx.stats(m_ours)
    # the backbone streamed and recomputed every step; only the head's weight is loaded outside the graphs,
    # once for the forward and once for the backward
    assert s["recomputed_blocks"] >= 3 * 2 and s["eager_loads"] == 2 * s["backward_runs"] > 0


def test_messages_with_assistant_only_loss_equals_sft_trainer(tmp_path):
    ds = datasets.Dataset.from_list(chat_records(12))
    kw = {"assistant_only_loss": True, "gradient_accumulation_steps": 2}
    m_plain, m_ours = model(), model()
    plain = trl.SFTTrainer(model=m_plain, args=sft_args(tmp_path, "plain", **kw), train_dataset=ds,
                           eval_dataset=ds.select(range(4)), processing_class=tiny_tokenizer())
    plain.train()
    ours = PorosSFTTrainer(model=m_ours, args=sft_args(tmp_path, "ours", **kw), train_dataset=ds,
                           eval_dataset=ds.select(range(4)), processing_class=tiny_tokenizer(),
                           poros_options={"codegen": "eager"})
    ours.train()
    assert_same_run(plain, ours, m_plain, m_ours)
    # assistant-only: the prompt tokens carry no loss (TRL's mask reached the streamed step)
    batch = next(iter(ours.get_train_dataloader()))
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    assert plain.evaluate()["eval_loss"] == ours.evaluate()["eval_loss"]


def optimizer_state(trainer) -> list[torch.Tensor]:
    return [t.detach().clone() for state in trainer.optimizer.state_dict()["state"].values() for t in state.values()]


@pytest.mark.parametrize("precision", ["fp32", "sft_config_default"])
def test_padded_batches_equal_sft_trainer_per_step(tmp_path, precision):
    """Batches of two rows of different lengths (one padded), assistant-only loss, one micro-batch per step:
    the per-step log (loss, grad norm, metrics) equal, and the adapter and the AdamW state torch.equal. In
    fp32, and with SFTConfig's own default on the CPU (bf16=True: accelerate's bf16 autocast around the fp32
    model), under which each decoder layer's region must be traced with the caller's autocast."""
    ds = datasets.Dataset.from_list(chat_records(8))
    kw = {"assistant_only_loss": True, "max_steps": 2}
    if precision == "fp32":
        kw["bf16"] = False
    m_plain, m_ours = model(), model()
    runs = []
    for cls, m, name, extra in ((trl.SFTTrainer, m_plain, "plain", {}),
                                (PorosSFTTrainer, m_ours, "ours", {"poros_options": {"codegen": "eager"}})):
        args = trl.SFTConfig(output_dir=str(tmp_path / name), logging_steps=1, report_to=[], use_cpu=True,
                             gradient_checkpointing=False, save_strategy="no", seed=0, per_device_train_batch_size=2,
                             max_length=64, **kw)
        assert args.bf16 == (precision != "fp32")
        trainer = cls(model=m, args=args, train_dataset=ds, processing_class=tiny_tokenizer(), **extra)
        trainer.train()
        runs.append(trainer)
    plain, ours = runs
    batch = next(iter(ours.get_train_dataloader()))
    assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()  # padded, prompt not trained
    assert_same_run(plain, ours, m_plain, m_ours)
    a, b = optimizer_state(plain), optimizer_state(ours)
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_packing_equals_sft_trainer(tmp_path):
    # two steps: a packed batch's length and sequence count change every step, and each step compiles again
    ds = datasets.Dataset.from_list(chat_records(12))
    m_plain, m_ours = model(), model()
    plain = trl.SFTTrainer(model=m_plain, args=sft_args(tmp_path, "plain", packing=True, max_steps=2), train_dataset=ds,
                           processing_class=tiny_tokenizer())
    plain.train()
    ours = PorosSFTTrainer(model=m_ours, args=sft_args(tmp_path, "ours", packing=True, max_steps=2), train_dataset=ds,
                           processing_class=tiny_tokenizer(), poros_options={"codegen": "eager"})
    ours.train()
    assert "position_ids" in next(iter(ours.get_train_dataloader()))  # packed rows, told apart by position ids
    assert_same_run(plain, ours, m_plain, m_ours)


def test_peft_config_on_a_prepared_base_and_checkpointing_default(tmp_path):
    """SFTTrainer(peft_config=...) on a base prepared by from_config: the adapter is added, then trained
    streamed; TRL's default gradient_checkpointing=True is switched off rather than refused."""
    base = poros_fx.from_config(tiny_config("qwen2", layers=2, vocab=VOCAB), device="cpu", seed=0)
    args = trl.SFTConfig(output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=2, max_length=64,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no")
    assert args.gradient_checkpointing  # TRL's default
    trainer = PorosSFTTrainer(model=base, args=args, train_dataset=datasets.Dataset.from_list(chat_records(8)),
                              processing_class=tiny_tokenizer(),
                              peft_config=peft.LoraConfig(r=4, target_modules=lora_targets("qwen2")))
    trainer.train()
    assert not args.gradient_checkpointing and isinstance(trainer.model, peft.PeftModel)
    s = poros_fx.stats(trainer.model)
    assert s["backward_runs"] == 2 and s["recomputed_blocks"] >= 4


def test_plain_sft_trainer_on_a_prepared_model_is_refused(tmp_path):
    """A plain SFTTrainer would load the whole base eagerly every step: the first base load raises."""
    m = poros_fx.prepare(model(), device="cpu")
    trainer = trl.SFTTrainer(model=m, args=sft_args(tmp_path, "plain", max_steps=1),
                             train_dataset=datasets.Dataset.from_list(chat_records(4)), processing_class=tiny_tokenizer())
    with pytest.raises(poros_fx.PorosConfigError, match="PorosSFTTrainer"):
        trainer.train()


def test_chunked_loss_is_refused_before_training(tmp_path):
    """TRL's fused head already chunks the vocabulary; poros's chunked loss cannot apply, and says so."""
    with pytest.raises(poros_fx.PorosConfigError, match="chunked_loss"):
        PorosSFTTrainer(model=model(), args=sft_args(tmp_path, "chunked", max_steps=1),
                        train_dataset=datasets.Dataset.from_list(chat_records(4)), processing_class=tiny_tokenizer(),
                        poros_options={"chunked_loss": True})
