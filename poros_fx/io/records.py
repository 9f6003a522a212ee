"""Training records read from where people keep them: files, ``datasets`` folders, cached dataset ids.

``read_records(source, split=...)`` returns ``(where, record)`` pairs, ``where`` naming the file and the
row (``train.jsonl:3``, ``data.parquet: row 7``) so that an error about a record can say which one:

* ``.jsonl`` — one JSON object per line;
* ``.json`` — a list of objects, or JSON Lines (what ``Dataset.to_json`` writes by default);
* ``.csv`` — a header row, then one record per row;
* ``.parquet`` — read with pyarrow (installed with ``datasets``: ``pip install poros-fx[trl]``);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``split`` picks the
  split of a ``DatasetDict``; default ``train``);
* a dataset id already in the local ``datasets`` cache (``split``; default ``train``). Nothing is
  downloaded: ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set before ``datasets`` is first imported
  here, and an id that is not cached is refused.

``datasets`` and pyarrow are imported only when a folder, an id or a parquet file is read (optional
extra).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import PorosError

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
FORMATS = ("a .jsonl, .json, .csv or .parquet file, a folder written by Dataset.save_to_disk, or a dataset id in "
           "the local datasets cache")
DEFAULT_SPLIT = "train"

Record = tuple[str, dict[str, Any]]  # (where: file and row, the record)


class DataError(PorosError, ValueError):
    """Training data poros-fx cannot use: missing file, unknown format, a bad record, nothing to train on."""


def read_records(source: str | os.PathLike, split: str | None = None) -> list[Record]:
    """``(where, record)`` for every record of ``source`` (module docstring); ``split`` for dataset folders
    and ids."""
    path = Path(source)
    if path.is_dir():
        records = _from_dataset_folder(path, split)
    elif path.exists():
        if split is not None:
            raise DataError(f"{path}: --split picks a split of a dataset folder or id; a file has none")
        records = _from_file(path)
    elif path.suffix.lower() in FILE_SUFFIXES or os.sep in str(source) and not _looks_like_id(str(source)):
        raise DataError(f"{path}: no such file; pass {FORMATS}, or 'demo' for the built-in set")
    else:
        records = _from_cached_id(str(source), split)
    if not records:
        raise DataError(f"{source}: no records (empty dataset); add at least one record with text, prompt and "
                        f"completion, messages, or input_ids")
    return records


def _looks_like_id(text: str) -> bool:
    """``name`` or ``owner/name``: how a hub dataset id is written."""
    parts = text.split("/")
    return len(parts) <= 2 and all(p and not p.startswith(".") for p in parts)


# -- files ------------------------------------------------------------------------------------------

def _from_file(path: Path) -> list[Record]:
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"{path}: unknown data format {suffix or '(no extension)'!r}; use .jsonl (one JSON object per "
                        f"line), .json (a list of objects, or JSON Lines), .csv (with a header row), .parquet, or a "
                        f"Dataset.save_to_disk folder")
    if suffix == ".parquet":
        return _from_parquet(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: spreadsheets often write a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    if suffix == ".jsonl":
        return _json_lines(path, text)
    if suffix == ".json":
        return _json(path, text)
    return _csv(path, text)


def _json_lines(path: Path, text: str) -> list[Record]:
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e.msg}); a JSON Lines file has one JSON object per "
                            f"line") from None
        records.append((f"{path}:{number}", record))
    return records


def _json(path: Path, text: str) -> list[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one JSON value: JSON Lines (Dataset.to_json's default)
            return _json_lines(path, text)
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict):  # one object: JSON Lines of one line (what Dataset.to_json writes for one row)
        return [(f"{path}:1", data)]
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json data file holds a list of records ([{{\"text\": ...}}, ...]) or one record "
                        f"per line; found a {type(data).__name__}")
    return [(f"{path}: record {i}", record) for i, record in enumerate(data)]


def _csv(path: Path, text: str) -> list[Record]:
    reader = csv.DictReader(text.splitlines())
    if not reader.fieldnames:
        raise DataError(f"{path}: empty CSV file; it needs a header row (text, or prompt,completion, or input_ids) "
                        f"and one row per record")
    records = []
    for row in reader:
        if not any((v or "").strip() for k, v in row.items() if k is not None):
            continue
        records.append((f"{path}:{reader.line_num}", {k: v for k, v in row.items() if k is not None}))
    return records


def _from_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install poros-fx[trl], or pip install pyarrow)"
                        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's own errors (ArrowInvalid, OSError): the file, in one line
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {_first_line(e)})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


# -- datasets ---------------------------------------------------------------------------------------

def _datasets() -> Any:
    """The ``datasets`` module, offline: nothing poros-fx reads is ever downloaded."""
    if "datasets" not in sys.modules:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError("reading a dataset folder or id needs the datasets package (pip install poros-fx[trl])"
                        ) from None
    return datasets


def _from_dataset_folder(path: Path, split: str | None) -> list[Record]:
    if not any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DataError(f"{path} is a folder but not one Dataset.save_to_disk wrote (no dataset_info.json, state.json "
                        f"or dataset_dict.json); pass {FORMATS}")
    datasets = _datasets()
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets' own errors: the folder, in one line
        raise DataError(f"{path}: datasets cannot load it ({type(e).__name__}: {_first_line(e)})") from None
    return _rows(_pick_split(data, split, str(path)), str(path))


def _from_cached_id(name: str, split: str | None) -> list[Record]:
    datasets = _datasets()
    try:
        data = datasets.load_dataset(name, split=split or DEFAULT_SPLIT)
    except ValueError as e:  # an unknown split
        raise DataError(f"{name}: {_first_line(e)}") from None
    except Exception as e:  # not cached (offline), or not a dataset at all
        raise DataError(f"{name!r} is not a data file or folder here, and not a dataset in the local datasets cache "
                        f"({type(e).__name__}: {_first_line(e)}); poros-fx downloads nothing: pass {FORMATS}") from None
    return _rows(data, f"{name}[{split or DEFAULT_SPLIT}]")


def _pick_split(data: Any, split: str | None, where: str) -> Any:
    if isinstance(data, dict):  # a DatasetDict
        names = list(data.keys())
        chosen = split or (DEFAULT_SPLIT if DEFAULT_SPLIT in names else names[0] if len(names) == 1 else None)
        if chosen not in names:
            raise DataError(f"{where} holds the splits {names}; pick one with --split (split=...)")
        return data[chosen]
    if split is not None:
        raise DataError(f"{where} holds one dataset, not splits; leave --split out")
    return data


def _rows(data: Any, where: str) -> list[Record]:
    return [(f"{where}: row {i}", row) for i, row in enumerate(data)]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no detail"
