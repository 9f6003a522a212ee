"""A training run's options, declared once: ``TrainOptions``.

Each field carries its help, its check and what it is to a run: whether ``--resume`` may change it
(``RESUMABLE``: no bit of the result depends on it; ``MOVABLE``: the model or data given again where the
files moved; the rest would change the result and are refused), whether ``run.toml`` keeps it
(``CONFIG_KEYS``) and whether it builds the model (``MODEL_OPTIONS``: ``FineTuner.from_pretrained``
takes them, ``FineTuner.train`` may not change them). The streaming options are ``PorosOptions``'
fields, with their help, checks and resume class (``same_bits``) from there, and the trainers' defaults
(``TRAINER_DEFAULTS``) where they differ from ``prepare``'s. ``poros-fx train``'s flags are made from
these declarations (``cli/flags.py``), as are the run's record and ``run.toml``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import PorosConfigError
from ..options import PREPARE_DEFAULTS, TRAINER_DEFAULTS, PorosOptions, device_problem, resolve_device
from .schedules import SCHEDULES

FIXED, SAME_BITS, MOVED = "fixed", "same_bits", "movable"  # what --resume may do with an option


def _at_least(low: float, *, above: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or (value <= low if above else value < low)):
            raise PorosConfigError(f"{name} must be {'above' if above else 'at least'} {low:g}, got {value!r}")
    return check


def _integer(low: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise PorosConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return check


def _one_of(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise PorosConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return check


def _text(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, Path)):
        raise PorosConfigError(f"{name} must be a string, got {value!r}")


def _device(name: str, value: Any) -> None:
    problem = None if value is None else device_problem(str(value))
    if problem is not None:
        raise PorosConfigError(f"{name} {problem}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PorosConfigError(f"{name} must be true or false, got {value!r}")


def _names(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, str) or (isinstance(value, (list, tuple))
                                                             and all(isinstance(v, str) for v in value))):
        raise PorosConfigError(f"{name} must be a list of module names (or one string), got {value!r}")


def _probability(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise PorosConfigError(f"{name} must be between 0 and 1, got {value!r}")


def _run_option(default: Any, help: str, check: Callable[[str, Any], None], *, resume: str = FIXED,
                config: bool = True, model: bool = False) -> Any:
    """One option's declaration: ``help`` and ``check`` as for ``PorosOptions``; ``resume``: ``FIXED``,
    ``SAME_BITS`` or ``MOVED``; ``config``: ``run.toml`` keeps it; ``model``: it builds the model."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "resume": resume,
                                                        "config": config, "model": model})


_RUN_FIELDS: list[tuple[str, Any, Any]] = [
    ("model", Optional[str], _run_option(
        None, "model folder (save_pretrained layout) or cached hub id", _text, resume=MOVED, model=True)),
    ("from_config", Optional[str], _run_option(
        None, "random weights from a built-in shape or a config.json instead of MODEL (smoke tests)", _text,
        model=True)),
    ("data", Optional[str], _run_option(
        None, "a .jsonl, .json, .csv or .parquet file, a Dataset.save_to_disk folder, a dataset id in the local "
        "datasets cache (--split), or 'demo' (alias 'synthetic') for the built-in token set; records with "
        "messages, prompt + completion (or response), text, or input_ids", _text, resume=MOVED)),
    ("out", Optional[Path], _run_option(
        None, "folder for the PEFT adapter, its tokenizer, run.toml, metrics.jsonl and the state --resume reads; "
        "refused when it holds a run, unless --overwrite or --resume (the folder of a run stopped before its first "
        "save holds no run and is reused)", _text, resume=SAME_BITS, config=False)),
    ("quantization", str, _run_option("nf4", "nf4 (QLoRA base) or bf16", _one_of("nf4", "bf16"), model=True)),
    ("lora_r", int, _run_option(16, "LoRA rank", _integer(1), model=True)),
    ("lora_alpha", float, _run_option(32.0, "LoRA alpha (the scale is alpha / r)", _at_least(0), model=True)),
    ("lora_dropout", float, _run_option(0.05, "dropout on the LoRA branch's input", _probability, model=True)),
    ("target_modules", Optional[list[str]], _run_option(
        None, "LoRA targets, repeated or comma-separated; a name no module has is refused (default, or all-linear: "
        "every linear of a decoder layer)", _names,
        model=True)),
    ("steps", Optional[int], _run_option(None, "optimizer steps (default: --epochs 1)", _integer(1),
                                         resume=SAME_BITS)),
    ("epochs", Optional[float], _run_option(None, "passes over the data (above 0; rounded up to whole steps)",
                                            _at_least(0, above=True), resume=SAME_BITS, config=False)),
    ("lr", float, _run_option(2e-4, "peak learning rate (AdamW)", _at_least(0))),
    ("weight_decay", float, _run_option(0.0, "AdamW weight decay", _at_least(0))),
    ("warmup_steps", int, _run_option(0, "steps of linear warmup from 0 to --lr", _integer(0))),
    ("schedule", str, _run_option("constant", "learning rate after warmup: constant, linear or cosine (decaying "
                                  "to 0 at the last step)", _one_of(*SCHEDULES))),
    ("max_grad_norm", Optional[float], _run_option(
        None, "clip the adapter's gradients to this total norm (default: no clipping)", _at_least(0, above=True))),
    ("seq_len", int, _run_option(512, "tokens per row", _integer(2))),
    ("pack", bool, _run_option(True, "pack examples end to end into rows (--no-pack: one example per row, "
                               "truncated)", _flag)),
    ("train_on", str, _run_option("completion", "completion: the assistant turns, completions and responses; "
                                  "all: every token", _one_of("completion", "all"))),
    ("split", Optional[str], _run_option(None, "split of a dataset folder or cached id (default: train)", _text)),
    ("batch_size", int, _run_option(1, "rows per micro-batch", _integer(1))),
    ("accumulate", int, _run_option(1, "micro-batches per optimizer step", _integer(1))),
    ("device", Optional[str], _run_option(None, "cpu or cuda (default: cuda when present)", _device, config=False,
                                          model=True)),
    ("seed", int, _run_option(0, "seeds the LoRA init, dropout, data order (and --from-config weights)",
                              _integer(0), model=True)),
    ("eval_data", Optional[str], _run_option(None, "data to evaluate on during training (as --data)", _text,
                                             resume=SAME_BITS)),
    ("eval_every", Optional[int], _run_option(None, "steps between evaluations (default: at the end)", _integer(1),
                                              resume=SAME_BITS)),
    ("save_every", Optional[int], _run_option(
        None, "also save adapter + resume state every N steps (always at the end, and on Ctrl-C or SIGTERM)", _integer(1),
        resume=SAME_BITS)),
    ("save_total_limit", Optional[int], _run_option(
        None, "with --save-every, also keep the newest N saves as OUT/checkpoint-STEP folders", _integer(0),
        resume=SAME_BITS)),
    ("log_every", Optional[int], _run_option(
        None, "steps between log lines when not on a terminal (default: about 10 lines)", _integer(1),
        resume=SAME_BITS)),
    ("metrics", bool, _run_option(True, "write OUT/metrics.jsonl (and TensorBoard events when tensorboard is "
                                  "installed)", _flag, resume=SAME_BITS)),
]


def _streaming_fields() -> list[tuple[str, Any, Any]]:
    """``PorosOptions``' fields as run options: the same help and check, ``prepare``'s defaults (or the
    trainers'), resumable where they leave the bits alone; those set at prepare build the model."""
    fields = []
    for f in dataclasses.fields(PorosOptions):
        default = TRAINER_DEFAULTS.get(f.name, PREPARE_DEFAULTS.get(f.name, f.default))
        fields.append((f.name, f.type, _run_option(
            default, f.metadata["help"], f.metadata["check"], resume=SAME_BITS if f.metadata["same_bits"] else FIXED,
            model=f.name in PREPARE_DEFAULTS)))
    return fields


class _Checks:
    """``TrainOptions``' methods."""

    def check(self) -> None:
        """Refuse settings that cannot run, before anything is loaded: each field's own check, then the
        combinations."""
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        if self.steps is not None and self.epochs is not None:
            raise PorosConfigError("give steps or epochs, not both")
        if self.eval_every is not None and self.eval_data is None:
            raise PorosConfigError("eval_every needs eval_data (the data to evaluate on)")
        if self.least_memory and self.memory_budget == TRAINER_DEFAULTS["memory_budget"]:
            self.memory_budget = None  # the default budget gives way; one asked for is refused just below
        PorosOptions.from_dict(self.streaming_options())
        if self.cuda_graphs and resolve_device(self.device).type != "cuda":
            raise PorosConfigError("cuda_graphs replays CUDA kernels; this run computes on the CPU (leave --cuda-graphs "
                                   "out, or train on a CUDA device)")
        if self.cuda_graphs and self.offload_boundaries:
            raise PorosConfigError("cuda_graphs cannot be combined with offload_boundaries; use one of the two")

    def streaming_options(self) -> dict[str, Any]:
        """Every streaming option of this run, by ``PorosOptions``' names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PorosOptions)}

    def prepare_options(self) -> dict[str, Any]:
        """The streaming options the loader gives ``prepare`` (the model keeps them)."""
        return {name: getattr(self, name) for name in PREPARE_DEFAULTS}

    def step_options(self) -> dict[str, Any]:
        """The streaming options set at compile time (``torch.compile(..., options=...)``)."""
        return {name: value for name, value in self.streaming_options().items() if name not in PREPARE_DEFAULTS}


TrainOptions = dataclasses.make_dataclass(
    "TrainOptions", [*_RUN_FIELDS, *_streaming_fields()], bases=(_Checks,), namespace={"__module__": __name__})
TrainOptions.__doc__ = ("Everything a run is made of: the train command's options, FineTuner's arguments, or the "
                        "settings of the run being resumed; declared in poros_fx/training/options.py.")

OPTION_NAMES = tuple(f.name for f in dataclasses.fields(TrainOptions))
# what a resumed run may change: none touches a bit of the result (the data order does not depend on the
# step count, streaming is exact whatever the block size and prefetch, evaluation draws no random numbers)
RESUMABLE = tuple(f.name for f in dataclasses.fields(TrainOptions) if f.metadata["resume"] == SAME_BITS)
# may be given again where the files moved: the same model (config and tensor layout) and the same rows
MOVABLE = tuple(f.name for f in dataclasses.fields(TrainOptions) if f.metadata["resume"] == MOVED)
# the settings run.toml keeps: what `train --config` reads back
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(TrainOptions) if f.metadata["config"])
# what builds the model: FineTuner.from_pretrained takes them, FineTuner.train may not change them
MODEL_OPTIONS = tuple(f.name for f in dataclasses.fields(TrainOptions) if f.metadata["model"])


def check_setting(name: str, value: Any, source: str) -> None:
    """One setting read from ``source`` (a ``run.toml``): refused in one line naming the file and the key."""
    field = next((f for f in dataclasses.fields(TrainOptions) if f.name == name), None)
    if field is None:
        raise PorosConfigError(f"{source}: unknown setting {name!r}; known: {', '.join(OPTION_NAMES)}")
    try:
        field.metadata["check"](name, value)
    except PorosConfigError as e:
        raise PorosConfigError(f"{source}: {e}") from None


__all__ = ["CONFIG_KEYS", "MODEL_OPTIONS", "MOVABLE", "OPTION_NAMES", "RESUMABLE", "TrainOptions", "check_setting"]
