"""``poros-fx``: the command line (``doctor``, ``check``, ``dump``, ``train``, ``eval``, ``export``, ``bench``).

    poros-fx doctor                      # versions, CUDA, pinned H2D bandwidth, backend="poros" resolves
    poros-fx check qwen2.5-32b           # family status, base bytes per block, predicted resident peak
    poros-fx check ./my-model/config.json --quantization bf16 --block-size 2
    poros-fx dump qwen2.5-7b --layers 2 --out dumps/   # schedule, graphs and timeline without training
    poros-fx train ./my-model --data train.jsonl --out my-adapter --steps 200   # LoRA/QLoRA, streamed
    poros-fx train --from-config qwen2.5-0.5b --data demo --out smoke --steps 5  # random weights, no files
    poros-fx train --resume my-adapter --steps 400   # continue (or extend) a run, bit-exact
    poros-fx eval ./my-model --adapter my-adapter --data valid.jsonl --json eval.json   # loss, perplexity
    poros-fx export my-adapter --base ./my-model -o merged/   # adapter merged into a bf16 copy, streamed

MODEL_OR_CONFIG is a built-in shape (qwen2.5-0.5b, -7b, -32b, -72b), a ``config.json`` or a folder
holding one, or a hub id already in the local huggingface cache (nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="poros-fx: stream a frozen LoRA/QLoRA base "
                  "through the GPU block by block, bit-exact, as a torch.compile backend.")
console = Console()

BUILTIN = ("qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")


def _prefetch(value: str) -> int | str:
    from ..errors import PorosConfigError
    from ..prepare import parse_prefetch

    try:
        return parse_prefetch(value)
    except PorosConfigError as e:
        raise typer.BadParameter(str(e))


def _codegen(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in ("inductor", "eager"):
        raise typer.BadParameter(f"--codegen must be inductor or eager, got {value!r}")
    return value


CODEGEN_OPTION = typer.Option(None, callback=_codegen, help="how decoder-layer regions run: inductor (fused kernels) "
                              "or eager (aten calls, equal to the eager loop); default: the device's (see "
                              "docs/exactness.md)")


PREFETCH_OPTION = typer.Option("auto", callback=_prefetch, help="blocks loaded ahead of the one computing: an "
                               "integer >= 0, or auto (one in the forward; the backward's depth measured in the "
                               "first forward)")


def _device(value: Optional[str]) -> Optional[str]:
    """``--device``: cpu or cuda[:N], and cuda only where torch sees one (refused here, not as a traceback)."""
    if value is None:
        return None
    import torch

    try:
        kind = torch.device(value).type
    except RuntimeError:  # torch cannot parse it
        kind = None
    if kind not in ("cpu", "cuda"):
        raise typer.BadParameter(f"must be cpu or cuda (or cuda:N), got {value!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(f"{value!r} was asked for but torch sees no CUDA device (torch {torch.__version__}); "
                                 "use --device cpu, or leave it out")
    return value


DEVICE_OPTION = typer.Option(None, callback=_device, help="cpu or cuda (default: cuda when present)")


def load_config(model_or_config: str):
    """A transformers config from a built-in name, a config.json, a folder, or the local hub cache."""
    import transformers

    from .tiny import qwen25_config

    if model_or_config.lower() in BUILTIN:
        return qwen25_config(model_or_config.lower().split("-", 1)[1])
    path = Path(model_or_config)
    if path.is_file():
        return transformers.AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise typer.BadParameter(f"{path} has no config.json")
        return transformers.AutoConfig.from_pretrained(path)
    try:
        return transformers.AutoConfig.from_pretrained(model_or_config, local_files_only=True)
    except OSError:
        raise typer.BadParameter(
            f"{model_or_config!r} is not a built-in shape ({', '.join(BUILTIN)}), a config.json, a folder, or a "
            "model in the local huggingface cache; poros-fx downloads nothing here") from None


def _h2d_bandwidth(device: str = "cuda", mib: int = 256, reps: int = 5) -> float:
    import torch

    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return host.numel() / statistics.median(times) / 1e9


@app.command()
def doctor() -> None:
    """Versions, CUDA, measured pinned host-to-device bandwidth, and whether backend="poros" resolves."""
    import importlib.metadata as md

    import torch

    table = Table(title="poros-fx doctor", show_header=False)
    for name in ("poros-fx", "torch", "transformers", "peft", "bitsandbytes", "safetensors"):
        try:
            table.add_row(name, md.version(name))
        except md.PackageNotFoundError:
            table.add_row(name, "[red]not installed[/red]")
    cuda = torch.cuda.is_available()
    table.add_row("cuda", f"{torch.cuda.get_device_name()} (torch CUDA {torch.version.cuda})" if cuda else "no CUDA device")
    table.add_row("pinned H2D", f"{_h2d_bandwidth():.1f} GB/s (256 MiB, median of 5)" if cuda else "- (needs CUDA)")
    try:
        from torch._dynamo.backends.registry import lookup_backend

        from ..compiler.backend import poros

        resolves = lookup_backend("poros") is poros
        table.add_row('backend="poros"', "resolves (entry point torch_dynamo_backends)" if resolves
                      else "[red]resolves to something else[/red]")
    except Exception as err:  # report, do not crash: this is the diagnosis command
        table.add_row('backend="poros"', f"[red]does not resolve: {err}[/red]")
    console.print(table)


@app.command()
def check(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
          quantization: str = typer.Option("nf4", help="nf4 or bf16"),
          block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION) -> None:
    """Family and its status, base bytes per block, and the predicted resident peak of the base. No weights."""
    from ..errors import UnsupportedArchitectureError
    from ..families import resolve
    from ..prepare import AUTO
    from ..runtime.depth import LIMIT
    from ..io.sizes import block_bytes
    from .report import format_bytes

    config = load_config(model_or_config)
    try:
        family = resolve(config.model_type)
    except UnsupportedArchitectureError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    names, sizes = block_bytes(config, quantization, block_size, family)
    console.print(f"{model_or_config}: {config.model_type} ({family.status}), {quantization}, "
                  f"block_size {block_size}")
    table = Table()
    table.add_column("block")
    table.add_column("base bytes", justify="right")
    shown = names if len(names) <= 8 else names[:3] + ["..."] + names[-3:]
    for name in shown:
        table.add_row(name, "" if name == "..." else format_bytes(sizes[names.index(name)]))
    console.print(table)
    console.print(f"base: {format_bytes(sum(sizes))} loaded by {len(names)} blocks per pass (the embedding's rows are "
                  "gathered from the host store, its table is loaded only where the head shares it); "
                  f"largest block {format_bytes(max(sizes))} ({names[sizes.index(max(sizes))]})")
    ahead = 1 if prefetch == AUTO else prefetch
    console.print(f"predicted peak of base weights on the device: (1 + prefetch {ahead}) x largest block = "
                  f"{format_bytes((1 + ahead) * max(sizes))} (adapter, activations and logits come on top)"
                  + ("; prefetch auto loads one block ahead in the forward and deepens the backward only as far as "
                     f"half the free device memory allows (at most {LIMIT} blocks)" if prefetch == AUTO else ""))


@app.command()
def dump(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
         out: Path = typer.Option(Path("poros-dump"), help="folder for graphs, schedule.txt and timeline.png"),
         layers: Optional[int] = typer.Option(None, min=1, help="decoder layers to build (default: the config's; real "
                                              "widths, random init)"),
         seq: int = typer.Option(64, min=1),
         quantization: str = typer.Option("nf4", help="nf4 (QLoRA base, the default of train and check) or bf16"),
         block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
         codegen: Optional[str] = CODEGEN_OPTION, device: Optional[str] = DEVICE_OPTION) -> None:
    """Compile one training step and write its dumps, without training (random weights; --layers builds a slice)."""
    import peft
    import torch

    from ..errors import PorosError
    from ..io.loader import from_config
    from .tiny import demo_batches, lora_targets

    if quantization not in ("nf4", "bf16"):
        raise _fail(f"--quantization must be nf4 or bf16, got {quantization!r}")
    config = load_config(model_or_config)
    if layers is not None:
        _set_layers(config, layers)
    count = config.num_hidden_layers
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets(config.model_type))
    try:
        with console.status(f"building {config.model_type} with {count} layers ({quantization}, random init)"):
            model = from_config(config, quantization=quantization, device=device, seed=0, lora=lora,
                                block_size=block_size, prefetch=prefetch, codegen=codegen, progress=False)
    except PorosError as e:
        hint = "" if layers is not None else f" (dump builds all {count} layers of the config; --layers 2 builds two)"
        raise _fail(f"{e}{hint}")
    model.train()
    dev = next(p.device for p in model.parameters() if p.requires_grad)
    batch = {k: v.to(dev) for k, v in demo_batches(1, vocab=config.vocab_size, seq=seq, batch=1)[0].items()}
    with console.status("compiling and running one step"):
        step = torch.compile(model, backend="poros", options={"dump": str(out)})
        step(**batch, use_cache=False).loss.backward()
    folder = sorted(out.glob("graph_*"), key=lambda p: p.stat().st_mtime)[-1]
    console.print((folder / "schedule.txt").read_text())
    console.print(f"wrote {folder}/ (graphs after every pass, schedule.txt, timeline.png) for {count} layers, "
                  f"{quantization}", soft_wrap=True, highlight=False)


def _set_layers(config, layers: int) -> None:
    """``config`` cut to its first ``layers`` decoder layers (per-layer lists such as Gemma 3's
    ``layer_types`` cut with it)."""
    config.num_hidden_layers = layers
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) > layers:
        config.layer_types = kinds[:layers]


# -- train ------------------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _fail(message: str, code: int = 2) -> "typer.Exit":
    """Print ``message`` in red on stderr (unwrapped, so paths stay whole) and return the exit to raise."""
    Console(stderr=True).print(f"[red]error:[/red] {message}", soft_wrap=True, markup=True, highlight=False)
    return typer.Exit(code)


def _tokenizer(folder: Optional[Path]):
    """The tokenizer saved in ``folder``, or None when the folder has no tokenizer files."""
    if folder is None or not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _fail(f"{folder} has tokenizer files but transformers cannot load them ({e}); fix or remove them")


def _targets(values: Optional[list[str]], model_type: str) -> list[str]:
    from .tiny import lora_targets

    if not values:
        return lora_targets(model_type)
    # repeated --target-modules and comma-separated lists both work
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


STATE_FILE = "poros_state.safetensors"  # what `train --resume` continues from (written next to the adapter)
_STATE_KEY = "poros_fx_train_state"
_STATE_VERSION = 1
# what a resumed run may change: neither touches a bit of the result (the data order does not depend on the
# step count, and streaming is exact whatever the block size and prefetch)
_RESUMABLE = ("steps", "epochs", "block_size", "prefetch", "log_every", "save_every", "out")
# the run's settings, kept in the state so that `--resume OUT` needs nothing else
_SETTINGS = ("model", "from_config", "data", "quantization", "lora_r", "lora_alpha", "lora_dropout", "target_modules",
             "lr", "weight_decay", "seq_len", "pack", "batch_size", "accumulate", "codegen", "device", "seed",
             "block_size", "prefetch")


def _as_path(value: Optional[str]) -> Optional[str]:
    """An existing path made absolute (a resumed run may start elsewhere); anything else (a hub id, a
    built-in shape, ``demo``) as written."""
    if value is None or value.lower() in (*BUILTIN, "demo") or not Path(value).exists():
        return value  # names are read as names first (load_config, load_dataset), whatever the folder holds
    return str(Path(value).resolve())


def _read_data(data: str, config, folder: Optional[Path], shape: Optional[str], seq_len: int, pack: bool):
    """The dataset of ``data``, tokenized with the tokenizer saved in ``folder`` (when there is one)."""
    from ..io.data import load_dataset

    tokenizer = _tokenizer(folder)
    hint = f" in {folder}" if folder is not None else f" for the built-in shape {shape}"
    return load_dataset(data, seq_len=seq_len, vocab_size=config.vocab_size, tokenizer=tokenizer, pack=pack,
                        tokenizer_hint=hint)


def _fingerprint(dataset) -> str:
    """sha256 of a dataset's rows and labels: a resumed run checks that it reads the same data."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for t in (dataset.input_ids, dataset.labels):
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _rng_state(device) -> dict:
    """The generators a step draws from (dropout masks): the CPU's, and the CUDA device's when it computes there."""
    import torch

    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        if "cuda" not in state:
            raise _fail("the saved run has no CUDA generator state (it ran on the CPU); resume it with --device cpu")
        torch.cuda.set_rng_state(state["cuda"], device)


def save_train_state(out: Path, model, named: list, optimizer, rng: dict, meta: dict) -> None:
    """Write the adapter (peft's ``save_pretrained``) and ``STATE_FILE`` into ``out``, atomically: both are
    written into a temporary folder inside ``out`` and renamed into place, the state last, so an interrupted
    save leaves the previous files whole. ``STATE_FILE`` is safetensors (nothing is pickled): the adapter
    tensors of the same step, the optimizer state per parameter, the RNG states, and the step, data
    position, losses and the run's settings as JSON metadata."""
    import json
    import os
    import shutil
    import tempfile

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


def load_train_state(folder: Path) -> tuple[dict, dict]:
    """``(meta, tensors)`` of a run's ``STATE_FILE`` (see ``save_train_state``)."""
    import json

    from safetensors import safe_open

    from ..io.loader import LoaderError, read_safetensors_header

    path = folder / STATE_FILE
    if not folder.is_dir():
        raise _fail(f"--resume {folder}: no such folder (give the --out folder of the run to continue)")
    if not path.is_file():
        raise _fail(f"{folder} has no {STATE_FILE}, so it cannot be resumed: it was not written by `poros-fx train` "
                    f"(or by a version before --resume); start a new run with --out")
    try:
        read_safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_STATE_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except LoaderError as e:
        raise _fail(str(e))
    except Exception as e:  # safetensors' own errors, a missing or broken metadata entry: the file, in one line
        raise _fail(f"{path}: not a readable poros-fx train state ({type(e).__name__}: {e}); the run cannot be "
                    f"resumed from it")
    if meta.get("version") != _STATE_VERSION:
        raise _fail(f"{path}: train state version {meta.get('version')!r}, this poros-fx reads {_STATE_VERSION}")
    return meta, tensors


def _restore(meta: dict, tensors: dict, named: list, optimizer, path: Path) -> None:
    """Adapter weights and optimizer state of the saved step into the freshly built model and optimizer."""
    import torch

    names = [name for name, _ in named]
    if names != meta["params"]:
        raise _fail(f"{path}: the saved adapter has {len(meta['params'])} parameters, the model built for the resumed "
                    f"run {len(names)} (not the same model or LoRA settings?)")
    with torch.no_grad():
        for name, p in named:
            saved = tensors[f"adapter/{name}"]
            if saved.shape != p.shape or saved.dtype != p.dtype:
                raise _fail(f"{path}: {name} is {saved.dtype} {list(saved.shape)} there, {p.dtype} {list(p.shape)} in "
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


def _resume_settings(ctx: typer.Context, given: dict, folder: Path) -> tuple[dict, dict, dict]:
    """The saved run's settings with what this command line may change applied; an option that would
    change the result (model, data, LoRA, optimizer, precision, device, seed) is refused by name."""
    import torch

    def typed(name: str) -> bool:  # given on the command line, not a default (typer vendors click: compare by name)
        return getattr(ctx.get_parameter_source(name), "name", None) in ("COMMANDLINE", "ENVIRONMENT")

    meta, tensors = load_train_state(folder)
    run = dict(meta["run"])
    conflicts = []
    for name, value in given.items():
        if not typed(name):
            continue
        if name in _RESUMABLE:
            run[name] = value
            continue
        saved = run.get(name)
        if name in ("model", "from_config", "data"):
            value = _as_path(value)
        elif name == "target_modules":
            value = [t.strip() for v in value or () for t in v.split(",") if t.strip()] or None
        elif name == "device":
            value = torch.device(value).type
        if value != saved:
            conflicts.append(f"--{name.replace('_', '-')} {value} (the run has {saved})")
    if conflicts:
        raise _fail(f"--resume {folder} continues a run with its own settings, and these would change its result: "
                    f"{'; '.join(conflicts)}. Leave them out (only --steps/--epochs, --block-size, --prefetch, "
                    f"--log-every, --save-every and --out may change), or start a new run")
    if given.get("epochs") is not None and typed("epochs"):
        run["steps"] = None  # recomputed from the data below
    return run, meta, tensors


@app.command()
def train(ctx: typer.Context,
          model: Optional[str] = typer.Argument(None, help="model folder (save_pretrained layout) or cached hub id"),
          data: Optional[str] = typer.Option(None, help="a .jsonl/.json/.csv file (text, prompt+response or input_ids "
                                             "records), or 'demo' for the built-in token set"),
          out: Optional[Path] = typer.Option(None, help="folder for the PEFT adapter (and the state --resume reads)"),
          from_config: Optional[str] = typer.Option(None, "--from-config", help="random weights from a built-in shape "
                                                    "or a config.json instead of MODEL (smoke tests)"),
          resume: Optional[Path] = typer.Option(None, "--resume", metavar="OUT", help="continue the run that wrote OUT "
                                                "(adapter, optimizer, RNG, step and data position; its settings "
                                                "too): bit-exact with a run that was never stopped. --steps N "
                                                "extends it"),
          save_every: Optional[int] = typer.Option(None, min=1, help="also save adapter + resume state every N steps "
                                                   "(always at the end, and on Ctrl-C)"),
          quantization: str = typer.Option("nf4", help="nf4 (QLoRA base) or bf16"),
          lora_r: int = typer.Option(16, min=1), lora_alpha: float = typer.Option(32.0, min=0.0),
          lora_dropout: float = typer.Option(0.05, min=0.0, max=1.0),
          target_modules: Optional[list[str]] = typer.Option(None, help="LoRA targets, repeated or comma-separated "
                                                             "(default: every linear of a decoder layer)"),
          steps: Optional[int] = typer.Option(None, min=1, help="optimizer steps (default: --epochs 1)"),
          epochs: Optional[float] = typer.Option(None, min=0.0, help="passes over the data (rounded up to whole steps)"),
          lr: float = typer.Option(2e-4, min=0.0), weight_decay: float = typer.Option(0.0, min=0.0),
          seq_len: int = typer.Option(512, min=2, help="tokens per row"),
          pack: bool = typer.Option(True, help="pack examples end to end into rows (--no-pack: one example per row, "
                                    "truncated)"),
          batch_size: int = typer.Option(1, min=1, help="rows per micro-batch"),
          accumulate: int = typer.Option(1, min=1, help="micro-batches per optimizer step"),
          block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
          codegen: Optional[str] = CODEGEN_OPTION, device: Optional[str] = DEVICE_OPTION,
          seed: int = typer.Option(0, help="seeds the LoRA init, dropout, data order (and --from-config weights)"),
          log_every: Optional[int] = typer.Option(None, min=1, help="steps between log lines when not on a terminal "
                                                  "(default: about 10 lines)")) -> None:
    """Train a LoRA adapter on a streamed base (NF4 or bf16) and write it as a standard PEFT adapter."""
    import math

    import peft
    import torch

    from .. import stats
    from ..errors import PorosError
    from ..io.data import batches
    from ..io.loader import from_config as random_model
    from ..io.loader import load_pretrained, resolve_folder

    given = {name: value for name, value in locals().items() if name in (*_SETTINGS, *_RESUMABLE, "target_modules",
                                                                         "epochs")}
    saved: Optional[tuple[dict, dict]] = None
    if resume is not None:
        run, meta, tensors = _resume_settings(ctx, given, resume)
        saved = (meta, tensors)
        model, from_config, data = run["model"], run["from_config"], run["data"]
        quantization, lora_r, lora_alpha, lora_dropout = (run["quantization"], run["lora_r"], run["lora_alpha"],
                                                          run["lora_dropout"])
        target_modules, lr, weight_decay = run["target_modules"], run["lr"], run["weight_decay"]
        seq_len, pack, batch_size, accumulate = run["seq_len"], run["pack"], run["batch_size"], run["accumulate"]
        codegen, device, seed, steps = run["codegen"], run["device"], run["seed"], run["steps"]
        block_size, prefetch, log_every, save_every = run["block_size"], run["prefetch"], run["log_every"], run["save_every"]
        epochs = run.get("epochs")
        out = Path(run["out"]) if run.get("out") is not None else resume
    else:
        if data is None or out is None:
            raise _fail("give --data FILE|demo and --out FOLDER (or --resume OUT to continue a run)")
        if (model is None) == (from_config is None):
            raise _fail("give either MODEL (a folder or cached hub id) or --from-config NAME_OR_CONFIG, not both or "
                        "neither")
    if steps is not None and epochs is not None:
        raise _fail("give --steps or --epochs, not both")
    if quantization not in ("nf4", "bf16"):
        raise _fail(f"--quantization must be nf4 or bf16, got {quantization!r}")
    try:
        # config, tokenizer and data first: a bad data file fails in seconds, before any weight is read
        if model is not None:
            folder: Optional[Path] = resolve_folder(model)
            config = load_config(str(folder))
        else:
            config = load_config(from_config)
            path = Path(from_config)
            folder = path if path.is_dir() else path.parent if path.is_file() else None
            if folder is None and from_config.lower() not in BUILTIN:
                folder = resolve_folder(from_config)  # a cached hub id: its snapshot may hold a tokenizer
        dataset = _read_data(data, config, folder, from_config, seq_len, pack)
        if steps is None:
            steps = max(1, math.ceil((1.0 if epochs is None else epochs) * dataset.rows / (batch_size * accumulate)))
        fingerprint = _fingerprint(dataset)
        done = 0
        if saved is not None:
            done = saved[0]["step"]
            if saved[0]["data_sha256"] != fingerprint:
                raise _fail(f"--resume {resume}: the data ({dataset.source}) is not what the run trained on (its rows "
                            f"changed since); a resumed run must read the same data")
            if done >= steps:
                raise _fail(f"the run in {resume} has finished its {done} steps; pass --steps N (N > {done}) to train "
                            f"it further")
        console.print(f"data: {dataset.source}: {dataset.examples} examples ({', '.join(dataset.kinds)}) -> "
                      f"{dataset.rows} rows of {seq_len} tokens, {dataset.supervised_tokens} trained tokens; "
                      f"{steps} step(s) of {accumulate} x {batch_size} rows"
                      + (f"; resuming after step {done}" if saved is not None else ""), soft_wrap=True, highlight=False)

        torch.manual_seed(seed)  # the LoRA A init and, below, the dropout masks
        targets = _targets(target_modules, config.model_type)
        lora = peft.LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets)
        common = {"quantization": quantization, "device": device, "block_size": block_size, "prefetch": prefetch,
                  "lora": lora, "codegen": codegen}
        if model is not None:
            peft_model = load_pretrained(folder, **common)
        else:
            peft_model = random_model(config, seed=seed, **common)
    except PorosError as e:
        raise _fail(str(e))
    except ValueError as e:  # peft: --target-modules that match no module of the model
        raise _fail(f"LoRA setup failed: {e}")

    named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    dev = trainable[0].device
    from .report import report

    console.print(report(peft_model), soft_wrap=True, highlight=False)
    console.print(f"model: {config.model_type}, {quantization} base streamed on {dev}, LoRA r={lora_r} "
                  f"alpha={lora_alpha} on {', '.join(targets)} ({sum(p.numel() for p in trainable):,} trainable "
                  f"parameters)", soft_wrap=True, highlight=False)
    peft_model.train()
    step_model = torch.compile(peft_model, backend="poros")
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    losses: list[float] = []
    if saved is not None:
        meta, tensors = saved
        _restore(meta, tensors, named, optimizer, resume / STATE_FILE)
        _set_rng_state({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("rng/")}, dev)
        losses = list(meta["losses"])
    run = dict(model=_as_path(model), from_config=_as_path(from_config), data=_as_path(data), target_modules=targets,
               quantization=quantization, lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, lr=lr,
               weight_decay=weight_decay, seq_len=seq_len, pack=pack, batch_size=batch_size, accumulate=accumulate,
               codegen=codegen, device=dev.type, seed=seed, block_size=block_size, prefetch=prefetch, steps=steps,
               log_every=log_every, save_every=save_every)  # what --resume needs to rebuild this run

    def save(step: int, rng: dict) -> None:
        save_train_state(out, peft_model, named, optimizer, rng, {
            "step": step, "steps": steps, "micro_batches": step * accumulate, "losses": losses[:step],
            "data_sha256": fingerprint, "run": run})

    micro = batches(dataset, batch_size, steps * accumulate, seed)
    for _ in range(done * accumulate):  # the data position: the same order, the batches already trained skipped
        next(micro)
    rng = _rng_state(dev)  # the generators as they stand after the last finished step
    loss_value = losses[-1] if losses else float("nan")
    first = done
    try:
        with _StepLog(steps, log_every, start=done) as log:
            for step in range(done + 1, steps + 1):
                start = time.perf_counter()
                total = torch.zeros((), device=dev)
                for _ in range(accumulate):
                    batch = {k: v.to(dev) for k, v in next(micro).items()}
                    loss = step_model(**batch, use_cache=False).loss / accumulate  # mean over the step's micro-batches
                    loss.backward()
                    total += loss.detach()
                with _interrupt_after():  # a step is saved whole or not at all
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss_value = total.item()
                    losses.append(loss_value)
                    done, rng = step, _rng_state(dev)
                if not math.isfinite(loss_value):
                    raise _fail(f"step {step}: loss is {loss_value}; lower --lr, or check the data")
                log.step(step, loss_value, time.perf_counter() - start)
                if save_every is not None and step % save_every == 0 and step < steps:
                    save(step, rng)
                    log.note(f"step {step}: adapter and resume state saved to {out}/")
    except KeyboardInterrupt:
        if done == 0 or (done == first and resume is not None and out.resolve() == resume.resolve()):
            raise _fail("interrupted before a step finished; nothing new to save" + (
                f" (the run in {out}/ is still at step {done}: `poros-fx train --resume {out}`)" if done else ""),
                code=130)
        save(done, rng)
        raise _fail(f"interrupted: step {done}/{steps} saved to {out}/ (adapter + resume state). Continue with "
                    f"`poros-fx train --resume {out}`", code=130)

    with _interrupt_after():
        save(steps, rng)
    s = stats(peft_model)
    if from_config is not None:
        where = (f"final loss {loss_value:.4f} after {steps} steps; adapter written to {out}/. It was trained on "
                 f"random weights (--from-config {from_config}, seed {seed}) and fits only that random base: there is "
                 f"no checkpoint for `poros-fx export` to merge it into. Evaluate it with `poros-fx eval {from_config} "
                 f"--adapter {out} --data DATA --seed {seed}`, continue it with `poros-fx train --resume {out} --steps "
                 f"N`, or load it with poros_fx.from_config(config, seed={seed}, adapter={str(out)!r})")
    else:
        where = (f"final loss {loss_value:.4f} after {steps} steps; adapter written to {out}/ (peft.PeftModel."
                 f"from_pretrained, `poros-fx eval {model} --adapter {out} --data DATA`, `poros-fx export {out} --base "
                 f"{model} -o MERGED`, or `poros-fx train --resume {out} --steps N` to train further)")
    console.print(where, soft_wrap=True, highlight=False)
    console.print(f"poros: peak resident base {_mib(s['peak_resident_base_bytes'])} of {_mib(s['host_bytes'])} in the "
                  f"host store; {s['loads']} loads ({_mib(s['bytes_loaded'])}), {s['recomputed_blocks']} recomputed "
                  f"blocks, block size {s['block_size']}, prefetch {s['prefetch']}", soft_wrap=True, highlight=False)


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """Ctrl-C inside the block is held until its end (the optimizer step and its bookkeeping are never cut
    in half); outside the main thread, where no handler can be set, the block runs as is."""
    import signal

    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


# -- eval -------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What ``evaluate`` measured: the mean token loss over every supervised token, and its perplexity."""

    loss: float
    perplexity: float
    tokens: int
    rows: int
    batches: int
    batch_losses: list[float]  # the model's loss per batch (mean over that batch's supervised tokens)
    seconds: float


def evaluate(model, dataset, batch_size: int, device, progress: Optional[Callable[[int, float], None]] = None
             ) -> EvalResult:
    """Every row of ``dataset`` once, in order, through ``model`` under ``torch.no_grad()``: the loss is the
    mean over all supervised tokens (each batch's mean loss weighted by its token count, summed in float64),
    perplexity ``exp(loss)``. ``progress(batches_done, running_loss)`` after each batch."""
    import torch

    from ..io.data import eval_batches

    started = time.perf_counter()
    total, tokens, losses = 0.0, 0, []
    with torch.no_grad():
        for index, (batch, count) in enumerate(eval_batches(dataset, batch_size), 1):
            loss = float(model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss)
            losses.append(loss)
            total += loss * count
            tokens += count
            if progress is not None:
                progress(index, total / tokens)
    mean = total / tokens
    return EvalResult(loss=mean, perplexity=math.exp(mean) if mean < 700 else float("inf"), tokens=tokens,
                      rows=dataset.rows, batches=len(losses), batch_losses=losses, seconds=time.perf_counter() - started)


def _model_source(spec: str) -> tuple[bool, Optional[Path]]:
    """``(has_checkpoint, folder)`` for eval's MODEL: a folder (or cached hub id) with weight files is a
    checkpoint; a built-in shape, a config.json or a folder holding only a config means random weights."""
    from ..io.loader import resolve_folder

    if spec.lower() in BUILTIN:  # as load_config reads it
        return False, None
    path = Path(spec)
    if path.is_file():
        return False, path.parent
    folder = path if path.is_dir() else resolve_folder(spec)
    weights = [f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
               or f.name.endswith(".index.json")]
    return bool(weights), folder


@app.command("eval")
def eval_command(model: str = typer.Argument(..., help="model folder or cached hub id (its checkpoint), or a built-in "
                                             "shape, config.json or config-only folder (random weights, --seed)"),
                 data: str = typer.Option(..., help="a .jsonl/.json/.csv file, or 'demo' (records as for train)"),
                 adapter: Optional[Path] = typer.Option(None, help="a PEFT adapter folder (e.g. `poros-fx train --out`); "
                                                        "default: the base alone"),
                 json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result here as JSON"),
                 quantization: str = typer.Option("nf4", help="nf4 (QLoRA base) or bf16"),
                 seq_len: int = typer.Option(512, min=2, help="tokens per row"),
                 pack: bool = typer.Option(True, help="pack examples into rows (--no-pack: one example per row)"),
                 batch_size: int = typer.Option(1, min=1, help="rows per batch"),
                 block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
                 codegen: Optional[str] = CODEGEN_OPTION, device: Optional[str] = DEVICE_OPTION,
                 seed: int = typer.Option(0, help="the random weights' seed when MODEL is a shape or config (as "
                                          "train --from-config --seed)")) -> None:
    """Streamed evaluation under torch.no_grad(): mean token loss and perplexity of MODEL (+ ADAPTER) on DATA."""
    import json

    import torch

    from ..errors import PorosError
    from ..io.loader import from_config as random_model
    from ..io.loader import load_pretrained
    from ..prepare import get_store

    if quantization not in ("nf4", "bf16"):
        raise _fail(f"--quantization must be nf4 or bf16, got {quantization!r}")
    try:
        checkpoint, folder = _model_source(model)
        config = load_config(str(folder) if checkpoint else model)
        dataset = _read_data(data, config, folder, model, seq_len, pack)
        common = {"quantization": quantization, "device": device, "block_size": block_size, "prefetch": prefetch,
                  "codegen": codegen, "adapter": adapter, "trainable": False}
        weights = f"{folder}" if checkpoint else f"random-init weights (seed {seed}) from {model}"
        console.print(f"eval: {weights}" + (f" + adapter {adapter}" if adapter is not None else " (no adapter)")
                      + f" on {dataset.source}: {dataset.rows} rows of {seq_len} tokens, {dataset.supervised_tokens} "
                      f"scored tokens", soft_wrap=True, highlight=False)
        lm = load_pretrained(folder, **common) if checkpoint else random_model(config, seed=seed, **common)
    except PorosError as e:
        raise _fail(str(e))
    lm.eval()
    dev = get_store(lm).device
    step_model = torch.compile(lm, backend="poros")
    batches_total = -(-dataset.rows // batch_size)
    with _StepLog(batches_total, None, label="evaluating", unit="batch") as log:
        last = [time.perf_counter()]

        def progress(index: int, running: float) -> None:
            now = time.perf_counter()
            log.step(index, running, now - last[0])
            last[0] = now

        result = evaluate(step_model, dataset, batch_size, dev, progress)
    console.print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens} tokens in "
                  f"{result.batches} batches, {result.seconds:.1f} s)", highlight=False)
    if json_path is not None:
        record = {"model": model, "weights": "checkpoint" if checkpoint else f"random-init (seed {seed})",
                  "adapter": None if adapter is None else str(adapter), "data": dataset.source,
                  "quantization": quantization, "seq_len": seq_len, "pack": pack, "batch_size": batch_size,
                  "rows": result.rows, "tokens": result.tokens, "batches": result.batches, "loss": result.loss,
                  "perplexity": result.perplexity, "seconds": result.seconds}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_path}", highlight=False)


def _mib(n: int) -> str:
    from .report import format_bytes

    return format_bytes(n)


class _StepLog:
    """A rich progress bar (loss, s/step) on a terminal; plain periodic lines otherwise (logs, CI, pipes)."""

    def __init__(self, steps: int, every: Optional[int], start: int = 0, label: str = "training",
                 unit: str = "step") -> None:
        self.steps = steps
        self.start = start
        self.every = every or max(1, (steps - start) // 10)
        self.label = label
        self.unit = unit
        self.bar = None
        self.task = None
        self.times: list[float] = []

    def __enter__(self) -> "_StepLog":
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]}"),
                                TimeElapsedColumn(), console=console)
            self.bar.__enter__()
            self.task = self.bar.add_task(self.label, total=self.steps, completed=self.start, loss="-",
                                          rate=f"(the first {self.unit} compiles)")
        return self

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.times.append(seconds)
        # the first step compiles; the rate shown is that of the steps after it
        rate = statistics.mean(self.times[1:]) if len(self.times) > 1 else seconds
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4f}", rate=f"{rate:.2f} s/{self.unit}")
        elif step == self.start + 1 or step % self.every == 0 or step == self.steps:
            console.print(f"{self.unit} {step}/{self.steps}  loss {loss:.4f}  {rate:.2f} s/{self.unit}"
                          + (f"  (first {self.unit} compiles)" if step == self.start + 1 else ""), highlight=False)

    def note(self, message: str) -> None:
        """A line between the progress updates (above the bar on a terminal)."""
        (self.bar.console if self.bar is not None else console).print(message, soft_wrap=True, highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


# -- export -----------------------------------------------------------------------------------------

def _parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", text.lower())
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    number, unit = float(match.group(1)), match.group(2).rstrip("b")
    powers = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30,
              "ti": 2**40}
    if unit not in powers:
        raise typer.BadParameter(f"{text!r}: unknown unit; write e.g. 5GB, 500MB or 2GiB")
    return int(number * powers[unit])


@app.command()
def export(adapter_dir: Path = typer.Argument(..., help="the adapter folder `poros-fx train --out` wrote"),
           base: str = typer.Option(..., help="the base model: folder (save_pretrained layout) or cached hub id"),
           out: Path = typer.Option(..., "-o", "--out", help="new folder for the merged bf16 model"),
           max_shard_size: str = typer.Option("5GB", help="largest shard (cut at decoder-layer boundaries)"),
           overwrite: bool = typer.Option(False, help="write into a non-empty OUT, replacing its model files")) -> None:
    """Merge a LoRA adapter into a bf16 copy of its base, tensor by tensor (never the whole model in memory)."""
    from ..errors import PorosError
    from ..io.export import export_merged

    limit = _parse_size(max_shard_size)
    try:
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("merging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as bar:
                task = bar.add_task("merge", total=None)
                report = export_merged(adapter_dir, base, out, max_shard_bytes=limit, overwrite=overwrite,
                                       progress=lambda done, total: bar.update(task, completed=done, total=total))
        else:
            report = export_merged(adapter_dir, base, out, max_shard_bytes=limit, overwrite=overwrite)
    except PorosError as e:
        raise _fail(str(e))
    console.print(f"merged {report.merged_modules} LoRA modules into {report.tensors} bf16 tensors: "
                  f"{len(report.shards)} shard(s), {_mib(report.bytes_written)} in {report.out}/ "
                  f"({report.seconds:.1f} s; largest tensor held {_mib(report.largest_tensor_bytes)}). Load it with "
                  f"transformers.AutoModelForCausalLM.from_pretrained({str(report.out)!r})", soft_wrap=True,
                  highlight=False)


# -- bench ------------------------------------------------------------------------------------------

@app.command()
def bench(models: str = typer.Option("0.5b,7b,32b,72b", help="comma-separated: tiny, 0.5b, 7b, 32b, 72b"),
          methods: str = typer.Option("peft_resident,peft_checkpointing,poros,poros_resident",
                                      help="comma-separated: peft_resident, peft_checkpointing, compiled_resident, "
                                      "poros, poros_resident, poros_tensor_copies, poros_auto"),
          block_sizes: str = typer.Option("1,2,4", help="poros block sizes, one row each"),
          seqs: str = typer.Option("512,2048", help="sequence lengths; the first is the base"),
          accums: str = typer.Option("1,4", help="gradient accumulation; the first is the base"),
          grid: str = typer.Option("star", help="star: base pair + each other seq / accum alone; full: every pair"),
          steps: int = typer.Option(10, min=1, help="timed optimizer steps per row"),
          warmup: int = typer.Option(1, min=1, help="untimed steps first (the first compiles)"),
          device: str = typer.Option("cuda", help="cuda, or cpu (with --models tiny) for a smoke run"),
          json_path: Path = typer.Option(Path("poros-bench.json"), "--json", help="results; merged into when it exists"),
          md: Optional[Path] = typer.Option(None, help="markdown table (default: JSON path with .md)"),
          plot: Optional[Path] = typer.Option(None, help="PNG plot (default: JSON path with .png)"),
          time_budget: Optional[float] = typer.Option(None, help="seconds; no new row starts after them"),
          compiled_resident: bool = typer.Option(False, "--compiled-resident",
                                                 help="add compiled_resident (plain torch.compile; 0.5B/7B only)"),
          profile: Optional[Path] = typer.Option(None, metavar="DIR",
                                                 help="profile one extra step per row: Chrome trace into DIR, "
                                                 "summary into the row's 'profile'")) -> None:
    """Side-by-side benchmark: PEFT resident / checkpointing / compiled vs poros streamed and resident (JSON, md, PNG)."""
    import shlex
    import sys

    import torch

    from . import bench as harness

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail(harness.NO_CUDA_MESSAGE)
    try:
        config = harness.make_config(models=models, methods=methods, block_sizes=block_sizes, seqs=seqs, accums=accums,
                                     grid=grid, steps=steps, warmup=warmup, device=device, json_path=json_path,
                                     md_path=md, plot_path=plot, time_budget=time_budget,
                                     compiled_resident=compiled_resident, profile_dir=profile,
                                     command=shlex.join(["poros-fx", *sys.argv[1:]]))
    except ValueError as e:
        raise _fail(str(e))
    harness.run(config)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
