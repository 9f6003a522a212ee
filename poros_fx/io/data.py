"""Training data for ``poros-fx train``: files or the built-in demo set, tokenized and packed to fixed-length rows.

Sources:

* ``demo``: a small deterministic synthetic token set (arithmetic progressions modulo the vocabulary,
  so a model can learn it); needs no tokenizer.
* ``.jsonl`` (one JSON object per line), ``.json`` (a list of objects) or ``.csv`` (a header row), whose
  records have one of:

  - ``text``: trained on every token;
  - ``prompt`` + ``response``: trained on the response only (prompt labels are -100);
  - ``input_ids``: already tokenized (a list of ints; in a CSV a JSON list or space/comma separated
    ints), trained on every token. Works without a tokenizer.

Every example becomes a token stream with its labels; the streams are either packed end to end and cut
into rows of ``seq_len`` tokens (``pack=True``, the default) or truncated to ``seq_len`` one example per
row. A short last row is right-padded with labels -100, which changes nothing for a causal LM (no earlier
position attends to a later one), so every batch has the same shape and the step compiles once.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..errors import PorosError

if TYPE_CHECKING:
    import transformers

IGNORE_INDEX = -100  # the label transformers' causal-LM loss skips
DEMO = "demo"
SUFFIXES = (".jsonl", ".json", ".csv")
_DEMO_SEED = 0  # the demo set is the same whatever --seed (which only orders it)


class DataError(PorosError, ValueError):
    """Training data poros-fx cannot use: missing file, unknown format, a bad record, nothing to train on."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example: token ids and their labels (``IGNORE_INDEX`` where nothing is learned)."""

    input_ids: list[int]
    labels: list[int]


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """Fixed-length rows ready for training."""

    source: str
    input_ids: torch.Tensor  # (rows, seq_len) int64
    labels: torch.Tensor  # (rows, seq_len) int64
    examples: int  # records read
    kinds: tuple[str, ...]  # record kinds seen: "text", "prompt/response", "input_ids", "demo"

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def supervised_tokens(self) -> int:
        """Tokens the loss sees as targets (a label at position >= 1 that is not ignored)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def load_dataset(source: str | os.PathLike, *, seq_len: int, vocab_size: int,
                 tokenizer: "transformers.PreTrainedTokenizerBase | None" = None, pack: bool = True,
                 tokenizer_hint: str = "") -> TokenDataset:
    """Read ``source`` (a data file or ``"demo"``), tokenize, check ids against ``vocab_size`` and make rows.

    ``tokenizer_hint`` is appended to the error raised when text records come without a tokenizer (the
    CLI says where it looked for one).
    """
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2 (a causal LM learns from the next token), got {seq_len}")
    if str(source) == DEMO:
        examples = demo_examples(vocab_size)
        kinds: tuple[str, ...] = ("demo",)
        where = "the built-in demo set"
    else:
        path = Path(source)
        records = read_records(path)
        examples, kinds = _tokenize(records, path, tokenizer, tokenizer_hint)
        where = str(path)
    _check_vocab(examples, vocab_size, where, tokenizer)
    pad_id = _pad_id(tokenizer)
    ids, labels = (pack_rows if pack else truncate_rows)(examples, seq_len, pad_id)
    if ids.shape[0] == 0:
        raise DataError(f"{where}: no row has a token to learn from after {'packing' if pack else 'truncation'} to "
                        f"seq_len {seq_len} (every label is masked: empty responses, or prompts longer than "
                        f"seq_len?); add data or raise --seq-len")
    return TokenDataset(source=where, input_ids=ids, labels=labels, examples=len(examples), kinds=kinds)


def demo_examples(vocab_size: int, count: int = 64) -> list[Example]:
    """``count`` deterministic sequences (16..64 tokens), each an arithmetic progression modulo the vocabulary."""
    g = torch.Generator().manual_seed(_DEMO_SEED)
    out = []
    for _ in range(count):
        length = int(torch.randint(16, 65, (1,), generator=g))
        start = int(torch.randint(0, vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        ids = [(start + i * stride) % vocab_size for i in range(length)]
        out.append(Example(ids, list(ids)))
    return out


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every record of a .jsonl / .json / .csv file; ``where`` is ``file:line``."""
    if not path.exists():
        raise DataError(f"{path}: no such file; pass a .jsonl, .json or .csv file, or 'demo' for the built-in set")
    if path.is_dir():
        raise DataError(f"{path} is a folder; pass a .jsonl, .json or .csv file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown data format {suffix or '(no extension)'!r}; use .jsonl (one JSON object per "
                        f"line), .json (a list of objects) or .csv (with a header row)")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: spreadsheets often write a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    records: list[tuple[str, dict[str, Any]]] = []
    if suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg}); a .jsonl file has one JSON object per "
                                f"line") from None
            records.append((f"{path}:{number}", record))
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of records ([{{\"text\": ...}}, ...]), "
                            f"found a {type(data).__name__}; for one object per line use .jsonl")
        records = [(f"{path}: record {i}", record) for i, record in enumerate(data)]
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames:
            raise DataError(f"{path}: empty CSV file; it needs a header row (text, or prompt,response, or input_ids) "
                            f"and one row per record")
        for row in reader:
            if not any((v or "").strip() for k, v in row.items() if k is not None):
                continue
            records.append((f"{path}:{reader.line_num}", {k: v for k, v in row.items() if k is not None}))
    if not records:
        raise DataError(f"{path}: no records (empty dataset); add at least one record with text, prompt+response or "
                        f"input_ids")
    return records


# -- tokenizing -------------------------------------------------------------------------------------

def _tokenize(records: list[tuple[str, dict[str, Any]]], path: Path,
              tokenizer: "transformers.PreTrainedTokenizerBase | None",
              tokenizer_hint: str) -> tuple[list[Example], tuple[str, ...]]:
    examples = []
    kinds: list[str] = []
    for where, record in records:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a record must be a JSON object, found {type(record).__name__}")
        kind = _kind(where, record)
        if kind != "input_ids" and tokenizer is None:
            raise DataError(f"{where}: a {kind!r} record needs a tokenizer and there is none{tokenizer_hint}. Put the "
                            f"tokenizer files (tokenizer.json, tokenizer_config.json) in the model folder, or give "
                            f"pre-tokenized records with an 'input_ids' list")
        if kind == "input_ids":
            examples.append(_token_record(where, record))
        elif kind == "text":
            ids = _encode(tokenizer, _string(where, record, "text"), special=True) + _eos(tokenizer)
            examples.append(Example(ids, list(ids)))
        else:
            prompt = _encode(tokenizer, _string(where, record, "prompt", allow_empty=True), special=True)
            response = _encode(tokenizer, _string(where, record, "response"), special=False) + _eos(tokenizer)
            examples.append(Example(prompt + response, [IGNORE_INDEX] * len(prompt) + response))
        if kind not in kinds:
            kinds.append(kind)
    return examples, tuple(kinds)


def _kind(where: str, record: dict[str, Any]) -> str:
    if "input_ids" in record:
        return "input_ids"
    if "prompt" in record or "response" in record:
        missing = [f for f in ("prompt", "response") if f not in record]
        if missing:
            raise DataError(f"{where}: record has {'prompt' if missing == ['response'] else 'response'} but no "
                            f"{missing[0]!r} field; prompt/response records need both")
        return "prompt/response"
    if "text" in record:
        return "text"
    raise DataError(f"{where}: record has none of the fields poros-fx trains on (found {sorted(record)}); give 'text', "
                    f"or 'prompt' and 'response', or 'input_ids'")


def _string(where: str, record: dict[str, Any], field: str, allow_empty: bool = False) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, found {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field {field!r} is empty")
    return value


def _token_record(where: str, record: dict[str, Any]) -> Example:
    ids = _int_list(where, record["input_ids"], "input_ids")
    if not ids:
        raise DataError(f"{where}: 'input_ids' is empty")
    labels = list(ids)
    if record.get("labels") not in (None, ""):
        labels = _int_list(where, record["labels"], "labels")
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries, 'input_ids' {len(ids)}; they must match "
                            f"(-100 where nothing is learned)")
    return Example(ids, labels)


def _int_list(where: str, value: Any, field: str) -> list[int]:
    if isinstance(value, str):  # a CSV cell: "[1, 2, 3]" or "1 2 3" or "1,2,3"
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise DataError(f"{where}: field {field!r} is not a list of integers: {text[:60]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: field {field!r} must be a list of integers")
    return value


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer: Any) -> list[int]:
    # the end-of-sequence token teaches the model where an example stops (and separates packed examples)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0  # any valid id works: padded positions are labelled -100 and only attended by later padding


def _check_vocab(examples: list[Example], vocab_size: int, where: str, tokenizer: Any) -> None:
    for i, ex in enumerate(examples):
        bad = [t for t in ex.input_ids if not 0 <= t < vocab_size]
        bad += [t for t in ex.labels if t != IGNORE_INDEX and not 0 <= t < vocab_size]
        if bad:
            origin = "the tokenizer produced" if tokenizer is not None else "the data holds"
            raise DataError(f"{where}: example {i}: {origin} token id {bad[0]}, outside the model's vocabulary "
                            f"(vocab_size {vocab_size}); tokenizer and model do not belong together")


# -- rows -------------------------------------------------------------------------------------------

def pack_rows(examples: list[Example], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All examples end to end, cut into rows of ``seq_len``; the last row right-padded."""
    ids = [t for ex in examples for t in ex.input_ids]
    labels = [t for ex in examples for t in ex.labels]
    rows = [(ids[i:i + seq_len], labels[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
    return _stack(rows, seq_len, pad_id)


def truncate_rows(examples: list[Example], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One example per row, cut to ``seq_len`` and right-padded."""
    return _stack([(ex.input_ids[:seq_len], ex.labels[:seq_len]) for ex in examples], seq_len, pad_id)


def _stack(rows: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    kept_ids, kept_labels = [], []
    for ids, labels in rows:
        # the loss predicts labels[1:]: a row without one would give a 0/0 (NaN) loss
        if all(t == IGNORE_INDEX for t in labels[1:]):
            continue
        pad = seq_len - len(ids)
        kept_ids.append(ids + [pad_id] * pad)
        kept_labels.append(labels + [IGNORE_INDEX] * pad)
    shape = (len(kept_ids), seq_len)
    return (torch.tensor(kept_ids, dtype=torch.long).reshape(shape),
            torch.tensor(kept_labels, dtype=torch.long).reshape(shape))


def batches(dataset: TokenDataset, batch_size: int, count: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``batch_size`` rows: a seeded shuffle per epoch, epochs back to back, so every
    batch is full (one shape, one compile) even when the rows do not divide evenly."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(count):
        while len(order) < batch_size:
            order += torch.randperm(dataset.rows, generator=g).tolist()
        take, order = order[:batch_size], order[batch_size:]
        index = torch.tensor(take)
        yield {"input_ids": dataset.input_ids[index], "labels": dataset.labels[index]}


def eval_batches(dataset: TokenDataset, batch_size: int) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Every row once, in order, ``batch_size`` rows per batch, each with its count of supervised tokens.

    The last batch is filled up to ``batch_size`` with rows that have nothing to learn (labels all
    ``IGNORE_INDEX``): they add no term to the loss, and every batch keeps one shape (one compile).
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    for start in range(0, dataset.rows, batch_size):
        ids = dataset.input_ids[start:start + batch_size]
        labels = dataset.labels[start:start + batch_size]
        short = batch_size - ids.shape[0]
        if short:
            ids = torch.cat([ids, torch.zeros((short, ids.shape[1]), dtype=ids.dtype)])
            labels = torch.cat([labels, torch.full((short, labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)])
        yield {"input_ids": ids, "labels": labels}, int((labels[:, 1:] != IGNORE_INDEX).sum())
