"""``poros-fx train``, ``eval`` and ``export``: the commands that train an adapter, score it and merge it.

Each reads its options and prints; the substance lives in ``training/`` (the loop, data sources, run
state, evaluation, console) and ``io/export.py``. ``app.py`` registers these functions as commands.
"""

from __future__ import annotations

import inspect
import time
import typing
from pathlib import Path
from typing import Any, Optional

import typer

from ..errors import PorosError
from ..handles import get_store
from ..io.export import export_merged
from ..io.loader import from_config as random_model
from ..io.loader import load_pretrained
from ..training.evaluation import evaluate
from ..training.loop import train as train_run
from ..training.options import OPTION_NAMES, TrainOptions, check_setting
from ..training.run_config import read_run_config
from ..training.run_state import claim_out, resume_settings
from ..training.sources import check_seq_len, load_config, model_source, read_data
from ..training.terminal import StepLog, check_writable, console, fail
from ..units import format_bytes
from .flags import option_parameters, with_parameters
from .options import (
    CODEGEN_OPTION,
    DEVICE_OPTION,
    PREFETCH_OPTION,
    size_value,
)

# -- train ------------------------------------------------------------------------------------------

DATA_HELP = ("a .jsonl, .json, .csv or .parquet file, a Dataset.save_to_disk folder, a dataset id in the local "
             "datasets cache (--split), or 'demo' (alias 'synthetic') for the built-in token set; records with "
             "messages, prompt + completion (or response), text, or input_ids")


def train(ctx: typer.Context, **values: Any) -> None:
    """Train a LoRA adapter on a streamed base (NF4 or bf16) and write it as a standard PEFT adapter."""
    model, model_option = values.pop("model_argument"), values.pop("model")
    config, resume, overwrite = values.pop("config"), values.pop("resume"), values.pop("overwrite")
    if model is not None and model_option is not None:
        raise fail("give the model once: MODEL or --model, not both")
    values["model"] = model_option if model_option is not None else model

    def typed(name: str) -> bool:  # written on the command line, not a default (typer vendors click: compare by name)
        names = ("model_argument", "model") if name == "model" else (name,)
        return any(getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT") for n in names)

    if config is not None:
        if resume is not None:
            raise fail("--resume continues a run with its own settings; leave --config out")
        for name, value in read_run_config(config, OPTION_NAMES, typing.get_type_hints(TrainOptions)).items():
            check_setting(name, value, f"--config {config}")  # the types above, then each option's own check
            if not typed(name):
                values[name] = Path(value) if name == "out" else value
    saved: Optional[tuple[dict, dict]] = None
    if resume is not None:
        run, meta, tensors = resume_settings(values, typed, resume)
        saved = (meta, tensors)
        keep = {name: run[name] for name in OPTION_NAMES if name in run and name != "out"}
        values = {**values, **keep, "out": Path(run["out"]) if run.get("out") is not None else resume}
    elif values["data"] is None or values["out"] is None:
        raise fail("give --data DATA and --out FOLDER (or --resume OUT to continue a run)")
    elif (values["model"] is None) == (values["from_config"] is None):
        raise fail("give either MODEL (a folder or cached hub id) or --from-config NAME_OR_CONFIG, not both or "
                   "neither")
    opts = TrainOptions(**values)
    opts.check()
    if resume is None or opts.out.resolve() != resume.resolve():
        claim_out(opts.out, overwrite)
    train_run(opts, resume=resume, saved=saved)


with_parameters(train, [
    inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
    inspect.Parameter("model_argument", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str], default=typer.Argument(
        None, metavar="MODEL", show_default=False, help="model folder (save_pretrained layout) or cached hub id")),
    inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str], default=typer.Option(
        None, "--model", help="the same as MODEL; with --resume, where the run's model is now (checked to be the "
        "same checkpoint)")),
    *option_parameters(TrainOptions, skip=("model",)),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=typer.Option(
        None, "--config", help="a TOML file of these options (run.toml, as every run writes one); the command "
        "line overrides it")),
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=typer.Option(
        None, "--resume", metavar="OUT", help="continue the run that wrote OUT (adapter, optimizer, RNG, step and "
        "data position; its settings too): bit-exact with a run that was never stopped. --steps N extends it; "
        "--model and --data follow moved files")),
    inspect.Parameter("overwrite", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, help="replace the run in a non-empty --out (its adapter, state, checkpoints and metrics)")),
])


# -- eval -------------------------------------------------------------------------------------------

def eval_command(model: str = typer.Argument(..., help="model folder or cached hub id (its checkpoint), or a built-in "
                                             "shape, config.json or config-only folder (random weights, --seed)"),
                 data: str = typer.Option(..., help=DATA_HELP),
                 split: Optional[str] = typer.Option(None, help="split of a dataset folder or cached id (default: "
                                                     "train)"),
                 train_on: str = typer.Option("completion", help="tokens scored: completion (assistant turns, "
                                              "completions) or all"),
                 adapter: Optional[Path] = typer.Option(None, help="a PEFT adapter folder (e.g. `poros-fx train --out`); "
                                                        "default: the base alone"),
                 json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result here as JSON "
                                                          "(an existing file only with --overwrite)"),
                 overwrite: bool = typer.Option(False, help="replace an existing --json file"),
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

    if quantization not in ("nf4", "bf16"):
        raise fail(f"--quantization must be nf4 or bf16, got {quantization!r}")
    if json_path is not None:  # before anything loads: the result is written last
        if json_path.is_file() and not overwrite:
            raise fail(f"--json {json_path} exists; pass --overwrite to replace it, or give another file")
        check_writable(json_path)
    try:
        checkpoint, folder = model_source(model)
        config = load_config(str(folder) if checkpoint else model)
        check_seq_len(config, seq_len, model)
        dataset = read_data(data, config, folder, model, seq_len, pack, train_on=train_on, split=split)
        common = {"quantization": quantization, "device": device, "block_size": block_size, "prefetch": prefetch,
                  "codegen": codegen, "adapter": adapter, "trainable": False}
        weights = f"{folder}" if checkpoint else f"random-init weights (seed {seed}) from {model}"
        console.print(f"eval: {weights}" + (f" + adapter {adapter}" if adapter is not None else " (no adapter)")
                      + f" on {dataset.source}: {dataset.rows} rows of {seq_len} tokens, {dataset.supervised_tokens} "
                      f"scored tokens", soft_wrap=True, highlight=False)
        lm = load_pretrained(folder, **common) if checkpoint else random_model(config, seed=seed, **common)
    except PorosError as e:
        raise fail(str(e))
    lm.eval()
    dev = get_store(lm).device
    step_model = torch.compile(lm, backend="poros")
    batches_total = -(-dataset.rows // batch_size)
    with StepLog(batches_total, None, label="evaluating", unit="batch") as log:
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


# -- export -----------------------------------------------------------------------------------------

def export(adapter_dir: Path = typer.Argument(..., help="the adapter folder `poros-fx train --out` wrote"),
           base: str = typer.Option(..., help="the base model: folder (save_pretrained layout) or cached hub id"),
           out: Path = typer.Option(..., "-o", "--out", help="new folder for the merged bf16 model"),
           max_shard_size: str = typer.Option("5GB", help="largest shard (cut at decoder-layer boundaries)"),
           overwrite: bool = typer.Option(False, help="write into a non-empty OUT, replacing its model files"),
           any_base: bool = typer.Option(False, "--any-base", help="merge even when the adapter names another base "
                                         "(base_model_name_or_path); the shapes are checked either way")) -> None:
    """Merge a LoRA adapter into a bf16 copy of its base, tensor by tensor (never the whole model in memory)."""
    limit = size_value(max_shard_size, "--max-shard-size")
    try:
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            with Progress(TextColumn("merging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as bar:
                task = bar.add_task("merge", total=None)
                report = export_merged(adapter_dir, base, out, max_shard_bytes=limit, overwrite=overwrite,
                                       progress=lambda done, total: bar.update(task, completed=done, total=total),
                                       any_base=any_base)
        else:
            report = export_merged(adapter_dir, base, out, max_shard_bytes=limit, overwrite=overwrite,
                                   any_base=any_base)
    except PorosError as e:
        raise fail(str(e))
    console.print(f"merged {report.merged_modules} LoRA modules into {report.tensors} bf16 tensors: "
                  f"{len(report.shards)} shard(s), {format_bytes(report.bytes_written)} in {report.out}/ "
                  f"({report.seconds:.1f} s; largest tensor held {format_bytes(report.largest_tensor_bytes)}). "
                  f"Load it with transformers.AutoModelForCausalLM.from_pretrained({str(report.out)!r})", soft_wrap=True,
                  highlight=False)
