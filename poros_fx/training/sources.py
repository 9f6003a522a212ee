"""What a command line names, resolved: models, data files and LoRA targets.

MODEL_OR_CONFIG is a built-in shape (qwen2.5-0.5b, -7b, -32b, -72b; qwen3.5-27b and gemma-4-31b from
``models/configs/``), a ``config.json`` or a folder
holding one, or a hub id already in the local huggingface cache; nothing is downloaded. A data file is
tokenized with the tokenizer saved beside the model, when there is one. Shared by check, dump, train
and eval so that they read a name the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import PorosConfigError
from ..handles import text_config
from ..io.data import load_dataset
from ..io.loader import resolve_folder
from ..models.tiny import SHAPE_CONFIGS, lora_targets, qwen25_config, shape_config

if TYPE_CHECKING:
    import transformers

    from ..io.data import TokenDataset

BUILTIN = ("qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", *SHAPE_CONFIGS)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def load_config(model_or_config: str) -> "transformers.PretrainedConfig":
    """A transformers config from a built-in name, a config.json, a folder, or the local hub cache."""
    import transformers

    if model_or_config.lower() in SHAPE_CONFIGS:
        return shape_config(model_or_config.lower())
    if model_or_config.lower() in BUILTIN:
        return qwen25_config(model_or_config.lower().split("-", 1)[1])
    path = Path(model_or_config)
    if path.is_file():
        return _read_config(path.parent if path.name == "config.json" else path, path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise PorosConfigError(f"{path} has no config.json")
        return _read_config(path, path / "config.json")
    try:
        return transformers.AutoConfig.from_pretrained(model_or_config, local_files_only=True)
    except OSError:
        raise PorosConfigError(
            f"{model_or_config!r} is not a built-in shape ({', '.join(BUILTIN)}), a config.json, a folder, or a "
            "model in the local huggingface cache; poros-fx downloads nothing here") from None


def _read_config(source: Path, file: Path) -> "transformers.PretrainedConfig":
    """``AutoConfig.from_pretrained(source)``, its failures (bad JSON, no ``model_type``, a value transformers
    refuses) as one line naming ``file``."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(source)
    except Exception as e:  # bad JSON, no model_type, a value of the wrong type (huggingface_hub's validation)
        reason = " ".join(str(e).split())
        if isinstance(e, KeyError) or "model_type" in reason or "Unrecognized model" in reason:
            reason = f"no known model_type ({reason})"
        raise PorosConfigError(f"{file}: not a readable model config: {reason}; fix the file (it is JSON with a "
                               f"model_type key, as save_pretrained writes it)") from None


def seq_len_limit(config: "transformers.PretrainedConfig") -> Optional[int]:
    """The longest sequence ``config``'s positions cover: ``max_position_embeddings``, extended by a RoPE
    scaling factor (of ``original_max_position_embeddings`` where the config names it); None when the config
    states no limit."""
    text = text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    scaled = limit
    for rope in _rope_settings(text):
        factor = rope.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            original = rope.get("original_max_position_embeddings") or limit
            scaled = max(scaled, int(original * factor))
    return scaled


def _rope_settings(config: "transformers.PretrainedConfig") -> list[dict]:
    """The config's RoPE settings: ``rope_scaling`` / ``rope_parameters``, one dict or one per layer type."""
    found = []
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found.extend(nested or [value])
    return found


def check_seq_len(config: "transformers.PretrainedConfig", seq_len: int, model: str) -> None:
    """Refuse a ``--seq-len`` beyond the positions ``model``'s config covers (``seq_len_limit``)."""
    limit = seq_len_limit(config)
    if limit is not None and seq_len > limit:
        text = text_config(config)
        how = ("max_position_embeddings" if limit == text.max_position_embeddings else
               f"max_position_embeddings {text.max_position_embeddings} with its RoPE scaling factor")
        raise PorosConfigError(f"--seq-len {seq_len} is beyond what {model} covers: {limit} positions ({how}); give "
                               f"--seq-len {limit} or less")


def set_layers(config: "transformers.PretrainedConfig", layers: int) -> None:
    """``config`` cut to its first ``layers`` decoder layers (per-layer lists such as Gemma 3's
    ``layer_types`` cut with it)."""
    config.num_hidden_layers = layers
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) > layers:
        config.layer_types = kinds[:layers]


def model_source(spec: str) -> tuple[bool, Optional[Path]]:
    """``(has_checkpoint, folder)`` for eval's MODEL: a folder (or cached hub id) with weight files is a
    checkpoint; a built-in shape, a config.json or a folder holding only a config means random weights."""
    if spec.lower() in BUILTIN:  # as load_config reads it
        return False, None
    path = Path(spec)
    if path.is_file():
        return False, path.parent
    folder = path if path.is_dir() else resolve_folder(spec)
    weights = [f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES or f.name.endswith(".index.json")]
    return bool(weights), folder


def train_source(model: Optional[str], from_config: Optional[str]
                 ) -> tuple["transformers.PretrainedConfig", Optional[Path]]:
    """``(config, folder)`` for train's MODEL (a checkpoint folder or cached hub id) or ``--from-config``
    (random weights); ``folder`` is where a tokenizer may be saved, None for a built-in shape."""
    if model is not None:
        folder: Optional[Path] = resolve_folder(model)
        return load_config(str(folder)), folder
    config = load_config(from_config)
    path = Path(from_config)
    folder = path if path.is_dir() else path.parent if path.is_file() else None
    if folder is None and from_config.lower() not in BUILTIN:
        folder = resolve_folder(from_config)  # a cached hub id: its snapshot may hold a tokenizer
    return config, folder


def as_path(value: Optional[str]) -> Optional[str]:
    """An existing path made absolute (a resumed run may start elsewhere); anything else (a hub id, a
    built-in shape, ``demo``) as written."""
    if value is None or value.lower() in (*BUILTIN, "demo") or not Path(value).exists():
        return value  # names are read as names first (load_config, load_dataset), whatever the folder holds
    return str(Path(value).resolve())


def read_data(data: str, config: "transformers.PretrainedConfig", folder: Optional[Path], shape: Optional[str],
              seq_len: int, pack: bool, train_on: str = "completion", split: Optional[str] = None,
              tokenizer: "Optional[transformers.PreTrainedTokenizerBase]" = None) -> "TokenDataset":
    """The dataset of ``data``, tokenized with ``tokenizer`` (default: the one saved in ``folder``, if any)."""
    if tokenizer is None:
        tokenizer = tokenizer_of(folder)
    hint = f" in {folder}" if folder is not None else f" for the built-in shape {shape}"
    return load_dataset(data, seq_len=seq_len, vocab_size=config.vocab_size, tokenizer=tokenizer, pack=pack,
                        tokenizer_hint=hint, train_on=train_on, split=split)


def tokenizer_of(folder: Optional[Path]) -> "Optional[transformers.PreTrainedTokenizerBase]":
    """The tokenizer saved in ``folder``, or None when the folder has no tokenizer files."""
    if folder is None or not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PorosConfigError(f"{folder} has tokenizer files but transformers cannot load them ({e}); fix or remove "
                               f"them") from None


def save_tokenizer(tokenizer: "Optional[transformers.PreTrainedTokenizerBase]", folder: Path) -> None:
    """The tokenizer's files next to an adapter (so the folder is self-contained for inference)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def split_targets(values: "Optional[list[str] | str]") -> list[str]:
    """``--target-modules`` as given: repeated options and comma-separated lists both work; one string is
    one comma-separated list."""
    if isinstance(values, str):
        values = [values]
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


ALL_LINEAR = "all-linear"  # peft's name for every linear but the output head: a decoder layer's linears here


def target_modules(values: "Optional[list[str] | str]", model_type: str) -> list[str]:
    """The LoRA targets of ``--target-modules``, or every linear of a decoder layer when none are given (or
    ``all-linear``)."""
    names = split_targets(values)
    if not names or names == [ALL_LINEAR]:
        return lora_targets(model_type)
    return names


def check_targets(targets: list[str], config: "transformers.PretrainedConfig") -> None:
    """Refuse LoRA targets that match no module of ``config``'s model (peft matches a name or a dotted suffix
    of one), listing the linear layers' names; the model is built on ``meta``, no weight is read."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # a model transformers cannot build: the loader says why, with its own checks
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise PorosConfigError(f"--target-modules {', '.join(missing)}: no module of this {config.model_type} model "
                               f"has that name; its linear layers are {', '.join(linear)} (or give {ALL_LINEAR})")
