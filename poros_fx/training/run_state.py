"""The resume state of ``poros-fx train``: what is saved, how it is written and read back, and what a
resumed run may change.

``STATE_FILE`` lies next to the adapter in ``--out`` (written at the end, every ``--save-every`` steps
and on Ctrl-C); ``train --resume OUT`` continues from it, bit-exact with a run that was never stopped.
It is safetensors, so nothing is pickled: the adapter tensors, the optimizer state per parameter and the
RNG states as tensors; the step, the losses, a fingerprint of the data and the run's settings (so that
``--resume OUT`` needs nothing else) as JSON metadata. A resumed run that would change a bit of the
result (other options, other data) is refused by name instead of continuing into something else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import PorosConfigError
from ..io.loader import LoaderError, read_safetensors_header
from .options import MOVABLE, RESUMABLE
from .sources import as_path, split_targets

if TYPE_CHECKING:
    from ..io.data import TokenDataset

STATE_FILE = "poros_state.safetensors"  # what `train --resume` continues from (written next to the adapter)
_STATE_KEY = "poros_fx_train_state"
_STATE_VERSION = 1
# files a run writes into its folder (what --overwrite replaces; nothing else there is touched)
RUN_FILES = ("adapter_model.safetensors", STATE_FILE, "metrics.jsonl", "run.toml",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
             "merges.txt", "added_tokens.json", "tokenizer.model")
CHECKPOINT_PREFIX = "checkpoint-"
SAVE_PREFIX = ".poros-save-"  # the temporary folder a save writes into, renamed into place (save_train_state)
# what a run leaves before its first save (steps logged, a save cut short): no run to resume or protect
UNSAVED_RUN = ("metrics.jsonl", "tensorboard")

Named = list[tuple[str, nn.Parameter]]  # the trainable parameters with their names, in the model's order


def fingerprint(dataset: "TokenDataset") -> str:
    """sha256 of a dataset's rows and labels: a resumed run checks that it reads the same data."""
    digest = hashlib.sha256()
    for t in (dataset.input_ids, dataset.labels):
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(folder: Path) -> str:
    """sha256 of a checkpoint folder's config.json and its safetensors headers (every tensor's name, dtype,
    shape and offsets; not the weights' bytes, which would take minutes at 32B): a moved model given again
    on resume is checked to be the same checkpoint."""
    digest = hashlib.sha256()
    if (folder / "config.json").is_file():
        digest.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(size, 100_000_000)))
    return digest.hexdigest()


def checkpoint_folder(out: Path, step: int) -> Path:
    """Where ``save_every`` with ``save_total_limit`` keeps the save of ``step``."""
    return out / f"{CHECKPOINT_PREFIX}{step}"


def keep_checkpoints(out: Path, limit: int) -> None:
    """Remove all but the newest ``limit`` ``checkpoint-STEP`` folders of ``out``."""
    found = sorted((int(p.name[len(CHECKPOINT_PREFIX):]), p) for p in out.glob(f"{CHECKPOINT_PREFIX}*")
                   if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit())
    for _, path in found[:max(0, len(found) - limit)]:
        shutil.rmtree(path)


def remove_stale_saves(out: Path) -> None:
    """Remove the temporary folders of saves that a kill cut short (``SAVE_PREFIX``) from ``out``."""
    for path in out.glob(f"{SAVE_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def stopped_before_first_save(out: Path) -> bool:
    """Whether ``out`` holds only what a run stopped before its first save leaves (its metrics, a save's
    temporary folder): no saved step, so no run."""
    entries = list(out.iterdir()) if out.is_dir() else []
    return bool(entries) and all(p.name in UNSAVED_RUN or p.name.startswith(SAVE_PREFIX) for p in entries)


def claim_out(out: Path, overwrite: bool) -> None:
    """Make ``out`` the new run's folder: refused when it holds anything, unless ``overwrite`` (then the files a run
    writes are removed, nothing else) or it holds only what a run stopped before its first save left (removed)."""
    if out.exists() and not out.is_dir():
        raise PorosConfigError(f"--out {out} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite and not stopped_before_first_save(out):
        what = "a poros-fx run (adapter and resume state)" if (out / STATE_FILE).is_file() else "files"
        raise PorosConfigError(f"--out {out} exists and holds {what}; pass --overwrite to replace it, "
                               f"--resume {shlex.quote(str(out))} to continue that run, or pick a new folder")
    if (out / "adapter_config.json").is_file():  # peft's README.md (model card) goes with its adapter
        for name in ("adapter_config.json", "README.md"):
            (out / name).unlink(missing_ok=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in [*out.glob(f"{CHECKPOINT_PREFIX}*"), out / "tensorboard"]:
        if folder.is_dir():
            shutil.rmtree(folder)
    remove_stale_saves(out)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a step draws from (dropout masks): the CPU's, and the CUDA device's when it computes there."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        if "cuda" not in state:
            raise PorosConfigError("the saved run has no CUDA generator state (it ran on the CPU); resume it with --device "
                                   "cpu")
        torch.cuda.set_rng_state(state["cuda"], device)


def save_train_state(out: Path, model: nn.Module, named: Named, optimizer: torch.optim.Optimizer,
                     rng: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write the adapter (peft's ``save_pretrained``) and ``STATE_FILE`` into ``out``, atomically: both are
    written into a temporary folder inside ``out`` and renamed into place, the state last, so an interrupted
    save leaves the previous files whole. ``STATE_FILE`` is safetensors (nothing is pickled): the adapter
    tensors of the same step, the optimizer state per parameter, the RNG states, and the step, data
    position, losses and the run's settings as JSON metadata."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=SAVE_PREFIX, dir=out))
    try:
        model.save_pretrained(tmp)
        tensors = {f"adapter/{name}": p.detach().to("cpu").contiguous().clone() for name, p in named}
        scalars: dict[str, dict] = {}
        for index, per_param in optimizer.state_dict()["state"].items():
            for key, value in per_param.items():
                if hasattr(value, "detach"):
                    tensors[f"optimizer/{index}/{key}"] = value.detach().to("cpu").contiguous().clone()
                else:
                    scalars.setdefault(str(index), {})[key] = value
        for kind, value in rng.items():
            tensors[f"rng/{kind}"] = value.clone()
        meta = {**meta, "version": _STATE_VERSION, "params": [name for name, _ in named], "optimizer_scalars": scalars}
        save_file(tensors, str(tmp / STATE_FILE), metadata={_STATE_KEY: json.dumps(meta)})
        for path in sorted(tmp.iterdir(), key=lambda f: f.name == STATE_FILE):  # the state last
            if path.is_file():
                os.replace(path, out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_train_state(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of a run's ``STATE_FILE`` (see ``save_train_state``)."""
    from safetensors import safe_open

    path = folder / STATE_FILE
    if not folder.is_dir():
        raise PorosConfigError(f"--resume {folder}: no such folder (give the --out folder of the run to continue)")
    if not path.is_file() and stopped_before_first_save(folder):
        raise PorosConfigError(f"{folder} holds a run stopped before its first save: no step was saved, so there is "
                               f"nothing to resume; start the run again with the same command (--out "
                               f"{shlex.quote(str(folder))} may be given again)")
    if not path.is_file():
        raise PorosConfigError(f"{folder} has no {STATE_FILE}, so it cannot be resumed: it was not written by `poros-fx train` "
                   f"(or by a version before --resume); start a new run with --out")
    try:
        read_safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_STATE_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except LoaderError as e:
        raise PorosConfigError(str(e)) from None
    except Exception as e:  # safetensors' own errors, a missing or broken metadata entry: the file, in one line
        raise PorosConfigError(f"{path}: not a readable poros-fx train state ({type(e).__name__}: {e}); the run cannot be "
                               f"resumed from it") from None
    if meta.get("version") != _STATE_VERSION:
        raise PorosConfigError(f"{path}: train state version {meta.get('version')!r}, this poros-fx reads {_STATE_VERSION}")
    return meta, tensors


def resume_settings(given: dict[str, Any], typed: Callable[[str], bool], folder: Path
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """``(run, meta, tensors)``: the saved run's settings with what this command line may change applied
    (``given``: the train command's options; ``typed(name)``: whether the user wrote that one), and the
    state they come from. A moved model or data file may be given again (``MOVABLE``: checked by hash
    when the run is set up); an option that would change the result (LoRA, optimizer, schedule, precision,
    device, seed) is refused by name."""
    meta, tensors = load_train_state(folder)
    run = dict(meta["run"])
    conflicts = []
    for name, value in given.items():
        if not typed(name):
            continue
        if name in RESUMABLE:
            run[name] = value
            continue
        if name in MOVABLE:
            run[name] = as_path(value)
            continue
        saved = run.get(name)
        if name == "from_config":
            value = as_path(value)
        elif name == "target_modules":
            value = split_targets(value) or None
        elif name == "device":
            value = torch.device(value).type
        if value != saved:
            conflicts.append(f"--{name.replace('_', '-')} {value} (the run has {saved})")
    if conflicts:
        raise PorosConfigError(
            f"--resume {folder} continues a run with its own settings, and these would change its result: "
            f"{'; '.join(conflicts)}. Leave them out (a moved model or data file may be given again with --model / "
            f"--data; --steps/--epochs, --block-size, --prefetch, --memory-budget, --block-major, --save-activations, "
            f"--eval-data, "
            f"--eval-every, --log-every, --save-every, --save-total-limit and --out may change), or start a new run")
    if given.get("epochs") is not None and typed("epochs"):
        run["steps"] = None  # recomputed from the data below
    if run.get("schedule", "constant") != "constant" and (typed("steps") or typed("epochs")) \
            and run.get("steps") != meta["steps"]:
        raise PorosConfigError(f"--resume {folder}: the run's {run['schedule']} schedule decays over its {meta['steps']} "
                               f"steps, so the steps it took used those learning rates; extending it would not be "
                               f"the run of {run.get('steps') or 'N'} steps. Resume it to its own end, or start a new "
                               f"run")
    _follow_model(run, folder)
    return run, meta, tensors


def _follow_model(run: dict[str, Any], folder: Path) -> None:
    """The run's model folder, where it is now: the saved path, or the one given again (the same checkpoint, by
    ``model_fingerprint``)."""
    model = run.get("model")
    if model is None or not Path(model).is_absolute():  # a built-in shape, a config, a hub id: read as a name
        return
    path = Path(model)
    if not path.is_dir():
        raise PorosConfigError(f"--resume {folder}: the run's model folder {path} is gone (moved?); give it again "
                               f"with --model NEW_PATH (checked to be the same checkpoint)")
    saved = run.get("model_sha256")
    if saved is not None and model_fingerprint(path) != saved:
        raise PorosConfigError(f"--resume {folder}: {path} is not the checkpoint the run trained on (its config or "
                               f"tensor layout differ); give the run's model with --model")


def check_resumable(meta: dict[str, Any], data_sha256: str, steps: int, folder: Path, source: str) -> int:
    """The step the saved run finished, once its data is known to be the same (``data_sha256``, see
    ``fingerprint``) and ``steps`` to go beyond it."""
    done = meta["step"]
    if meta["data_sha256"] != data_sha256:
        raise PorosConfigError(f"--resume {folder}: the data ({source}) is not what the run trained on (its rows "
                               f"differ); a resumed run reads the same data (a moved file: give it with --data)")
    if done >= steps:
        raise PorosConfigError(f"the run in {folder} has finished its {done} steps; pass --steps N (N > {done}) to "
                               f"train it further")
    return done


def restore(meta: dict[str, Any], tensors: dict[str, torch.Tensor], named: Named, optimizer: torch.optim.Optimizer,
            device: torch.device, path: Path) -> list[float]:
    """The saved step into the freshly built run: adapter weights, optimizer state and RNG states; returns
    the losses of the steps done."""
    names = [name for name, _ in named]
    if names != meta["params"]:
        raise PorosConfigError(f"{path}: the saved adapter has {len(meta['params'])} parameters, the model built for the resumed "
                   f"run {len(names)} (not the same model or LoRA settings?)")
    with torch.no_grad():
        for name, p in named:
            saved = tensors[f"adapter/{name}"]
            if saved.shape != p.shape or saved.dtype != p.dtype:
                raise PorosConfigError(f"{path}: {name} is {saved.dtype} {list(saved.shape)} there, {p.dtype} {list(p.shape)} in "
                           f"the model built for the resumed run")
            p.copy_(saved)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            state.setdefault(int(index), {})[name] = value
    for index, scalars in meta.get("optimizer_scalars", {}).items():
        state.setdefault(int(index), {}).update(scalars)
    full = optimizer.state_dict()
    full["state"] = state  # the param groups (lr, betas, ...) are the run's own settings, rebuilt the same
    optimizer.load_state_dict(full)
    _set_rng_state({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("rng/")}, device)
    return list(meta["losses"])
