"""``poros-fx``: the command line (``doctor``, ``check``, ``dump``).

    poros-fx doctor                      # versions, CUDA, pinned H2D bandwidth, backend="poros" resolves
    poros-fx check qwen2.5-32b           # family status, base bytes per block, predicted resident peak
    poros-fx check ./my-model/config.json --quantization bf16 --block-size 2
    poros-fx dump qwen2.5-7b --layers 2 --out dumps/   # schedule, graphs and timeline without training

MODEL_OR_CONFIG is a built-in shape (qwen2.5-0.5b, -7b, -32b, -72b), a ``config.json`` or a folder
holding one, or a hub id already in the local huggingface cache (nothing is downloaded).
"""

from __future__ import annotations

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

        from .backend import poros

        resolves = lookup_backend("poros") is poros
        table.add_row('backend="poros"', "resolves (entry point torch_dynamo_backends)" if resolves
                      else "[red]resolves to something else[/red]")
    except Exception as err:  # report, do not crash: this is the diagnosis command
        table.add_row('backend="poros"', f"[red]does not resolve: {err}[/red]")
    console.print(table)


@app.command()
def check(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
          quantization: str = typer.Option("nf4", help="nf4 or bf16"),
          block_size: int = typer.Option(1, min=1), prefetch: int = typer.Option(1, min=0)) -> None:
    """Family and its status, base bytes per block, and the predicted resident peak of the base. No weights."""
    from .errors import UnsupportedArchitectureError
    from .families import resolve
    from .sizes import block_bytes

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
    console.print(f"base: {sum(sizes) / 2**30:.2f} GiB in the host store, {len(names)} blocks; "
                  f"largest block {max(sizes) / 2**20:,.1f} MiB ({names[sizes.index(max(sizes))]})")
    console.print(f"predicted peak of base weights on the device: (1 + prefetch {prefetch}) x largest block = "
                  f"{(1 + prefetch) * max(sizes) / 2**20:,.1f} MiB (adapter, activations and logits come on top)")


@app.command()
def dump(model_or_config: str = typer.Argument(..., help="built-in shape, config.json, folder or cached hub id"),
         out: Path = typer.Option(Path("poros-dump"), help="folder for graphs, schedule.txt and timeline.png"),
         layers: int = typer.Option(2, min=1, help="decoder layers to build (real widths, random init)"),
         seq: int = typer.Option(64, min=1), nf4: bool = typer.Option(False, help="quantize the base to NF4"),
         block_size: int = typer.Option(1, min=1), prefetch: int = typer.Option(1, min=0),
         device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when present)")) -> None:
    """Compile one training step and write its dumps, without training (random weights, LAYERS layers)."""
    import torch

    from . import prepare
    from .tiny import demo_batches, lora_model

    config = load_config(model_or_config)
    config.num_hidden_layers = layers
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with console.status(f"building {config.model_type} with {layers} layers on {dev}"):
        model = lora_model(config, dtype=torch.bfloat16, nf4=nf4, dropout=0.1, device=dev)
        prepare(model, device=dev, block_size=block_size, prefetch=prefetch)
    batch = {k: v.to(dev) for k, v in demo_batches(1, vocab=config.vocab_size, seq=seq, batch=1)[0].items()}
    with console.status("compiling and running one step"):
        step = torch.compile(model, backend="poros", options={"dump": str(out)})
        step(**batch, use_cache=False).loss.backward()
    folder = sorted(out.glob("graph_*"), key=lambda p: p.stat().st_mtime)[-1]
    console.print((folder / "schedule.txt").read_text())
    console.print(f"wrote {folder}/ (graphs after every pass, schedule.txt, timeline.png)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
