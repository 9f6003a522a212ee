"""``poros-fx train``, ``eval`` and ``export``: the commands that train an adapter, score it and merge it.

Each reads its options and prints; the substance lives in ``training/`` (the loop, data sources, run
state, evaluation, console) and ``io/export.py``. ``app.py`` registers these functions as commands.
"""

from __future__ import annotations

import time
import typing
from pathlib import Path
from typing import Optional

import typer

from ..errors import PorosError
from ..handles import get_store
from ..io.export import export_merged
from ..io.loader import from_config as random_model
from ..io.loader import load_pretrained
from ..options import AUTO
from ..training.evaluation import evaluate
from ..training.loop import TrainOptions
from ..training.loop import train as train_run
from ..training.run_config import read_run_config
from ..training.run_state import claim_out, resume_settings
from ..training.sources import check_seq_len, load_config, model_source, read_data
from ..training.terminal import StepLog, check_writable, console, fail
from ..units import format_bytes
from .options import (
    CODEGEN_OPTION,
    DEVICE_OPTION,
    PREFETCH_OPTION,
    memory_budget_value,
    positive_epochs,
    size_value,
)

# -- train ------------------------------------------------------------------------------------------

DATA_HELP = ("a .jsonl, .json, .csv or .parquet file, a Dataset.save_to_disk folder, a dataset id in the local "
             "datasets cache (--split), or 'demo' (alias 'synthetic') for the built-in token set; records with "
             "messages, prompt + completion (or response), text, or input_ids")


def train(ctx: typer.Context,
          model: Optional[str] = typer.Argument(None, help="model folder (save_pretrained layout) or cached hub id"),
          model_option: Optional[str] = typer.Option(None, "--model", help="the same as MODEL; with --resume, where "
                                                     "the run's model is now (checked to be the same checkpoint)"),
          data: Optional[str] = typer.Option(None, help=DATA_HELP),
          out: Optional[Path] = typer.Option(None, help="folder for the PEFT adapter, its tokenizer, run.toml, "
                                             "metrics.jsonl and the state --resume reads; refused when it holds "
                                             "anything, unless --overwrite or --resume (the folder of a run "
                                             "stopped before its first save holds no run and is reused)"),
          from_config: Optional[str] = typer.Option(None, "--from-config", help="random weights from a built-in shape "
                                                    "or a config.json instead of MODEL (smoke tests)"),
          config: Optional[Path] = typer.Option(None, "--config", help="a TOML file of these options (run.toml, "
                                                "as every run writes one); the command line overrides it"),
          resume: Optional[Path] = typer.Option(None, "--resume", metavar="OUT", help="continue the run that wrote OUT "
                                                "(adapter, optimizer, RNG, step and data position; its settings "
                                                "too): bit-exact with a run that was never stopped. --steps N "
                                                "extends it; --model and --data follow moved files"),
          overwrite: bool = typer.Option(False, help="replace the run in a non-empty --out (its adapter, state, "
                                         "checkpoints and metrics)"),
          save_every: Optional[int] = typer.Option(None, min=1, help="also save adapter + resume state every N steps "
                                                   "(always at the end, and on Ctrl-C or SIGTERM)"),
          save_total_limit: Optional[int] = typer.Option(None, min=0, help="with --save-every, also keep the newest N "
                                                         "saves as OUT/checkpoint-STEP folders"),
          quantization: str = typer.Option("nf4", help="nf4 (QLoRA base) or bf16"),
          lora_r: int = typer.Option(16, min=1), lora_alpha: float = typer.Option(32.0, min=0.0),
          lora_dropout: float = typer.Option(0.05, min=0.0, max=1.0),
          target_modules: Optional[list[str]] = typer.Option(None, help="LoRA targets, repeated or comma-separated; "
                                                             "a name no module has is refused (default, or "
                                                             "all-linear: every linear of a decoder layer)"),
          steps: Optional[int] = typer.Option(None, min=1, help="optimizer steps (default: --epochs 1)"),
          epochs: Optional[float] = typer.Option(None, callback=positive_epochs, help="passes over the data "
                                                 "(above 0; rounded up to whole steps)"),
          lr: float = typer.Option(2e-4, min=0.0, help="peak learning rate (AdamW)"),
          weight_decay: float = typer.Option(0.0, min=0.0),
          warmup_steps: int = typer.Option(0, min=0, help="steps of linear warmup from 0 to --lr"),
          schedule: str = typer.Option("constant", help="learning rate after warmup: constant, linear or cosine "
                                       "(decaying to 0 at the last step)"),
          max_grad_norm: Optional[float] = typer.Option(None, min=0.0, help="clip the adapter's gradients to this total "
                                                        "norm (default: no clipping)"),
          seq_len: int = typer.Option(512, min=2, help="tokens per row"),
          pack: bool = typer.Option(True, help="pack examples end to end into rows (--no-pack: one example per row, "
                                    "truncated)"),
          train_on: str = typer.Option("completion", help="completion: the assistant turns, completions and responses; "
                                       "all: every token"),
          split: Optional[str] = typer.Option(None, help="split of a dataset folder or cached id (default: train)"),
          eval_data: Optional[str] = typer.Option(None, help="data to evaluate on during training (as --data)"),
          eval_every: Optional[int] = typer.Option(None, min=1, help="steps between evaluations (default: at the "
                                                   "end)"),
          batch_size: int = typer.Option(1, min=1, help="rows per micro-batch"),
          accumulate: int = typer.Option(1, min=1, help="micro-batches per optimizer step"),
          block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
          codegen: Optional[str] = CODEGEN_OPTION, device: Optional[str] = DEVICE_OPTION,
          memory_budget: Optional[str] = typer.Option(AUTO, "--memory-budget", callback=memory_budget_value,
                                                      help="device memory the step may use, e.g. 24GB, or auto (what "
                                                      "the device has free, less a margin): after the first step "
                                                      "the blocks that fit stay resident"),
          block_major: bool = typer.Option(True, help="with --accumulate N, run each block for all N micro-batches "
                                           "while it is loaded (--no-block-major: one micro-batch after the other; "
                                           "the result is the same bits)"),
          chunked_loss: bool = typer.Option(False, help="compute the head and the loss a vocabulary chunk at a time "
                                            "(long sequences: never the whole logits; not bitwise HF's loss)"),
          offload_boundaries: bool = typer.Option(False, help="keep the hidden states saved between blocks in host "
                                                  "memory until the backward needs them"),
          save_activations: int = typer.Option(0, min=0, metavar="N", help="the last N decoder-layer blocks keep their "
                                               "activations for the backward instead of recomputing them (memory for "
                                               "time; the same bits)"),
          cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                                     help="replay each decoder layer's kernels from CUDA graphs (fewer "
                                                     "host launches, the same bits, a graph memory pool on top; with "
                                                     "--accumulate N it needs --no-block-major). Default: on with CUDA, "
                                                     "except with --offload-boundaries"),
          least_memory: bool = typer.Option(False, help="the plan that holds the least device memory: every block "
                                            "streams every step, no CUDA graphs (--memory-budget auto gives way)"),
          seed: int = typer.Option(0, help="seeds the LoRA init, dropout, data order (and --from-config weights)"),
          metrics: bool = typer.Option(True, help="write OUT/metrics.jsonl (and TensorBoard events when tensorboard is "
                                       "installed)"),
          log_every: Optional[int] = typer.Option(None, min=1, help="steps between log lines when not on a terminal "
                                                  "(default: about 10 lines)")) -> None:
    """Train a LoRA adapter on a streamed base (NF4 or bf16) and write it as a standard PEFT adapter."""
    if model is not None and model_option is not None:
        raise fail("give the model once: MODEL or --model, not both")
    values = {name: value for name, value in locals().items() if name in _OPTION_NAMES}
    values["model"] = model_option if model_option is not None else model

    def typed(name: str) -> bool:  # written on the command line, not a default (typer vendors click: compare by name)
        names = ("model", "model_option") if name == "model" else (name,)
        return any(getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT") for n in names)

    if config is not None:
        if resume is not None:
            raise fail("--resume continues a run with its own settings; leave --config out")
        for name, value in read_run_config(config, _OPTION_NAMES, typing.get_type_hints(TrainOptions)).items():
            if not typed(name):
                values[name] = Path(value) if name == "out" else value
    saved: Optional[tuple[dict, dict]] = None
    if resume is not None:
        run, meta, tensors = resume_settings(values, typed, resume)
        saved = (meta, tensors)
        keep = {name: run[name] for name in _OPTION_NAMES if name in run and name != "out"}
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


# the train command's options that make up a run (train_run.TrainOptions); the rest steer the command itself
_OPTION_NAMES = ("model", "from_config", "data", "out", "quantization", "lora_r", "lora_alpha", "lora_dropout",
                 "target_modules", "steps", "epochs", "lr", "weight_decay", "seq_len", "pack", "batch_size",
                 "accumulate", "block_size", "prefetch", "codegen", "device", "seed", "log_every", "save_every",
                 "memory_budget", "block_major", "warmup_steps", "schedule", "max_grad_norm", "eval_data", "eval_every",
                 "save_total_limit", "train_on", "split", "metrics", "chunked_loss", "offload_boundaries",
                 "save_activations", "cuda_graphs", "least_memory")


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
