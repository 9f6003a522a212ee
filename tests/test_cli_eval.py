"""``poros-fx eval``: streamed loss and perplexity under torch.no_grad(), equal to an unprepared evaluation."""

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from cli_helper import cli
from train_helper import run_cli

import poros_fx
from poros_fx.io.data import IGNORE_INDEX, eval_batches, load_dataset
from poros_fx.training.evaluation import evaluate
from poros_fx.models.tiny import TARGETS, tiny_config, tiny_lora_model

VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "qwen2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, vocab=VOCAB)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory) -> Path:
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS),
                                                      init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    out = tmp_path_factory.mktemp("adapter") / "lora"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(7)
    path = tmp_path_factory.mktemp("data") / "valid.jsonl"
    rows = [{"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(8, 40, (12,), generator=g)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_eval_batches_cover_every_row_once():
    ds = load_dataset("demo", seq_len=24, vocab_size=VOCAB)
    got = list(eval_batches(ds, 10))
    assert len(got) == -(-ds.rows // 10) and all(b["input_ids"].shape == (10, 24) for b, _ in got)
    assert torch.equal(torch.cat([b["input_ids"] for b, _ in got])[:ds.rows], ds.input_ids)
    last, _ = got[-1]
    assert (last["labels"][ds.rows % 10:] == IGNORE_INDEX).all()  # filler rows: nothing to score
    assert sum(n for _, n in got) == ds.supervised_tokens


def test_streamed_evaluate_equals_unprepared_fp32():
    """The same model and adapter, streamed through poros under no_grad and run as an ordinary eager
    PEFT model: every batch's loss and the mean are equal (CPU, fp32)."""
    ds = load_dataset("demo", seq_len=24, vocab_size=VOCAB)
    streamed = poros_fx.prepare(tiny_lora_model("qwen2", layers=2, seed=3), device="cpu").eval()
    plain = tiny_lora_model("qwen2", layers=2, seed=3).eval()
    got = evaluate(torch.compile(streamed, backend="poros"), ds, 10, "cpu")
    want = evaluate(plain, ds, 10, "cpu")
    assert got.batch_losses == want.batch_losses and got.loss == want.loss
    assert got.tokens == ds.supervised_tokens and got.batches == 11
    assert got.perplexity == pytest.approx(torch.tensor(got.loss, dtype=torch.float64).exp().item())
    assert poros_fx.stats(streamed)["loads"] > 0  # it was streamed


def reference_loss(checkpoint: Path, adapter_dir, data: Path, seq_len: int, batch_size: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    ds = load_dataset(data, seq_len=seq_len, vocab_size=VOCAB)
    return evaluate(model.eval(), ds, batch_size, "cpu").loss


def run_eval(tmp_path, *args, capsys=None) -> tuple[dict, str]:
    """``poros-fx eval ARGS``: through the installed script, or with ``capsys`` in this process (a subprocess
    costs ~8 s of imports; one test keeps the script)."""
    out = tmp_path / "eval.json"
    args = ("eval", *args, "--seq-len", "16", "--batch-size", "3", "--quantization", "bf16", "--device", "cpu",
            "--json", str(out))
    if capsys is None:
        stdout = cli(*args).stdout
    else:
        code, stdout, err = run_cli(capsys, *args)
        assert code == 0, err
    return json.loads(out.read_text()), stdout


def test_eval_cli_with_adapter_equals_unprepared(checkpoint, adapter, data_file, tmp_path):
    result, stdout = run_eval(tmp_path, str(checkpoint), "--adapter", str(adapter), "--data", str(data_file))
    assert "perplexity" in stdout and "(first batch compiles)" in stdout and f"+ adapter {adapter}" in stdout
    assert result["loss"] == reference_loss(checkpoint, adapter, data_file, 16, 3)
    assert result["tokens"] > 0 and result["adapter"] == str(adapter) and result["weights"] == "checkpoint"
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"], dtype=torch.float64).exp().item())


def test_eval_cli_base_alone(checkpoint, data_file, tmp_path, capsys):
    result, stdout = run_eval(tmp_path, str(checkpoint), "--data", str(data_file), capsys=capsys)
    assert "(no adapter)" in stdout
    assert result["loss"] == reference_loss(checkpoint, None, data_file, 16, 3)


def test_eval_cli_random_weights_from_a_config(adapter, tmp_path, capsys):
    tiny_config("qwen2", layers=2, vocab=VOCAB).save_pretrained(tmp_path / "cfg")
    result, stdout = run_eval(tmp_path, str(tmp_path / "cfg" / "config.json"), "--adapter", str(adapter), "--data",
                              "demo", "--seed", "4", capsys=capsys)
    assert "random-init weights (seed 4)" in " ".join(stdout.split()) and result["weights"] == "random-init (seed 4)"
    assert result["tokens"] == load_dataset("demo", seq_len=16, vocab_size=VOCAB).supervised_tokens


def test_eval_cli_errors(checkpoint, adapter, data_file, tmp_path, capsys):
    # refused before anything runs: in this process (a poros-fx subprocess costs ~8 s of imports each)
    code, _, err = run_cli(capsys, "eval", str(checkpoint), "--adapter", str(tmp_path), "--data", str(data_file),
                           "--seq-len", "16")
    assert code == 2 and "has no adapter_config.json" in err and "Traceback" not in err
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "eval", str(checkpoint), "--data", str(data_file), "--device", "cuda",
                               "--seq-len", "16")
        assert code == 2 and "torch sees no CUDA device" in err and "Traceback" not in err
