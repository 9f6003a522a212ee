"""``poros-fx``: the command line (``demo``, ``doctor``, ``check``, ``dump``, ``train``, ``eval``, ``export``,
``exactness``, ``bench``).

    poros-fx demo                        # a tiny LoRA model trained streamed and resident: bit-exact or exit 1
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

This module is the typer app and the commands that inspect (``doctor``, ``check``, ``dump``) or measure
(``exactness``, ``bench``); ``demo.py`` holds ``demo``, ``train.py`` ``train``, ``eval`` and ``export``,
``options.py`` the options several commands share. The substance lives in ``training/``, ``bench/`` and ``exactness/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .. import bench as harness
from .. import distributed
from ..bench import multi_gpu as multi_bench
from ..bench import unsloth, unsloth_worker
from ..bench.h2d import measure_gpus, measure_ranks
from ..compiler.backend import poros
from ..compiler.estimate import long_context_plan, lora_bytes, step_memory
from ..compiler.host_fit import HOST_HEADROOM
from ..runtime.host_ram import host_ram_available
from ..errors import PorosError, UnsupportedArchitectureError
from ..exactness import sweep as exactness_sweep
from ..families import resolve
from ..io.loader import from_config as random_model
from ..io.sizes import block_bytes
from ..loss import loss_chunk_count
from ..models.tiny import demo_batches, lora_targets
from ..options import AUTO
from ..prepare import head_chunk_count
from ..runtime.arena import shm_dir, shm_free_bytes
from ..runtime.budget import estimate
from ..runtime.depth import LIMIT
from ..training.loop import Interrupted
from ..training.sources import load_config, set_layers
from ..training.terminal import check_writable, console, fail
from ..units import format_bytes, parse_size
from .demo import demo
from .kernels import linear_attention_paths
from .options import (
    CODEGEN_OPTION,
    DEVICE_OPTION,
    PREFETCH_OPTION,
    device_memory_value,
    device_value,
    memory_budget_value,
)
from .train import eval_command, export, train

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="poros-fx: stream a frozen LoRA/QLoRA base "
                  "through the GPU block by block, bit-exact, as a torch.compile backend.")
app.command()(demo)  # first in the help: the command to run first


@app.command()
def doctor() -> None:
    """Versions, CUDA, ranks, measured pinned host-to-device bandwidth per GPU (alone and all at once),
    shared memory for the multi-GPU host store, and whether backend="poros" resolves. Under torchrun
    (``torchrun --nproc-per-node N -m poros_fx doctor``) each rank measures its own GPU and rank
    0 prints the table."""
    import importlib.metadata as md

    import torch

    ranks = distributed.launched_ranks()
    h2d: list = []
    h2d_error = None
    cuda = torch.cuda.is_available()
    if ranks.distributed:
        import torch.distributed as dist

        try:
            distributed.init_process_group()
            if cuda:
                h2d = measure_ranks()
        except Exception as err:  # report, do not crash: this is the diagnosis command
            h2d_error = f"{type(err).__name__}: {err}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if ranks.rank != 0:
            return
    elif cuda:
        try:
            h2d = [vars(m) for m in measure_gpus()]
        except Exception as err:
            h2d_error = f"{type(err).__name__}: {err}"

    table = Table(title="poros-fx doctor", show_header=False)
    for name in ("poros-fx", "torch", "transformers", "peft", "bitsandbytes", "safetensors"):
        try:
            table.add_row(name, md.version(name))
        except md.PackageNotFoundError:
            table.add_row(name, "[red]not installed[/red]")
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        table.add_row("cuda", f"{torch.cuda.device_count()} GPU(s): {', '.join(names)} (torch CUDA {torch.version.cuda})")
    else:
        table.add_row("cuda", "no CUDA device")
    table.add_row("ranks", f"{ranks.world_size} (torchrun: {ranks.local_world_size} on this host)" if ranks.distributed
                  else "one process (several GPUs: torchrun --nproc-per-node N ...)")
    backends = [b for b in ("nccl", "gloo") if getattr(torch.distributed, f"is_{b}_available", lambda: False)()]
    table.add_row("torch.distributed", ", ".join(backends) if backends else "[red]not available[/red]")
    for what, path in linear_attention_paths():  # Qwen3.5's Gated DeltaNet layers
        table.add_row(f"qwen3.5 {what}", path)
    free = shm_free_bytes()
    table.add_row("shared memory", f"{shm_dir()}: {format_bytes(free)} free (the ranks of a host keep one copy of the "
                  "base here)" if free is not None else f"[red]{shm_dir()} does not exist[/red] (POROS_FX_SHM_DIR)")
    if h2d_error is not None:
        table.add_row("pinned H2D", f"[red]could not measure: {h2d_error}[/red]")
    elif not h2d:
        table.add_row("pinned H2D", "- (needs CUDA)")
    for m in h2d:
        together = "" if m["together"] is None else f", {m['together']:.1f} GB/s with every GPU copying"
        table.add_row(f"pinned H2D {m['device']}", f"{m['alone']:.1f} GB/s alone{together} (256 MiB from a "
                      f"{m['source']} arena, median of 5)")
    try:
        from torch._dynamo.backends.registry import lookup_backend

        resolves = lookup_backend("poros") is poros
        table.add_row('backend="poros"', "resolves (entry point torch_dynamo_backends)" if resolves
                      else "[red]resolves to something else[/red]")
    except Exception as err:  # report, do not crash: this is the diagnosis command
        table.add_row('backend="poros"', f"[red]does not resolve: {err}[/red]")
    console.print(table)


@app.command()
def check(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
          quantization: str = typer.Option("nf4", help="nf4 or bf16"),
          block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
          seq_len: int = typer.Option(512, min=1, help="tokens per row (for the step's estimate)"),
          batch_size: int = typer.Option(1, min=1, help="rows per micro-batch"),
          accumulate: int = typer.Option(1, min=1, help="micro-batches per optimizer step (block-major: all in flight)"),
          lora_r: int = typer.Option(16, min=1, help="LoRA rank on every linear of a decoder layer"),
          memory_budget: Optional[str] = typer.Option(None, "--memory-budget", callback=memory_budget_value,
                                                      help="show the blocks a budget would keep resident"),
          chunked_loss: bool = typer.Option(False, help="estimate with the head and loss in vocabulary chunks"),
          offload_boundaries: bool = typer.Option(False, help="estimate with the boundary activations in host "
                                                  "memory"),
          sequence_chunks: int = typer.Option(1, min=1, help="estimate with each layer's MLP and projections in "
                                              "this many token chunks"),
          device_memory: Optional[str] = typer.Option(None, "--device-memory", callback=device_memory_value,
                                                      help="a device's memory (24GB): the long-sequence options "
                                                      "the step needs to fit it, or the longest length that fits")) -> None:
    """Family and its status, base bytes per block, the predicted resident peak of the base, an estimate
    of the step's device memory and, with --memory-budget, the plan it would make. No weights."""
    config = load_config(model_or_config)
    try:
        family = resolve(config.model_type)
    except UnsupportedArchitectureError as err:
        raise fail(str(err))
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
    kinds = getattr(config, "layer_types", None)
    if block_size == 1 and isinstance(kinds, list) and len(set(kinds)) > 1 and len(kinds) == len(names) - 2:
        # layers of several structures (Qwen3.5: linear / full attention; Gemma 4: sliding / full)
        per_kind = {k: sorted({sizes[1 + i] for i, kk in enumerate(kinds) if kk == k}) for k in dict.fromkeys(kinds)}
        console.print("base bytes per layer structure: " + "; ".join(
            f"{k} x {kinds.count(k)}: {', '.join(format_bytes(b) for b in v)}" for k, v in per_kind.items()),
            soft_wrap=True, highlight=False)
    console.print(f"base: {format_bytes(sum(sizes))} loaded by {len(names)} blocks per pass (the embedding's rows are "
                  "gathered from the host store, its table is loaded only where the head shares it); "
                  f"largest block {format_bytes(max(sizes))} ({names[sizes.index(max(sizes))]})")
    ahead = (2 if memory_budget else 1) if prefetch == AUTO else prefetch  # a budget's forward loads two ahead
    # an lm_head over 512 MiB is loaded in row chunks of ~256 MiB (prepare.head_chunk_count): never whole
    chunks = head_chunk_count(sizes[-1], config.vocab_size)
    window = max([*sizes[:-1], -(-sizes[-1] // chunks)])
    if chunks > 1:
        console.print(f"the head is loaded in {chunks} row chunks of {format_bytes(sizes[-1] / chunks)}")
    console.print(f"predicted peak of base weights on the device: (1 + prefetch {ahead}) x largest load = "
                  f"{format_bytes((1 + ahead) * window)} (adapter, activations and logits come on top)"
                  + (f"; prefetch auto loads {'one block' if ahead == 1 else 'two blocks'} ahead in the forward and "
                     f"deepens the backward only as far as half the free device memory allows (at most {LIMIT} blocks)"
                     if prefetch == AUTO else ""))
    vocabulary_chunks = loss_chunk_count(config.vocab_size, chunks)
    adapter = lora_bytes(config, family, lora_targets(config.model_type), lora_r)
    layer_names = names if len(names) == config.num_hidden_layers + 2 else None  # one layer per block
    nf4_experts = quantization == "nf4"
    _check_step(config, layer_names, names, sizes, (1 + ahead) * window, seq_len, batch_size, accumulate, lora_r,
                adapter, memory_budget, vocabulary_chunks if chunked_loss else None, offload_boundaries,
                sequence_chunks, nf4_experts)
    if device_memory is not None:
        _check_device_memory(config, layer_names, (1 + ahead) * window, seq_len, batch_size, adapter,
                             vocabulary_chunks, device_memory, nf4_experts)


def _check_device_memory(config, layer_names: Optional[list[str]], window: int, seq_len: int, batch_size: int,
                         adapter: int, vocabulary_chunks: int, device_memory: int, nf4_experts: bool = False) -> None:
    """``check --device-memory``: the long-sequence options the estimate needs to fit, or the longest length."""
    plan = long_context_plan(config, window, seq=seq_len, batch=batch_size, adapter_bytes=adapter,
                             device_memory=device_memory, loss_chunks=vocabulary_chunks, names=layer_names,
                             nf4_experts=nf4_experts)
    flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in plan.options.items())
    where = f"seq {seq_len} in {format_bytes(device_memory)} of device memory"
    if plan.fits:
        console.print(f"{where}: estimated {format_bytes(plan.memory.total)} "
                      + (f"with {flags}" if flags else "with no long-sequence option"),
                      soft_wrap=True, highlight=False)
    else:
        console.print(f"{where}: does not fit (estimated {format_bytes(plan.memory.total)} with {flags}); "
                      + (f"the longest length that fits is about {plan.longest}" if plan.longest else
                         "no length fits: the base window and the adapter alone exceed it"),
                      soft_wrap=True, highlight=False)
    console.print("this estimate was within 1% of the measured peaks of the whole Qwen2.5-7B shape at 32768-131072 tokens "
                  "with all three options (docs/bench/long_context/cap24/); other shapes and settings are not measured",
                  soft_wrap=True, highlight=False)


def _check_step(config, layer_names: Optional[list[str]], names: list[str], sizes: list[int], window: int,
                seq_len: int, batch_size: int, accumulate: int, lora_r: int, adapter: int, memory_budget: Optional[str],
                loss_chunks: Optional[int] = None, offload_boundaries: bool = False, sequence_chunks: int = 1,
                nf4_experts: bool = False) -> None:
    """``check``'s estimate of the step (compiler/estimate.py) and, with a budget, the plan it would make."""
    console.print(f"LoRA targets (the family's default, train's without --target-modules): "
                  f"{', '.join(lora_targets(config.model_type))}", soft_wrap=True, highlight=False)
    est = step_memory(config, window, seq=seq_len, batch=batch_size, in_flight=accumulate, adapter_bytes=adapter,
                      names=layer_names, loss_chunks=loss_chunks, offload_boundaries=offload_boundaries,
                      sequence_chunks=sequence_chunks, nf4_experts=nf4_experts)
    console.print(f"estimated device memory of a streamed step (seq {seq_len}, batch {batch_size}, "
                  f"{accumulate} micro-batch(es) in flight{', block-major' if accumulate > 1 else ''}, LoRA r{lora_r} on "
                  f"those): {format_bytes(est.total)} = base window {format_bytes(est.base_window)} + adapter, "
                  f"gradients and AdamW {format_bytes(est.adapter)} + boundary activations {format_bytes(est.boundaries)}"
                  f"{' (offloaded: two on the device)' if offload_boundaries else ''} + logits {format_bytes(est.logits)}"
                  f"{f' (chunked loss: one of {loss_chunks} vocabulary chunks)' if loss_chunks else ''} + one layer's recompute {format_bytes(est.layer)} (an estimate: "
                  "a memory budget plans from the first step's measured peak)", soft_wrap=True, highlight=False)
    if offload_boundaries:
        # every layer's input and the last layer's output wait on the host until their backward (one set per
        # micro-batch in flight)
        offloaded = accumulate * (config.num_hidden_layers + 1) * batch_size * seq_len * config.hidden_size * 2
        available = host_ram_available()
        console.print(f"offloaded boundaries: {format_bytes(offloaded)} of page-locked host memory, next to the base's "
                      f"{format_bytes(sum(sizes))}"
                      + (f" (this host has {format_bytes(available)} available; a training step refuses to start where "
                         f"the boundaries' share is over what its host has available, less {format_bytes(HOST_HEADROOM)})"
                         if available is not None else ""), soft_wrap=True, highlight=False)
    if memory_budget is None:
        return
    if memory_budget == AUTO:
        console.print("memory budget auto: what the training device has free at the first step, less a margin; give "
                      "--memory-budget SIZE to see the plan a budget would make", soft_wrap=True, highlight=False)
        return
    budget = parse_size(memory_budget)
    kept, kept_bytes, copied = estimate(sizes, names, budget, est.total)
    before = 2 * sum(sizes)
    if budget < est.total:
        console.print(f"memory budget {format_bytes(budget)}: below the estimated streamed step "
                      f"({format_bytes(est.total)}); the first step would raise PorosOOMError naming the smallest budget "
                      "that works if its measured peak is above the budget too", soft_wrap=True, highlight=False)
        return
    layer_blocks = [n for n in kept if n.startswith("layers")]
    console.print(f"memory budget {format_bytes(budget)}: about {len(layer_blocks)} of {len(names) - 2} layer blocks"
                  f"{' and the head' if 'head' in kept else ''} would stay resident ({format_bytes(kept_bytes)}), "
                  f"base copied per forward + backward {format_bytes(copied)} instead of {format_bytes(before)}"
                  + (f" (once per optimizer step: its {accumulate} micro-batches run block-major)" if accumulate > 1
                     else ""), soft_wrap=True, highlight=False)


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

    if quantization not in ("nf4", "bf16"):
        raise fail(f"--quantization must be nf4 or bf16, got {quantization!r}")
    config = load_config(model_or_config)
    if layers is not None:
        set_layers(config, layers)
    count = config.num_hidden_layers
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets(config.model_type))
    try:
        with console.status(f"building {config.model_type} with {count} layers ({quantization}, random init)"):
            model = random_model(config, quantization=quantization, device=device, seed=0, lora=lora,
                                block_size=block_size, prefetch=prefetch, codegen=codegen, progress=False)
    except PorosError as e:
        hint = "" if layers is not None else f" (dump builds all {count} layers of the config; --layers 2 builds two)"
        raise fail(f"{e}{hint}")
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


# -- exactness -------------------------------------------------------------------------------------

@app.command()
def exactness(examples: int = typer.Option(40, min=1, help="training configurations to draw and run"),
              device: str = typer.Option("cpu", callback=device_value, help="cpu or cuda"),
              seed: int = typer.Option(0, help="Hypothesis seed (worker i draws with seed + i)"),
              workers: int = typer.Option(1, min=1, help="processes drawing at once (a GPU machine's CPU cores "
                                          "compile in parallel)"),
              json_path: Optional[Path] = typer.Option(None, "--json", help="write every row as JSON here"),
              md: Optional[Path] = typer.Option(None, help="write the table as markdown here"),
              shrink: bool = typer.Option(False, help="stop at the first failure and shrink it to the smallest "
                                          "configuration that still fails (one worker)")) -> None:
    """Draw whole training configurations and check each: streamed == stream=False (== the eager loop with
    the eager codegen), or a PorosError before the first optimizer step. Exit status 1 if any differs or
    crashed."""
    import shlex
    import sys

    for path in (json_path, md):
        if path is not None:
            check_writable(path)
    command = shlex.join(["poros-fx", *sys.argv[1:]])

    env = exactness_sweep.environment(device or "cpu")
    finished: list[exactness_sweep.Row] = []

    def write(rows: list[exactness_sweep.Row]) -> None:
        if json_path is not None:
            exactness_sweep.write_json(json_path, rows, env, command)
        if md is not None:
            exactness_sweep.write_markdown(md, rows, env, command)

    def show(row: exactness_sweep.Row) -> None:
        console.print(f"{row.status:8} {row.seconds:6.1f} s  {row.drawn}"
                      + (f"\n         {row.detail}" if row.status not in ("equal",) else ""),
                      soft_wrap=True, highlight=False)
        finished.append(row)
        write(finished)  # a sweep stopped part-way (a time limit, Ctrl-C) keeps the rows it finished

    exactness_sweep.quiet_libraries()
    if shrink:
        rows = exactness_sweep.sweep(examples, device or "cpu", seed, shrink=True, progress=show)
    else:
        rows = exactness_sweep.parallel_sweep(examples, device or "cpu", seed, workers, progress=show)
    write(rows)
    c = exactness_sweep.counts(rows)
    console.print(f"{len(rows)} examples: {c['equal']} equal, {c['refused']} refused, {c['differs']} differ, "
                  f"{c['crashed']} crashed", highlight=False)
    if shrink and rows and rows[-1].status not in ("equal", "refused"):
        console.print(f"smallest failing configuration:\n{rows[-1].config}", soft_wrap=True, highlight=False)
    if c["differs"] or c["crashed"]:
        raise typer.Exit(1)


# -- bench ------------------------------------------------------------------------------------------

WORKERS = ("multi-gpu", "unsloth")


def worker_value(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in WORKERS:
        raise typer.BadParameter(f"--worker must be one of {', '.join(WORKERS)}, got {value!r}")
    return value


@app.command()
def bench(models: str = typer.Option(harness.DEFAULT_MODELS, help=harness.HELP["models"]),
          methods: Optional[str] = typer.Option(None, help=harness.HELP["methods"]),
          block_sizes: str = typer.Option(harness.DEFAULT_BLOCK_SIZES, help=harness.HELP["block_sizes"]),
          seqs: str = typer.Option(harness.DEFAULT_SEQS, help=harness.HELP["seqs"]),
          accums: str = typer.Option(harness.DEFAULT_ACCUMS, help=harness.HELP["accums"]),
          grid: str = typer.Option("star", help=harness.HELP["grid"]),
          steps: int = typer.Option(10, min=1, help=harness.HELP["steps"]),
          warmup: Optional[int] = typer.Option(None, min=1, help=harness.HELP["warmup"]),
          batch: Optional[int] = typer.Option(None, min=1, help=harness.HELP["batch"]),
          device: str = typer.Option("cuda", help=harness.HELP["device"]),
          json_path: Path = typer.Option(Path("poros-bench.json"), "--json", help=harness.HELP["json"]),
          md: Optional[Path] = typer.Option(None, help=harness.HELP["md"]),
          plot: Optional[Path] = typer.Option(None, help=harness.HELP["plot"]),
          time_budget: Optional[float] = typer.Option(None, help=harness.HELP["time_budget"]),
          compiled_resident: bool = typer.Option(False, "--compiled-resident", help=harness.HELP["compiled_resident"]),
          profile: Optional[Path] = typer.Option(None, metavar="DIR", help=harness.HELP["profile"]),
          memory_profile: Optional[Path] = typer.Option(None, metavar="DIR", help=harness.HELP["memory_profile"]),
          memory_budget: Optional[str] = typer.Option(None, help=harness.HELP["memory_budget"]),
          checkpoints: Path = typer.Option(Path(harness.DEFAULT_CHECKPOINTS), metavar="DIR",
                                           help=harness.HELP["checkpoints"]),
          unsloth_offload_layers: Optional[int] = typer.Option(None, min=1, metavar="N",
                                                               help=harness.HELP["unsloth_offload_layers"]),
          compile_warm: bool = typer.Option(False, "--compile-warm", help=harness.HELP["compile_warm"]),
          device_memory_cap: Optional[str] = typer.Option(None, metavar="SIZE", help=harness.HELP["device_memory_cap"]),
          sequence_chunks: Optional[int] = typer.Option(None, min=1, metavar="K", help=harness.HELP["sequence_chunks"]),
          expert_lora: bool = typer.Option(False, "--expert-lora", help=harness.HELP["expert_lora"]),
          nproc: Optional[int] = typer.Option(None, min=1, help=harness.HELP["nproc"]),
          rows: Optional[str] = typer.Option(None, metavar="METHOD:NPROC,...", help=harness.HELP["rows"]),
          layers: Optional[int] = typer.Option(None, min=1, help=harness.HELP["layers"]),
          quantization: Optional[str] = typer.Option(None, help=harness.HELP["quantization"]),
          row_timeout: Optional[int] = typer.Option(None, min=1, metavar="SECONDS", help=harness.HELP["row_timeout"]),
          worker: Optional[str] = typer.Option(None, hidden=True, callback=worker_value,
                                               help=harness.HELP["worker"])) -> None:
    """Side-by-side benchmark: PEFT resident / checkpointing / compiled, Unsloth, poros streamed and resident
    (JSON, markdown, PNG); with --nproc, poros on one and on several GPUs and FSDP2 with CPU offload."""
    import shlex
    import sys

    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise fail(harness.NO_CUDA_MESSAGE)
    command = shlex.join(["poros-fx", *sys.argv[1:]])
    multi_only = {"--rows": rows, "--layers": layers, "--quantization": quantization, "--batch": batch,
                  "--row-timeout": row_timeout}
    one_gpu_only = {"--md": md, "--plot": plot, "--time-budget": time_budget, "--profile": profile,
                    "--memory-profile": memory_profile,
                    "--memory-budget": memory_budget, "--unsloth-offload-layers": unsloth_offload_layers,
                    "--compiled-resident": compiled_resident or None, "--compile-warm": compile_warm or None,
                    "--device-memory-cap": device_memory_cap, "--sequence-chunks": sequence_chunks,
                    "--expert-lora": expert_lora or None}
    try:
        if nproc is not None or worker == "multi-gpu":
            given = [flag for flag, value in one_gpu_only.items() if value is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to the "
                                 "multi-GPU rows (--nproc): leave it out, or run without --nproc")
            multi = harness.make_multi_config(
                nproc=nproc or 1, models=models, seqs=seqs, methods=methods, rows=rows, layers=layers,
                quantization=quantization, batch=batch or 1, steps=steps, warmup=warmup, device=device, timeout=row_timeout,
                out=json_path.with_suffix(""), command=command, row_json=json_path if worker else None)
        else:
            given = [flag for flag, value in multi_only.items() if value is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the multi-GPU "
                                 "rows only: give --nproc N too")
            config = harness.make_config(models=models, methods=methods or harness.DEFAULT_METHODS,
                                         block_sizes=block_sizes, seqs=seqs, accums=accums, grid=grid, steps=steps,
                                         warmup=warmup or 1, device=device, json_path=json_path,
                                         md_path=md, plot_path=plot, time_budget=time_budget,
                                         compiled_resident=compiled_resident, profile_dir=profile,
                                         memory_profile_dir=memory_profile,
                                         memory_budget=memory_budget, checkpoints=checkpoints,
                                         unsloth_offload_layers=unsloth_offload_layers, compile_warm=compile_warm,
                                         device_memory_cap=device_memory_cap, sequence_chunks=sequence_chunks or 1,
                                         expert_lora=expert_lora, command=command)
    except ValueError as e:
        raise fail(str(e))
    if worker == "multi-gpu":
        multi_bench.worker(multi)
    elif nproc is not None:
        console.print(multi_bench.markdown(multi_bench.launch(multi)), soft_wrap=True, highlight=False, markup=False)
    elif worker == "unsloth":
        (spec,), _ = harness.plan(config)
        unsloth_worker.run_worker(spec, config, unsloth.checkpoint_dir(config.checkpoints, spec.model, config.seed))
    else:
        harness.run(config)


app.command()(train)
app.command("eval")(eval_command)
app.command()(export)


def main() -> None:
    """The ``poros-fx`` script: every error is one ``error:`` line on stderr, exit code 2 for bad input (130 for
    Ctrl-C); click's usage errors and poros-fx's own errors alike."""
    from typer._click.exceptions import (  # typer vendors click: its exceptions
        NoArgsIsHelpError,
        UsageError,
    )

    try:
        code = app(standalone_mode=False, prog_name="poros-fx")
    except NoArgsIsHelpError as e:  # `poros-fx` alone: the help, as --help prints it
        print(e.ctx.get_help() if e.ctx is not None else e.format_message())
        raise SystemExit(0) from None
    except UsageError as e:
        hint = f" (poros-fx {e.ctx.command_path.split(' ', 1)[1]} --help)" if e.ctx is not None and " " in \
            e.ctx.command_path else " (poros-fx --help)"
        raise SystemExit(fail(e.format_message() + hint, code=2).exit_code) from None
    except typer.Abort:
        raise SystemExit(fail("aborted", code=130).exit_code) from None
    except Interrupted as e:
        raise SystemExit(fail(str(e), code=130).exit_code) from None
    except PorosError as e:
        raise SystemExit(fail(str(e), code=2).exit_code) from None
    raise SystemExit(code or 0)

