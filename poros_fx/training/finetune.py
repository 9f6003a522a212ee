"""``FineTuner``: the five-line path, on the same loop as ``poros-fx train`` (``training/loop.py``).

    from poros_fx import FineTuner

    tuner = FineTuner.from_pretrained("Qwen/Qwen2.5-32B", quantization="nf4", lora_rank=16, lora_alpha=32)
    tuner.train("chat.jsonl", steps=200, seq_len=512)      # a file, folder, cached dataset id, or "synthetic"
    tuner.save("qwen32b-lora")                              # adapter + tokenizer + run.toml

``from_pretrained`` loads the model (a checkpoint folder or a hub id already in the local cache; a
built-in shape such as ``"qwen2.5-0.5b"`` or a ``config.json`` gives random weights), streams its frozen
base from the host store and attaches a LoRA adapter on every linear of a decoder layer. ``train``
takes every option of ``poros-fx train`` as a keyword (``lr``, ``warmup_steps``, ``schedule``,
``max_grad_norm``, ``eval_data``, ``eval_every``, ``accumulate``, ``out``, ``save_every``, ...) and runs
``train_run.train`` on the loaded model: a ``FineTuner`` and the command with the same settings train
the same bits. Errors raise ``PorosError`` subclasses.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from torch import nn

from ..errors import PorosConfigError, PorosError
from .run_config import RUN_CONFIG_FILE, write_run_config
from .run_state import claim_out
from .sources import as_path, model_source, save_tokenizer
from .loop import Session, TrainResult, load_model, train
from .options import MODEL_OPTIONS, TrainOptions

# from_pretrained's keywords: what builds the model (lora_rank, as the seed spells lora_r)
_LOAD_NAMES = {("lora_rank" if name == "lora_r" else name): name for name in MODEL_OPTIONS
               if name not in ("model", "from_config")}


class FineTuner:
    """A prepared model with a LoRA adapter, trained by ``train`` and written by ``save``."""

    def __init__(self, session: Session, opts: TrainOptions) -> None:
        self.session = session
        self.opts = opts  # the settings of the model, and of the last train() call
        self.result: Optional[TrainResult] = None

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, *, quantization: str = "nf4", lora_rank: int = 16,
                        lora_alpha: float = 32.0, **kwargs: Any) -> "FineTuner":
        """Load ``model`` streamed (see the module docstring); ``kwargs``: the other options that build the
        model (``training/options.py``'s ``MODEL_OPTIONS``: ``lora_dropout``, ``target_modules``, ``device``,
        ``seed`` and the streaming options ``prepare`` takes: ``block_size``, ``prefetch``, ``codegen``,
        ``memory_budget``, ...)."""
        unknown = sorted(set(kwargs) - set(_LOAD_NAMES))
        if unknown:
            raise PorosConfigError(f"FineTuner.from_pretrained: unknown argument(s) {', '.join(unknown)}; known: "
                                   f"{', '.join(sorted(_LOAD_NAMES))}")
        settings = {_LOAD_NAMES[k]: v for k, v in {"quantization": quantization, "lora_rank": lora_rank,
                                                   "lora_alpha": lora_alpha, **kwargs}.items()}
        opts = TrainOptions(**settings, **_source(str(model)))
        opts.check()
        return cls(load_model(opts), opts)

    @property
    def model(self) -> nn.Module:
        """The prepared PEFT model (its base in the host store)."""
        return self.session.model

    @property
    def tokenizer(self) -> Any:
        return self.session.tokenizer

    def train(self, data: str | os.PathLike, *, overwrite: bool = False, **kwargs: Any) -> TrainResult:
        """Train on ``data`` (a file, a ``save_to_disk`` folder, a cached dataset id, or ``"synthetic"``);
        ``kwargs``: the options of ``poros-fx train`` (``steps``, ``epochs``, ``seq_len``, ``lr``, ...). An ``out``
        folder that holds anything is refused unless ``overwrite`` (as the command's ``--out``)."""
        names = {f.name for f in dataclasses.fields(TrainOptions)}
        unknown = sorted(set(kwargs) - names)
        fixed = sorted(set(kwargs) & set(MODEL_OPTIONS))
        if unknown or fixed:
            raise PorosConfigError(f"FineTuner.train: {'unknown' if unknown else 'load-time'} argument(s) "
                                   f"{', '.join(unknown or fixed)}" + ("" if unknown else " (give them to "
                                                                       "from_pretrained)"))
        model_settings = {name: getattr(self.opts, name) for name in MODEL_OPTIONS}
        out = kwargs.pop("out", None)
        self.opts = TrainOptions(**model_settings, data=str(data),
                                 out=Path(out) if out is not None else None, **kwargs)
        self.opts.check()
        if self.opts.out is not None:
            claim_out(self.opts.out, overwrite)
        self.result = train(self.opts, session=self.session)
        return self.result

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the adapter (a standard PEFT adapter), the tokenizer and ``run.toml`` (the settings, as
        ``poros-fx train --config`` reads them, its paths absolute) into ``folder``. (``train(..., out=DIR)`` also writes the resume
        state there, for ``poros-fx train --resume DIR``.)"""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder)
        save_tokenizer(self.tokenizer, folder)
        settings = {f.name: getattr(self.opts, f.name) for f in dataclasses.fields(TrainOptions)}
        settings["out"] = None
        for name in ("model", "from_config", "data", "eval_data"):  # `--config` may be read from any folder
            settings[name] = as_path(settings[name])
        write_run_config(folder / RUN_CONFIG_FILE, settings)
        return folder


def _source(model: str) -> dict[str, Optional[str]]:
    """``model`` as a checkpoint (folder or cached hub id) or a random-weight source (a built-in shape, a
    config.json, a folder holding only a config)."""
    try:
        checkpoint, _ = model_source(model)
    except PorosError:  # not a folder and not a cached hub id: load_model says why, as for a checkpoint
        checkpoint = True
    return {"model": model, "from_config": None} if checkpoint else {"model": None, "from_config": model}

