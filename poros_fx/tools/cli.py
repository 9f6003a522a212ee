"""``poros-fx``: the command line (``doctor``, ``check``, ``dump``, ``train``, ``export``).

    poros-fx doctor                      # versions, CUDA, pinned H2D bandwidth, backend="poros" resolves
    poros-fx check qwen2.5-32b           # family status, base bytes per block, predicted resident peak
    poros-fx check ./my-model/config.json --quantization bf16 --block-size 2
    poros-fx dump qwen2.5-7b --layers 2 --out dumps/   # schedule, graphs and timeline without training
    poros-fx train ./my-model --data train.jsonl --out my-adapter --steps 200   # LoRA/QLoRA, streamed
    poros-fx train --from-config qwen2.5-0.5b --data demo --out smoke --steps 5  # random weights, no files
    poros-fx export my-adapter --base ./my-model -o merged/   # adapter merged into a bf16 copy, streamed

MODEL_OR_CONFIG is a built-in shape (qwen2.5-0.5b, -7b, -32b, -72b), a ``config.json`` or a folder
holding one, or a hub id already in the local huggingface cache (nothing is downloaded).
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Optional

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
        table.add_row(name, "" if name == "..." else f"{sizes[names.index(name)] / 2**20:,.1f} MiB")
    console.print(table)
    console.print(f"base: {sum(sizes) / 2**30:.2f} GiB loaded by {len(names)} blocks per pass (the embedding's rows are "
                  "gathered from the host store, its table is loaded only where the head shares it); "
                  f"largest block {max(sizes) / 2**20:,.1f} MiB ({names[sizes.index(max(sizes))]})")
    ahead = 1 if prefetch == AUTO else prefetch
    console.print(f"predicted peak of base weights on the device: (1 + prefetch {ahead}) x largest block = "
                  f"{(1 + ahead) * max(sizes) / 2**20:,.1f} MiB (adapter, activations and logits come on top)"
                  + ("; prefetch auto loads one block ahead in the forward and deepens the backward only as far as "
                     f"half the free device memory allows (at most {LIMIT} blocks)" if prefetch == AUTO else ""))


@app.command()
def dump(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
         out: Path = typer.Option(Path("poros-dump"), help="folder for graphs, schedule.txt and timeline.png"),
         layers: int = typer.Option(2, min=1, help="decoder layers to build (real widths, random init)"),
         seq: int = typer.Option(64, min=1), nf4: bool = typer.Option(False, help="quantize the base to NF4"),
         block_size: int = typer.Option(1, min=1), prefetch: str = PREFETCH_OPTION,
         codegen: Optional[str] = CODEGEN_OPTION,
         device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when present)")) -> None:
    """Compile one training step and write its dumps, without training (random weights, LAYERS layers)."""
    import torch

    from .. import prepare
    from .tiny import demo_batches, lora_model

    config = load_config(model_or_config)
    config.num_hidden_layers = layers
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with console.status(f"building {config.model_type} with {layers} layers on {dev}"):
        model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device=dev)
        prepare(model, device=dev, block_size=block_size, prefetch=prefetch, codegen=codegen)
    batch = {k: v.to(dev) for k, v in demo_batches(1, vocab=config.vocab_size, seq=seq, batch=1)[0].items()}
    with console.status("compiling and running one step"):
        step = torch.compile(model, backend="poros", options={"dump": str(out)})
        step(**batch, use_cache=False).loss.backward()
    folder = sorted(out.glob("graph_*"), key=lambda p: p.stat().st_mtime)[-1]
    console.print((folder / "schedule.txt").read_text())
    console.print(f"wrote {folder}/ (graphs after every pass, schedule.txt, timeline.png)")


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


@app.command()
def train(model: Optional[str] = typer.Argument(None, help="model folder (save_pretrained layout) or cached hub id"),
          data: str = typer.Option(..., help="a .jsonl/.json/.csv file (text, prompt+response or input_ids "
                                   "records), or 'demo' for the built-in token set"),
          out: Path = typer.Option(..., help="folder for the PEFT adapter"),
          from_config: Optional[str] = typer.Option(None, "--from-config", help="random weights from a built-in shape "
                                                    "or a config.json instead of MODEL (smoke tests)"),
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
          codegen: Optional[str] = CODEGEN_OPTION,
          device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when present)"),
          seed: int = typer.Option(0, help="seeds the LoRA init, dropout, data order (and --from-config weights)"),
          log_every: Optional[int] = typer.Option(None, min=1, help="steps between log lines when not on a terminal "
                                                  "(default: about 10 lines)")) -> None:
    """Train a LoRA adapter on a streamed base (NF4 or bf16) and write it as a standard PEFT adapter."""
    import math

    import peft
    import torch

    from .. import stats
    from ..io.data import batches, load_dataset
    from ..errors import PorosError
    from ..io.loader import from_config as random_model
    from ..io.loader import load_pretrained, resolve_folder

    if (model is None) == (from_config is None):
        raise _fail("give either MODEL (a folder or cached hub id) or --from-config NAME_OR_CONFIG, not both or neither")
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
        tokenizer = _tokenizer(folder)
        hint = f" in {folder}" if folder is not None else f" for the built-in shape {from_config}"
        dataset = load_dataset(data, seq_len=seq_len, vocab_size=config.vocab_size, tokenizer=tokenizer, pack=pack,
                               tokenizer_hint=hint)
        if steps is None:
            steps = max(1, math.ceil((1.0 if epochs is None else epochs) * dataset.rows / (batch_size * accumulate)))
        console.print(f"data: {dataset.source}: {dataset.examples} examples ({', '.join(dataset.kinds)}) -> "
                      f"{dataset.rows} rows of {seq_len} tokens, {dataset.supervised_tokens} trained tokens; "
                      f"{steps} step(s) of {accumulate} x {batch_size} rows", soft_wrap=True, highlight=False)

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

    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    dev = trainable[0].device
    from .report import report

    console.print(report(peft_model), soft_wrap=True, highlight=False)
    console.print(f"model: {config.model_type}, {quantization} base streamed on {dev}, LoRA r={lora_r} "
                  f"alpha={lora_alpha} on {', '.join(targets)} ({sum(p.numel() for p in trainable):,} trainable "
                  f"parameters)", soft_wrap=True, highlight=False)
    peft_model.train()
    step_model = torch.compile(peft_model, backend="poros")
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    micro = batches(dataset, batch_size, steps * accumulate, seed)
    loss_value = float("nan")
    with _StepLog(steps, log_every) as log:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            total = torch.zeros((), device=dev)
            for _ in range(accumulate):
                batch = {k: v.to(dev) for k, v in next(micro).items()}
                loss = step_model(**batch, use_cache=False).loss / accumulate  # mean over the step's micro-batches
                loss.backward()
                total += loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = total.item()
            if not math.isfinite(loss_value):
                raise _fail(f"step {step}: loss is {loss_value}; lower --lr, or check the data")
            log.step(step, loss_value, time.perf_counter() - start)

    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out)
    s = stats(peft_model)
    console.print(f"final loss {loss_value:.4f} after {steps} steps; adapter written to {out}/ (peft.PeftModel."
                  f"from_pretrained, or `poros-fx export {out} --base MODEL -o MERGED`)", soft_wrap=True, highlight=False)
    console.print(f"poros: peak resident base {_mib(s['peak_resident_base_bytes'])} of {_mib(s['host_bytes'])} in the "
                  f"host store; {s['loads']} loads ({_mib(s['bytes_loaded'])}), {s['recomputed_blocks']} recomputed "
                  f"blocks, block size {s['block_size']}, prefetch {s['prefetch']}", soft_wrap=True, highlight=False)


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _StepLog:
    """A rich progress bar (loss, s/step) on a terminal; plain periodic lines otherwise (logs, CI, pipes)."""

    def __init__(self, steps: int, every: Optional[int]) -> None:
        self.steps = steps
        self.every = every or max(1, steps // 10)
        self.bar = None
        self.task = None
        self.times: list[float] = []

    def __enter__(self) -> "_StepLog":
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]}"),
                                TimeElapsedColumn(), console=console)
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.steps, loss="-", rate="(the first step compiles)")
        return self

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.times.append(seconds)
        # the first step compiles; the rate shown is that of the steps after it
        rate = statistics.mean(self.times[1:]) if len(self.times) > 1 else seconds
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4f}", rate=f"{rate:.2f} s/step")
        elif step == 1 or step % self.every == 0 or step == self.steps:
            console.print(f"step {step}/{self.steps}  loss {loss:.4f}  {rate:.2f} s/step"
                          + ("  (first step compiles)" if step == 1 else ""), highlight=False)

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
