"""``poros-fx train`` and ``poros-fx export`` through the installed script, on tiny offline models.

The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a few strings, saved
next to a tiny random checkpoint: nothing is downloaded.
"""

import json
from pathlib import Path

import pytest
from cli_helper import cli
import torch
import transformers
from safetensors import safe_open
from train_helper import run_cli, run_cli_redirected

from poros_fx.io.data import IGNORE_INDEX, DataError, load_dataset
from poros_fx.io.export import ExportError, export_merged
from poros_fx.models.tiny import tiny_config

VOCAB = 320  # the byte-level BPE below has 256 bytes + merges + specials < 320
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, what is two plus two?", "two plus two is four",
         "poros streams a frozen base block by block", "a small model learns a small language"]
# small steps (one optimizer step = 2 micro-batches of 2 rows of 24 tokens) keep every run to seconds
FAST = ("--seq-len", "24", "--batch-size", "2", "--accumulate", "2", "--device", "cpu", "--quantization", "bf16")




def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint (float32 safetensors, as save_pretrained writes it) with a tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, vocab=VOCAB))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert len(transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)) <= VOCAB
    return folder


@pytest.fixture(scope="module")
def text_adapter(model_dir, tmp_path_factory) -> tuple[Path, str]:
    """An adapter trained 2 steps on a .jsonl text file (a high lr so the merge visibly changes weights), in this
    process (a subprocess costs ~8 s of imports; test_train_demo_from_config_adapter_loads_in_peft trains through
    the installed script). Its stdout with lines rejoined (this process's console is 80 columns wide)."""
    tmp = tmp_path_factory.mktemp("text")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4), encoding="utf-8")
    out = tmp / "adapter"
    code, stdout, err = run_cli_redirected("train", str(model_dir), "--data", str(data), "--out", str(out), "--steps",
                                           "2", "--lr", "1e-2", *FAST)
    assert code == 0, err
    return out, " ".join(stdout.split())


def _lora_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def test_train_demo_from_config_adapter_loads_in_peft(tmp_path):
    import peft

    config = tiny_config("qwen2", layers=2)
    config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "adapter"
    res = cli("train", "--from-config", str(tmp_path / "cfg" / "config.json"), "--data", "demo", "--out", str(out),
              "--steps", "3", "--lora-r", "4", "--lora-alpha", "8", "--target-modules", "q_proj,v_proj", *FAST)
    assert "step 1/3" in res.stdout and "step 3/3" in res.stdout and "(first step compiles)" in res.stdout
    assert "final loss" in res.stdout and "peak resident base" in res.stdout
    # random weights: no export suggestion that cannot work, but what can be done instead
    assert "no checkpoint for `poros-fx export` to merge it into" in res.stdout and "--base MODEL" not in res.stdout
    assert f"poros-fx eval {tmp_path / 'cfg' / 'config.json'} --adapter {out}" in res.stdout
    assert f"poros-fx train --resume {out}" in res.stdout
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()

    saved = _lora_tensors(out)
    assert len(saved) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # trained: B left zero init
    ordinary = transformers.AutoModelForCausalLM.from_config(config)
    loaded = peft.PeftModel.from_pretrained(ordinary, out)
    params = dict(loaded.named_parameters())
    for key, value in saved.items():
        name = key.replace(".weight", ".default.weight")
        assert torch.equal(params[name].detach(), value), key
    assert loaded.peft_config["default"].r == 4


def test_train_jsonl_text(text_adapter):
    _, stdout = text_adapter
    assert "examples (text)" in stdout and "step 2/2" in stdout and "final loss" in stdout


def test_train_csv_prompt_response(model_dir, tmp_path, capsys):
    data = tmp_path / "pairs.csv"
    data.write_text("prompt,response\nwhat is two plus two?,four\n\"hello, world\",the quick brown fox\n"
                    "say poros,poros streams a frozen base\n", encoding="utf-8")
    # in this process (the other train runs here use the installed script; a subprocess costs ~8 s of imports)
    code, out, err = run_cli(capsys, "train", str(model_dir), "--data", str(data), "--out", str(tmp_path / "adapter"),
                             "--steps", "1", "--no-pack", *FAST)
    assert code == 0, err
    assert "3 examples (prompt/completion)" in " ".join(out.split()) and "step 1/1" in out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_prompt_tokens_are_masked(model_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps([{"prompt": "two plus two is", "response": " four"}]), encoding="utf-8")
    ds = load_dataset(data, seq_len=32, vocab_size=VOCAB, tokenizer=tok, pack=False)
    prompt = tok("two plus two is")["input_ids"]
    response = tok(" four", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(prompt) + len(response)
    assert ds.input_ids[0, :n].tolist() == prompt + response
    assert ds.labels[0, :n].tolist() == [IGNORE_INDEX] * len(prompt) + response
    assert (ds.labels[0, n:] == IGNORE_INDEX).all() and (ds.input_ids[0, n:] == tok.pad_token_id).all()
    packed = load_dataset("demo", seq_len=16, vocab_size=VOCAB)
    assert packed.input_ids.shape[1] == 16 and packed.rows > 10 and packed.input_ids.max() < VOCAB


def test_bad_data_errors_through_the_cli(model_dir, tmp_path, capsys):
    # refused before anything trains: in this process (a poros-fx subprocess costs ~8 s of imports each)
    code, _, err = run_cli(capsys, "train", str(model_dir), "--data", str(tmp_path / "nope.jsonl"), "--out",
                           str(tmp_path / "a"), "--seq-len", "24")
    assert code == 2 and "nope.jsonl: no such file" in err
    (tmp_path / "data.parquet").write_text("x")
    code, _, err = run_cli(capsys, "train", str(model_dir), "--data", str(tmp_path / "data.parquet"), "--out",
                           str(tmp_path / "a"), "--seq-len", "24")
    assert code == 2 and "data.parquet: not a readable parquet file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"question": "no known field"}\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "train", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "a"),
                           "--seq-len", "24")
    assert code == 2 and f"{bad}:3: record has none of the fields" in err
    # text needs a tokenizer; a random built-in shape has none
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "hello"}\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "train", "--from-config", "qwen2.5-0.5b", "--data", str(text), "--out",
                           str(tmp_path / "a"))
    assert code == 2 and "needs a tokenizer and there is none" in err
    assert not (tmp_path / "a").exists()


def test_bad_data_errors(model_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def error(name: str, content: str) -> str:
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(DataError) as info:
            load_dataset(tmp_path / name, seq_len=16, vocab_size=VOCAB, tokenizer=tok)
        return str(info.value)

    assert "empty dataset" in error("empty.jsonl", "\n\n")
    assert "empty.csv: empty CSV file" in error("empty.csv", "")
    assert "no records (empty dataset)" in error("header.csv", "prompt,response\n")
    assert "empty.json: no records" in error("empty.json", "[]")
    assert "rows.csv:2: record has 'prompt' but no 'completion'" in error("rows.csv", "prompt,text\na,b\nc,d\n")
    assert "number.json: a .json data file holds a list of records" in error("number.json", '5')
    assert "broken.jsonl:2: not valid JSON" in error("broken.jsonl", '{"text": "a"}\n{"text": \n')
    assert "list.json: record 1: field 'input_ids' is not a list of integers" in error(
        "list.json", '[{"input_ids": [1, 2]}, {"input_ids": "x y"}]')
    assert "outside the model's vocabulary" in error("ids.jsonl", '{"input_ids": [1, 2, 5000]}\n')
    assert "no row has a token to learn from" in error("masked.jsonl", '{"input_ids": [1, 2], "labels": [-100, -100]}\n')
    # pre-tokenized data needs no tokenizer
    (tmp_path / "ok.csv").write_text('input_ids\n"[1, 2, 3, 4]"\n5 6 7\n', encoding="utf-8")
    ds = load_dataset(tmp_path / "ok.csv", seq_len=4, vocab_size=VOCAB, tokenizer=None)
    assert ds.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]] and ds.labels[1].tolist() == [5, 6, 7, IGNORE_INDEX]


def test_export_equals_peft_merge_and_unload(model_dir, text_adapter, tmp_path):
    import peft

    adapter, _ = text_adapter
    merged_dir = tmp_path / "merged"
    # a shard limit below one layer's size: one shard per layer, plus the index
    res = cli("export", str(adapter), "--base", str(model_dir), "-o", str(merged_dir), "--max-shard-size", "100kB")
    assert "merged 14 LoRA modules" in res.stdout
    index = json.loads((merged_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert (merged_dir / "tokenizer.json").exists()

    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).eval()
    # the reference: peft's own merge on the float32 base, then one rounding to bf16 (see poros_fx/export.py
    # for why a bf16-base merge_and_unload rounds twice and can differ by an ulp)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    theirs = {k: v.to(torch.bfloat16) for k, v in
              peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict().items()}
    ours = merged.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], theirs[key]), key
    # the same weights in a model loaded the standard bf16 way (a float32 model .to(bf16) would also round
    # the rotary inv_freq buffer, which from_pretrained(dtype=bf16) keeps in float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    reference.load_state_dict(theirs)
    changed = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[changed], original[changed].to(torch.bfloat16))  # the adapter did something
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_export_errors(model_dir, text_adapter, tmp_path):
    adapter, _ = text_adapter
    with pytest.raises(ExportError, match="has no adapter_config.json"):
        export_merged(tmp_path, model_dir, tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_merged(adapter, model_dir, tmp_path / "busy")
    other = tmp_path / "other-base"
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, vocab=VOCAB, hidden=32)).save_pretrained(other)
    with pytest.raises(ExportError, match="adapter trained on a different base"):
        export_merged(adapter, other, tmp_path / "out")
    # the same shapes, another model: refused by the name the adapter records, unless asked for
    import shutil

    sibling = Path(shutil.copytree(model_dir, tmp_path / "sibling"))
    assert str(model_dir) in (adapter / "adapter_config.json").read_text()
    with pytest.raises(ExportError, match="base_model_name_or_path.*--any-base"):
        export_merged(adapter, sibling, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_merged(adapter, sibling, tmp_path / "out", any_base=True)


def test_export_names_a_corrupt_adapter_in_one_line(model_dir, text_adapter, tmp_path, capsys):
    import shutil

    adapter, _ = text_adapter
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a truncated copy
    code, _, err = run_cli(capsys, "export", str(broken), "--base", str(model_dir), "-o", str(tmp_path / "merged"))
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(weights) in errors[0] and "truncated" in errors[0], err
    assert not (tmp_path / "merged").exists()
    # a header that parses but data safetensors refuses (a dtype code it does not know)
    data = (adapter / "adapter_model.safetensors").read_bytes()
    assert b'"dtype":"F32"' in data
    weights.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"Q32"', 1))
    with pytest.raises(ExportError, match="adapter_model.safetensors: cannot read the adapter weights") as info:
        export_merged(broken, model_dir, tmp_path / "merged2")
    assert "\n" not in str(info.value)
