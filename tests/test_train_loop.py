"""The one training loop (``training/loop.py``) through its two surfaces: ``FineTuner`` (the seed's five
lines) and ``poros-fx train``; and its controls against the same loop written by hand.

Every comparison is ``torch.equal`` / ``==`` between independent runs (each loads the checkpoint anew).
"""

import json
import re

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from train_helper import FAST, checkpoint, run_cli  # noqa: F401 (checkpoint is a fixture)

import poros_fx
from poros_fx.io.data import batches, load_dataset
from poros_fx.training.evaluation import evaluate
from poros_fx.models.tiny import lora_targets
from poros_fx.models.tiny_tokenizer import chat_records

VOCAB = 320


def adapter_file(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def assert_same_adapter(a, b) -> None:
    ta, tb = adapter_file(a), adapter_file(b)
    assert ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records(12)), encoding="utf-8")
    return path


def test_five_lines_equal_the_cli_and_save_what_config_repeats(checkpoint, chat_file, tmp_path, capsys):
    """FineTuner.from_pretrained -> train -> save; the command with the same settings trains the same bits,
    and `train --config SAVED/run.toml` repeats the run."""
    tuner = poros_fx.FineTuner.from_pretrained(str(checkpoint), quantization="bf16", lora_rank=4, lora_alpha=8,
                                               device="cpu")
    result = tuner.train(str(chat_file), steps=2, seq_len=24, batch_size=2, log_every=1)
    saved = tuner.save(tmp_path / "five")
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "run.toml"):
        assert (saved / name).is_file(), name
    assert transformers.AutoTokenizer.from_pretrained(saved).chat_template  # the tokenizer, with its template

    code, out, err = run_cli(capsys, "train", str(checkpoint), "--data", str(chat_file), "--out", str(tmp_path / "cli"),
                             "--steps", "2", *FAST)
    assert code == 0, err
    assert "examples (messages)" in out and "tok/s" in out
    assert_same_adapter(saved, tmp_path / "cli")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert losses == result.losses

    code, _, err = run_cli(capsys, "train", "--config", str(saved / "run.toml"), "--out", str(tmp_path / "again"))
    assert code == 0, err
    assert_same_adapter(saved, tmp_path / "again")
    # a standard PEFT adapter for the ordinary, never-prepared model
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    loaded = dict(peft.PeftModel.from_pretrained(base, saved).named_parameters())
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")].detach(), v)
               for k, v in adapter_file(saved).items())


def test_schedule_clipping_and_eval_equal_the_loop_written_by_hand(checkpoint, chat_file, tmp_path):
    """warmup + cosine, gradient clipping below every step's norm, an evaluation every 2 steps, LoRA dropout:
    the loop's losses, learning rates, gradient norms, eval losses and adapter == a hand-written loop's."""
    steps, lr, clip = 4, 1e-3, 0.05
    tuner = poros_fx.FineTuner.from_pretrained(str(checkpoint), quantization="bf16", lora_rank=4, lora_alpha=8,
                                               lora_dropout=0.1, device="cpu", seed=3)
    out = tmp_path / "run"
    result = tuner.train(str(chat_file), steps=steps, seq_len=24, batch_size=2, lr=lr, warmup_steps=1,
                         schedule="cosine", max_grad_norm=clip, eval_data=str(chat_file), eval_every=2, out=out)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if "loss" in line]

    # by hand: the same model, data order, schedule (transformers'), clipping and evaluation
    torch.manual_seed(3)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=lora_targets("qwen2"))
    model = poros_fx.load_pretrained(checkpoint, quantization="bf16", device="cpu", lora=lora)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    data = load_dataset(chat_file, seq_len=24, vocab_size=VOCAB, tokenizer=tok)
    model.train()
    step_model = torch.compile(model, backend="poros")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)  # poros-fx train --weight-decay defaults to 0
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=steps)
    losses, rates, norms, evals = [], [], [], {}
    for step, batch in enumerate(batches(data, 2, steps, seed=3), 1):  # the data order follows the seed too
        loss = step_model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, clip).item())
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 2 == 0:
            model.eval()
            evals[step] = evaluate(step_model, data, 2, "cpu").loss
            model.train()

    assert result.losses == losses and [line["loss"] for line in logged] == losses
    assert [line["learning_rate"] for line in logged] == rates and len(set(rates)) == steps  # warmup, then decay
    assert [line["grad_norm"] for line in logged] == norms and min(norms) > clip  # every step clipped
    assert result.eval_losses == evals and sorted(evals) == [2, 4]
    assert [line["eval_loss"] for line in lines if "eval_loss" in line] == [evals[2], evals[4]]
    ours = dict(tuner.model.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(ours[name], p), name


def test_out_refused_unless_overwrite_or_resume(checkpoint, chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ("train", str(checkpoint), "--data", str(chat_file), "--out", str(out), "--steps", "1", *FAST)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "exists and holds files; pass --overwrite" in err and f"--resume {out}" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    first = adapter_file(out)
    code, _, err = run_cli(capsys, *args)  # a finished run there now
    assert code == 2 and "holds a poros-fx run (adapter and resume state)" in err
    code, _, err = run_cli(capsys, *args, "--overwrite", "--seed", "1")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files are replaced
    assert not all(torch.equal(first[k], v) for k, v in adapter_file(out).items())


def test_resume_follows_a_moved_model_and_data(checkpoint, chat_file, tmp_path, capsys):
    """A run stopped after 2 of 4 steps, its model folder and data file moved, resumed with --model and
    --data given again: the same adapter and losses as the uninterrupted run. Another model is refused."""
    import shutil

    model = shutil.copytree(checkpoint, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    shutil.copy(chat_file, data)
    common = ("--lora-dropout", "0.1", *FAST)
    code, _, err = run_cli(capsys, "train", str(checkpoint), "--data", str(chat_file), "--out", str(tmp_path / "whole"),
                           "--steps", "4", *common)
    assert code == 0, err
    code, _, err = run_cli(capsys, "train", str(model), "--data", str(data), "--out", str(tmp_path / "part"), "--steps",
                           "2", *common)
    assert code == 0, err
    moved_model, moved_data = model.rename(tmp_path / "model-moved"), data.rename(tmp_path / "chat-moved.jsonl")

    code, _, err = run_cli(capsys, "train", "--resume", str(tmp_path / "part"), "--steps", "4")
    assert code == 2 and "model folder" in err and "is gone" in err and "--model NEW_PATH" in err
    other = tmp_path / "other"
    shutil.copytree(moved_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    code, _, err = run_cli(capsys, "train", "--resume", str(tmp_path / "part"), "--steps", "4", "--model", str(other),
                           "--data", str(moved_data))
    assert code == 2 and "is not the checkpoint the run trained on" in err
    code, out, err = run_cli(capsys, "train", "--resume", str(tmp_path / "part"), "--steps", "4", "--model",
                             str(moved_model), "--data", str(moved_data))
    assert code == 0, err
    assert "resuming after step 2" in out
    assert_same_adapter(tmp_path / "part", tmp_path / "whole")
    code, _, err = run_cli(capsys, "train", "--resume", str(tmp_path / "part"), "--steps", "5", "--lr", "1e-3")
    assert code == 2 and "--lr 0.001 (the run has 0.0002)" in err and "--model" in err and "--data" in err


def test_save_activations_from_the_command_line_trains_the_same_bits(checkpoint, chat_file, tmp_path, capsys):
    """`train --save-activations 1` (the last layer block keeps its activations, not recomputed) writes the
    adapter a run without it writes, with dropout and block-major accumulation; run.toml keeps the option."""
    common = ("train", str(checkpoint), "--data", str(chat_file), "--steps", "2", "--accumulate", "2",
              "--lora-dropout", "0.1", *FAST)
    recomputed = []
    for name, extra in (("recomputed", ()), ("saved", ("--save-activations", "1"))):
        code, out, err = run_cli(capsys, *common, "--out", str(tmp_path / name), *extra)
        assert code == 0, err
        recomputed.append(int(re.search(r"(\d+) recomputed blocks", out).group(1)))
    assert_same_adapter(tmp_path / "recomputed", tmp_path / "saved")
    # 2 steps x 2 micro-batches: the layer block saved is reloaded for each backward, not rerun
    assert recomputed[0] - recomputed[1] == 2 * 2
    assert "save_activations = 1" in (tmp_path / "saved" / "run.toml").read_text()
