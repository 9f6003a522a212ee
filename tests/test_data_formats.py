"""Training data where people keep it, through the Python API (``load_dataset``) and the command line.

The same conversations written as .jsonl, .json (JSON Lines and a list), .csv, .parquet, a
``save_to_disk`` folder (a Dataset and a DatasetDict with --split) and a dataset id in a local
``datasets`` cache give the same rows; each field kind (messages, prompt/completion, response, text,
input_ids) is labelled as documented; bad records are named by file, row and field.
"""

import json
import shutil

import pytest
import torch
from train_helper import FAST, checkpoint, run_cli  # noqa: F401 (checkpoint is a fixture)

datasets = pytest.importorskip("datasets")

from poros_fx.io.data import IGNORE_INDEX, DataError, load_dataset  # noqa: E402
from poros_fx.models.tiny_tokenizer import chat_records, tiny_tokenizer  # noqa: E402

VOCAB = 320
RECORDS = chat_records(6)
PAIRS = [{"prompt": r["messages"][0]["content"], "completion": " " + r["messages"][1]["content"]} for r in RECORDS]


def rows(source, **kw):
    ds = load_dataset(source, seq_len=48, vocab_size=VOCAB, tokenizer=kw.pop("tokenizer", TOKENIZER), pack=False, **kw)
    return ds.input_ids, ds.labels, ds.kinds


TOKENIZER = tiny_tokenizer()


def cache_dataset(cache, name: str, records: list[dict], tmp_path) -> None:
    """``records`` as the local datasets cache holds a hub dataset ``owner/name`` (built offline by the json
    builder, then laid out under the id's name)."""
    owner, short = name.split("/")
    data = tmp_path / "cache-source.json"
    data.write_text(json.dumps(records), encoding="utf-8")
    builder = datasets.load_dataset_builder("json", data_files=str(data), cache_dir=str(cache))
    builder.download_and_prepare()
    (built,) = (cache / "json").iterdir()
    target = cache / f"{owner}___{short}" / "default"
    shutil.move(str(built), str(target))
    for arrow in target.rglob("json-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("json-", f"{short}-", 1)))


def test_every_format_gives_the_same_rows(tmp_path, monkeypatch):
    ds = datasets.Dataset.from_list(RECORDS)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (tmp_path / "list.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    ds.to_json(str(tmp_path / "lines.json"))  # JSON Lines, datasets' default
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:2]), "test": ds}).save_to_disk(
        str(tmp_path / "splits"))
    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "someone/chat", RECORDS, tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))

    ids, labels, kinds = rows(tmp_path / "chat.jsonl")
    assert kinds == ("messages",)
    for source, kw in [("list.json", {}), ("lines.json", {}), ("chat.parquet", {}), ("folder", {}),
                       ("splits", {"split": "test"})]:
        other_ids, other_labels, _ = rows(tmp_path / source, **kw)
        assert torch.equal(other_ids, ids) and torch.equal(other_labels, labels), source
    cached_ids, cached_labels, _ = rows("someone/chat")
    assert torch.equal(cached_ids, ids) and torch.equal(cached_labels, labels)
    with pytest.raises(DataError, match=r"splits holds the splits \['train', 'test'\]|Unknown split"):
        rows(tmp_path / "splits", split="valid")
    with pytest.raises(DataError, match="not in the local datasets cache|downloads nothing"):
        rows("someone/not-cached")


def test_fields_and_their_labels(tmp_path):
    # messages: the assistant turn (its content and <eos>) is trained, as the template's generation markers say
    ids, labels, _ = rows_of(tmp_path, "m.jsonl", [RECORDS[0]])
    rendered = TOKENIZER.apply_chat_template(RECORDS[0]["messages"], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    n = len(rendered["input_ids"])
    assert ids[0, :n].tolist() == rendered["input_ids"]
    assert labels[0, :n].tolist() == [t if m else IGNORE_INDEX for t, m in zip(rendered["input_ids"],
                                                                               rendered["assistant_masks"])]
    assert 0 < sum(rendered["assistant_masks"]) < n
    everything = load_dataset(tmp_path / "m.jsonl", seq_len=48, vocab_size=VOCAB, tokenizer=TOKENIZER, pack=False,
                              train_on="all")
    assert everything.labels[0, :n].tolist() == rendered["input_ids"]
    # a template without generation markers: the assistant turn is found by rendering the prefix
    plain = tiny_tokenizer()
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert torch.equal(rows(tmp_path / "m.jsonl", tokenizer=plain)[1], labels)
    # prompt/completion and its older name, response: the completion (and <eos>) is trained
    pairs = rows_of(tmp_path, "p.jsonl", PAIRS[:1])
    responses = rows_of(tmp_path, "r.jsonl", [{"prompt": PAIRS[0]["prompt"], "response": PAIRS[0]["completion"]}])
    assert torch.equal(pairs[0], responses[0]) and torch.equal(pairs[1], responses[1])
    prompt = TOKENIZER(PAIRS[0]["prompt"])["input_ids"]
    assert (pairs[1][0, :len(prompt)] == IGNORE_INDEX).all() and (pairs[1][0, len(prompt)] != IGNORE_INDEX)
    # conversational prompt/completion: the completion turns are trained
    chat_pair = {"prompt": RECORDS[0]["messages"][:1], "completion": RECORDS[0]["messages"][1:]}
    assert torch.equal(rows_of(tmp_path, "cp.jsonl", [chat_pair])[1], labels)
    # text and input_ids: every token
    text = rows_of(tmp_path, "t.jsonl", [{"text": "hello world"}])
    assert (text[1][0] != IGNORE_INDEX).sum() == (text[0][0] != TOKENIZER.pad_token_id).sum()
    tokens = rows_of(tmp_path, "i.jsonl", [{"input_ids": [5, 6, 7]}], tokenizer=None)
    assert tokens[0][0, :3].tolist() == [5, 6, 7] and tokens[2] == ("input_ids",)


def rows_of(tmp_path, name, records, **kw):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return rows(tmp_path / name, **kw)


def test_errors_name_the_file_the_row_and_the_field(tmp_path):
    def error(name: str, records: list, **kw) -> str:
        with pytest.raises(DataError) as info:
            rows_of(tmp_path, name, records, **kw)
        return str(info.value)

    assert f"{tmp_path / 'a.jsonl'}:2: field 'messages', turn 1: a turn is an object with a 'role'" in error(
        "a.jsonl", [RECORDS[0], {"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}])
    assert f"{tmp_path / 'b.jsonl'}:1: field 'messages' has no assistant turn" in error(
        "b.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    assert "c.jsonl:1: record has 'completion' but no 'prompt' field" in error("c.jsonl", [{"completion": "x"}])
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    assert "d.jsonl:1: chat turns need the tokenizer's chat template" in error("d.jsonl", RECORDS[:1],
                                                                              tokenizer=no_template)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet: not a readable parquet file"):
        rows(tmp_path / "bad.parquet")
    (tmp_path / "plain-folder").mkdir()
    with pytest.raises(DataError, match="plain-folder is a folder but not one Dataset.save_to_disk wrote"):
        rows(tmp_path / "plain-folder")


def test_formats_through_the_cli(checkpoint, tmp_path, capsys, monkeypatch):
    """--data with a parquet file of prompt/completion pairs, a DatasetDict folder with --split, and a cached
    dataset id with --train-on all: each trains a step."""
    datasets.Dataset.from_list(PAIRS).to_parquet(str(tmp_path / "pairs.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS),
                          "test": datasets.Dataset.from_list(RECORDS[:2])}).save_to_disk(str(tmp_path / "splits"))
    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "someone/chat", RECORDS, tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    for i, (data, extra, seen) in enumerate([(tmp_path / "pairs.parquet", (), "6 examples (prompt/completion)"),
                                             (tmp_path / "splits", ("--split", "test"), "2 examples (messages)"),
                                             ("someone/chat", ("--train-on", "all"), "6 examples (messages)")]):
        code, out, err = run_cli(capsys, "train", str(checkpoint), "--data", str(data), "--out", str(tmp_path / f"o{i}"),
                                 "--steps", "1", "--no-pack", *extra, *FAST)
        assert code == 0, err
        assert seen in out and (tmp_path / f"o{i}" / "adapter_model.safetensors").is_file()
