"""Training data for ``poros-fx train`` and ``FineTuner.train``: records tokenized and packed to fixed-length rows.

Sources (``records.py`` reads them): ``demo`` (alias ``synthetic``): a small deterministic synthetic
token set (arithmetic progressions modulo the vocabulary, so a model can learn it; needs no tokenizer);
``.jsonl``, ``.json`` (a list or JSON Lines), ``.csv``, ``.parquet``, a ``Dataset.save_to_disk`` folder,
or a dataset id in the local ``datasets`` cache. Each record has one of:

- ``messages``: a list of ``{"role", "content"}`` turns, rendered with the tokenizer's chat template;
  trained on the assistant turns (``train_on="all"``: every token). The assistant tokens come from the
  template's ``{% generation %}`` markers when it has them, else from rendering the conversation up to
  each assistant turn (the rendered prefix must tokenize to a prefix of the whole);
- ``prompt`` + ``completion`` (or ``response``): trained on the completion only (``train_on="all"``:
  on both); both strings, or both lists of chat turns (rendered as ``messages``);
- ``text``: trained on every token;
- ``input_ids`` (and optionally ``labels``, -100 where nothing is learned): already tokenized (a list of
  ints; in a CSV a JSON list or space/comma separated ints). Works without a tokenizer.

Every example becomes a token stream with its labels; the streams are either packed end to end and cut
into rows of ``seq_len`` tokens (``pack=True``, the default) or truncated to ``seq_len`` one example per
row. A short last row is right-padded with labels -100, which changes nothing for a causal LM (no earlier
position attends to a later one), so every batch has the same shape and the step compiles once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .records import DataError, read_records

if TYPE_CHECKING:
    import transformers

IGNORE_INDEX = -100  # the label transformers' causal-LM loss skips
DEMO = "demo"
DEMO_NAMES = (DEMO, "synthetic")  # the built-in token set, by either name
TRAIN_ON = ("completion", "all")  # what the loss sees: assistant turns / completions, or every token
_DEMO_SEED = 0  # the demo set is the same whatever --seed (which only orders it)

__all__ = ["DataError", "Example", "TokenDataset", "load_dataset", "batches", "eval_batches", "IGNORE_INDEX"]


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
    kinds: tuple[str, ...]  # record kinds seen: "messages", "prompt/completion", "text", "input_ids", "demo"

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def supervised_tokens(self) -> int:
        """Tokens the loss sees as targets (a label at position >= 1 that is not ignored)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def load_dataset(source: str | os.PathLike, *, seq_len: int, vocab_size: int,
                 tokenizer: "transformers.PreTrainedTokenizerBase | None" = None, pack: bool = True,
                 tokenizer_hint: str = "", train_on: str = "completion", split: str | None = None) -> TokenDataset:
    """Read ``source`` (``"demo"``, a file, a dataset folder or a cached dataset id; ``split`` for the last
    two), tokenize, check ids against ``vocab_size`` and make rows. ``train_on``: ``"completion"`` (the
    assistant turns, completions and responses) or ``"all"``.

    ``tokenizer_hint`` is appended to the error raised when text records come without a tokenizer (the
    CLI says where it looked for one).
    """
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2 (a causal LM learns from the next token), got {seq_len}")
    if train_on not in TRAIN_ON:
        raise DataError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if str(source) in DEMO_NAMES:
        examples = demo_examples(vocab_size)
        kinds: tuple[str, ...] = ("demo",)
        where = "the built-in demo set"
    else:
        records = read_records(source, split)
        examples, kinds = _tokenize(records, tokenizer, tokenizer_hint, train_on)
        where = str(source) if split is None else f"{source} [{split}]"
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


# -- tokenizing -------------------------------------------------------------------------------------

def _tokenize(records: list[tuple[str, dict[str, Any]]], tokenizer: "transformers.PreTrainedTokenizerBase | None",
              tokenizer_hint: str, train_on: str) -> tuple[list[Example], tuple[str, ...]]:
    examples = []
    kinds: list[str] = []
    everything = train_on == "all"
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
        elif kind == "messages":
            examples.append(_chat(where, _turns(where, record["messages"], "messages"), [], tokenizer, everything))
        else:
            answer = "completion" if "completion" in record else "response"
            if isinstance(record["prompt"], list) or isinstance(record[answer], list):
                prompt = _turns(where, record["prompt"], "prompt")
                examples.append(_chat(where, prompt, _turns(where, record[answer], answer), tokenizer, everything))
            else:
                prompt_ids = _encode(tokenizer, _string(where, record, "prompt", allow_empty=True), special=True)
                answer_ids = _encode(tokenizer, _string(where, record, answer), special=False) + _eos(tokenizer)
                labels = (prompt_ids if everything else [IGNORE_INDEX] * len(prompt_ids)) + answer_ids
                examples.append(Example(prompt_ids + answer_ids, labels))
        if kind not in kinds:
            kinds.append(kind)
    return examples, tuple(kinds)


def _kind(where: str, record: dict[str, Any]) -> str:
    if "input_ids" in record:
        return "input_ids"
    if "messages" in record:
        return "messages"
    answers = [f for f in ("completion", "response") if f in record]
    if "prompt" in record or answers:
        if "prompt" not in record:
            raise DataError(f"{where}: record has {answers[0]!r} but no 'prompt' field; prompt/completion records need "
                            f"both")
        if not answers:
            raise DataError(f"{where}: record has 'prompt' but no 'completion' (or 'response') field; "
                            f"prompt/completion records need both")
        return "prompt/completion"
    if "text" in record:
        return "text"
    raise DataError(f"{where}: record has none of the fields poros-fx trains on (found {sorted(record)}); give "
                    f"'messages', 'prompt' and 'completion' (or 'response'), 'text', or 'input_ids'")


def _turns(where: str, value: Any, field: str) -> list[dict[str, Any]]:
    """A list of chat turns (``{"role": ..., "content": ...}``), checked."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of {{\"role\", \"content\"}} turns, "
                        f"found {type(value).__name__ if value != [] else 'an empty list'}")
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            raise DataError(f"{where}: field {field!r}, turn {i}: a turn is an object with a 'role' string and a "
                            f"'content'; found {json.dumps(turn)[:80]}")
    return value


def _chat(where: str, prompt: list[dict[str, Any]], answer: list[dict[str, Any]], tokenizer: Any,
          everything: bool) -> Example:
    """A conversation through the chat template: ``prompt`` turns then ``answer`` turns (a ``messages``
    record is all prompt). Trained on: every token (``everything``), the ``answer`` turns when there are
    any, else the assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat turns need the tokenizer's chat template, and this tokenizer has none "
                        f"(chat_template in tokenizer_config.json or chat_template.jinja); give 'text' or "
                        f"'prompt'/'completion' strings instead")
    turns = prompt + answer
    ids = _render(where, tokenizer, turns)
    if everything:
        return Example(ids, list(ids))
    trained = range(len(prompt), len(turns)) if answer else [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if not trained:
        raise DataError(f"{where}: field 'messages' has no assistant turn to train on (roles "
                        f"{[t['role'] for t in turns]}); add one, or train on every token (--train-on all)")
    mask = _assistant_mask(where, tokenizer, turns, ids, trained, answer_only=bool(answer))
    return Example(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)])


def _render(where: str, tokenizer: Any, turns: list[dict[str, Any]], generation_prompt: bool = False) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=generation_prompt,
                                            return_dict=True)
    except Exception as e:  # jinja's errors (a template raising on a role it does not know, ...): the record
        raise DataError(f"{where}: the chat template cannot render this conversation ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'})") from None
    return list(out["input_ids"])


def _assistant_mask(where: str, tokenizer: Any, turns: list[dict[str, Any]], ids: list[int], trained: Any,
                    answer_only: bool) -> list[bool]:
    """Which of ``ids`` belong to the ``trained`` turns."""
    if not answer_only and "generation" in tokenizer.chat_template and "endgeneration" in tokenizer.chat_template:
        out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return [bool(m) for m in out["assistant_masks"]]
    mask = [False] * len(ids)
    for i in trained:
        before = _render(where, tokenizer, turns[:i], generation_prompt=True) if i else []
        through = _render(where, tokenizer, turns[:i + 1])
        if before != through[:len(before)] or through != ids[:len(through)]:
            raise DataError(f"{where}: turn {i}: the chat template renders the conversation so that a turn's tokens "
                            f"cannot be told apart (its prefix does not tokenize to a prefix of the whole); add "
                            f"{{% generation %}} markers to the template, or train on every token (--train-on all)")
        for j in range(len(before), len(through)):
            mask[j] = True
    return mask


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
