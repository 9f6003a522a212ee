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
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .sources import as_path, split_targets
from .terminal import fail

if TYPE_CHECKING:
    from ..io.data import TokenDataset

STATE_FILE = "poros_state.safetensors"  # what `train --resume` continues from (written next to the adapter)
_STATE_KEY = "poros_fx_train_state"
_STATE_VERSION = 1
# what a resumed run may change: neither touches a bit of the result (the data order does not depend on the
# step count, and streaming is exact whatever the block size and prefetch)
RESUMABLE = ("steps", "epochs", "block_size", "prefetch", "memory_budget", "block_major", "log_every", "save_every",
             "out")
# the run's settings, kept in the state so that `--resume OUT` needs nothing else
SETTINGS = ("model", "from_config", "data", "quantization", "lora_r", "lora_alpha", "lora_dropout", "target_modules",
            "lr", "weight_decay", "seq_len", "pack", "batch_size", "accumulate", "codegen", "device", "seed",
            "block_size", "prefetch")

Named = list[tuple[str, nn.Parameter]]  # the trainable parameters with their names, in the model's order


def fingerprint(dataset: "TokenDataset") -> str:
    """sha256 of a dataset's rows and labels: a resumed run checks that it reads the same data."""
    digest = hashlib.sha256()
    for t in (dataset.input_ids, dataset.labels):
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
            raise fail("the saved run has no CUDA generator state (it ran on the CPU); resume it with --device cpu")
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
    tmp = Path(tempfile.mkdtemp(prefix=".poros-save-", dir=out))
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

    from ..io.loader import LoaderError, read_safetensors_header

    path = folder / STATE_FILE
    if not folder.is_dir():
        raise fail(f"--resume {folder}: no such folder (give the --out folder of the run to continue)")
    if not path.is_file():
        raise fail(f"{folder} has no {STATE_FILE}, so it cannot be resumed: it was not written by `poros-fx train` "
                   f"(or by a version before --resume); start a new run with --out")
    try:
        read_safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_STATE_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except LoaderError as e:
        raise fail(str(e))
    except Exception as e:  # safetensors' own errors, a missing or broken metadata entry: the file, in one line
        raise fail(f"{path}: not a readable poros-fx train state ({type(e).__name__}: {e}); the run cannot be "
                   f"resumed from it")
    if meta.get("version") != _STATE_VERSION:
        raise fail(f"{path}: train state version {meta.get('version')!r}, this poros-fx reads {_STATE_VERSION}")
    return meta, tensors


def resume_settings(given: dict[str, Any], typed: Callable[[str], bool], folder: Path
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """``(run, meta, tensors)``: the saved run's settings with what this command line may change applied
    (``given``: the train command's options; ``typed(name)``: whether the user wrote that one), and the
    state they come from. An option that would change the result (model, data, LoRA, optimizer,
    precision, device, seed) is refused by name."""
    meta, tensors = load_train_state(folder)
    run = dict(meta["run"])
    conflicts = []
    for name, value in given.items():
        if not typed(name):
            continue
        if name in RESUMABLE:
            run[name] = value
            continue
        saved = run.get(name)
        if name in ("model", "from_config", "data"):
            value = as_path(value)
        elif name == "target_modules":
            value = split_targets(value) or None
        elif name == "device":
            value = torch.device(value).type
        if value != saved:
            conflicts.append(f"--{name.replace('_', '-')} {value} (the run has {saved})")
    if conflicts:
        raise fail(f"--resume {folder} continues a run with its own settings, and these would change its result: "
                   f"{'; '.join(conflicts)}. Leave them out (only --steps/--epochs, --block-size, --prefetch, "
                   f"--memory-budget, --block-major, --log-every, --save-every and --out may change), or start a new run")
    if given.get("epochs") is not None and typed("epochs"):
        run["steps"] = None  # recomputed from the data below
    return run, meta, tensors


def check_resumable(meta: dict[str, Any], data_sha256: str, steps: int, folder: Path, source: str) -> int:
    """The step the saved run finished, once its data is known to be the same (``data_sha256``, see
    ``fingerprint``) and ``steps`` to go beyond it."""
    done = meta["step"]
    if meta["data_sha256"] != data_sha256:
        raise fail(f"--resume {folder}: the data ({source}) is not what the run trained on (its rows "
                   f"changed since); a resumed run must read the same data")
    if done >= steps:
        raise fail(f"the run in {folder} has finished its {done} steps; pass --steps N (N > {done}) to train "
                   f"it further")
    return done


def restore(meta: dict[str, Any], tensors: dict[str, torch.Tensor], named: Named, optimizer: torch.optim.Optimizer,
            device: torch.device, path: Path) -> list[float]:
    """The saved step into the freshly built run: adapter weights, optimizer state and RNG states; returns
    the losses of the steps done."""
    names = [name for name, _ in named]
    if names != meta["params"]:
        raise fail(f"{path}: the saved adapter has {len(meta['params'])} parameters, the model built for the resumed "
                   f"run {len(names)} (not the same model or LoRA settings?)")
    with torch.no_grad():
        for name, p in named:
            saved = tensors[f"adapter/{name}"]
            if saved.shape != p.shape or saved.dtype != p.dtype:
                raise fail(f"{path}: {name} is {saved.dtype} {list(saved.shape)} there, {p.dtype} {list(p.shape)} in "
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
