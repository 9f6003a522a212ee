"""The bench's choices (models, methods, grid) checked, and the rows they plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from .methods import METHODS, Method, State
from ..errors import PorosConfigError
from ..units import parse_size
from ..models.tiny import SHAPE_CONFIGS, expert_paths_of_config, qwen25_config, shape_config, tiny_config

NO_CUDA_MESSAGE = "poros-fx bench needs a CUDA GPU; use --device cpu --models tiny for a smoke run"
SIZES = ("0.5b", "7b", "32b", "72b")
# the real shapes of other families (models/configs/) follow the Qwen2.5 sizes
MODEL_ORDER = ("tiny", *(f"qwen2.5-{s}" for s in SIZES), *SHAPE_CONFIGS)
DEFAULT_MODELS = "0.5b,7b,32b,72b"
DEFAULT_METHODS = "peft_resident,peft_checkpointing,poros,poros_resident"
DEFAULT_BLOCK_SIZES = "1,2,4"
DEFAULT_SEQS = "512,2048"
DEFAULT_ACCUMS = "1,4"
ROW_KEY = ("model", "method", "block_size", "seq", "accum")
DEFAULT_CHECKPOINTS = "/tmp/poros-bench-checkpoints"  # the Unsloth rows' checkpoints (the device's disk)
MULTI_METHODS = ("poros", "fsdp2_offload")  # the multi-GPU rows' (--nproc)
MULTI_WARMUP = 2  # the multi-GPU rows' untimed steps unless --warmup says otherwise
MULTI_TIMEOUT_S = 1800  # seconds one multi-GPU row may run unless --row-timeout says otherwise


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = tuple(DEFAULT_MODELS.split(","))
    methods: tuple[str, ...] = tuple(DEFAULT_METHODS.split(","))
    block_sizes: tuple[int, ...] = (1, 2, 4)
    seqs: tuple[int, ...] = (512, 2048)
    accums: tuple[int, ...] = (1, 4)
    grid: Literal["star", "full"] = "star"
    steps: int = 10
    warmup: int = 1
    device: str = "cuda"
    json_path: Path = Path("poros-bench.json")
    md_path: Path | None = None  # None: the JSON path with .md
    plot_path: Path | None = None  # None: the JSON path with .png
    time_budget: float | None = None  # seconds; no new row starts after it
    compiled_resident: bool = False  # add compiled_resident (0.5B/7B/tiny only)
    profile_dir: Path | None = None  # one more step per row under torch.profiler: trace here, summary in the row
    memory_profile_dir: Path | None = None  # one more step per row under the allocator's history: snapshot here
    batch: int = 1
    seed: int = 0
    command: str = ""  # the command line, for the markdown
    memory_budget: str | None = None  # poros_budget's options={"memory_budget": ...}
    checkpoints: Path = Path(DEFAULT_CHECKPOINTS)  # unsloth_*: one checkpoint folder per model under it
    unsloth_offload_layers: int | None = None  # unsloth_offload: layers swapped (None: every decoder layer)
    compile_warm: bool = False  # compiled rows: cold in a fresh Inductor cache, then warm in a second process
    device_memory_cap: str | None = None  # every method's process may allocate this much device memory (CUDA)
    sequence_chunks: int = 1  # streamed rows: each decoder layer in this many token chunks (prepare's option)
    expert_lora: bool = False  # LoRA on every layer's experts too (PEFT's target_parameters; LoRA dropout 0)


def cap_device_memory(device: torch.device, cap: str | None) -> int | None:
    """Let this process allocate at most ``cap`` (a size string) of ``device``'s memory, as a card of that size
    would (the caching allocator raises out-of-memory past it); returns the cap in bytes."""
    limit = parse_size(cap, "--device-memory-cap")
    if limit is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    if limit > total:
        raise ValueError(f"--device-memory-cap {cap} is more than this device has ({total / 1e9:.1f} GB)")
    torch.cuda.set_per_process_memory_fraction(limit / total, index)
    return limit


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} must list integers >= 1, got {text!r}")
    return values


def model_name(name: str) -> str:
    """``7b`` / ``qwen2.5-7b`` -> ``qwen2.5-7b``; ``tiny`` stays."""
    key = name.strip().lower()
    if key == "tiny" or key in SHAPE_CONFIGS:
        return key
    key = key.removeprefix("qwen2.5-")
    if key not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: tiny, {', '.join(SIZES)} (or qwen2.5-SIZE), "
                         f"{', '.join(SHAPE_CONFIGS)}")
    return f"qwen2.5-{key}"


def build_config(model: str) -> Any:
    """The transformers config of a bench model name (``model_name``'s)."""
    if model in SHAPE_CONFIGS:
        return shape_config(model)
    return tiny_config("qwen2", layers=2) if model == "tiny" else qwen25_config(model.removeprefix("qwen2.5-"))


def make_config(*, models: str = DEFAULT_MODELS, methods: str = DEFAULT_METHODS,
                block_sizes: str = DEFAULT_BLOCK_SIZES, seqs: str = DEFAULT_SEQS, accums: str = DEFAULT_ACCUMS,
                grid: str = "star", steps: int = 10, warmup: int = 1, device: str = "cuda",
                json_path: str | Path = "poros-bench.json", md_path: str | Path | None = None,
                plot_path: str | Path | None = None, time_budget: float | None = None,
                compiled_resident: bool = False, profile_dir: str | Path | None = None,
                memory_profile_dir: str | Path | None = None, command: str = "",
                memory_budget: str | None = None, checkpoints: str | Path = DEFAULT_CHECKPOINTS,
                unsloth_offload_layers: int | None = None, compile_warm: bool = False,
                device_memory_cap: str | None = None, sequence_chunks: int = 1, expert_lora: bool = False,
                known_methods: Mapping[str, Method] = METHODS) -> BenchConfig:
    """A checked ``BenchConfig`` from the command-line strings (shared by the CLI and ``main``)."""
    method_names = tuple(m.strip() for m in methods.split(",") if m.strip())
    if compiled_resident and "compiled_resident" not in method_names:
        method_names += ("compiled_resident",)
    unknown = [m for m in method_names if m not in known_methods]
    if unknown or not method_names:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(known_methods)}")
    if grid not in ("star", "full"):
        raise ValueError(f"--grid must be star or full, got {grid!r}")
    if steps < 1 or warmup < 1:
        raise ValueError("--steps and --warmup must be >= 1 (the first step compiles; it is never timed)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if any(known_methods[m].budget for m in method_names):
        if memory_budget is None:
            raise ValueError(f"{', '.join(m for m in method_names if known_methods[m].budget)} need(s) --memory-budget "
                             "(e.g. 24GB)")

        try:
            parse_size(memory_budget)
        except PorosConfigError as e:
            raise ValueError(str(e)) from None
    if unsloth_offload_layers is not None and unsloth_offload_layers < 1:
        raise ValueError(f"--unsloth-offload-layers must be >= 1, got {unsloth_offload_layers}")
    if device_memory_cap is not None:
        if device == "cpu":
            raise ValueError("--device-memory-cap caps CUDA memory; leave it out with --device cpu")
        try:
            parse_size(device_memory_cap, "--device-memory-cap")
        except PorosConfigError as e:
            raise ValueError(str(e)) from None
    if sequence_chunks < 1:
        raise ValueError(f"--sequence-chunks must be >= 1, got {sequence_chunks}")
    model_names = tuple(model_name(m) for m in models.split(",") if m.strip())
    if expert_lora and not any(expert_paths_of_config(build_config(m)) for m in model_names):
        raise ValueError(f"--expert-lora adapts a mixture of experts' experts; none of {', '.join(model_names)} has any")
    json_path = Path(json_path)
    return BenchConfig(models=model_names, methods=method_names,
                       block_sizes=_ints(block_sizes, "block-sizes"), seqs=_ints(seqs, "seqs"),
                       accums=_ints(accums, "accums"), grid=grid, steps=steps, warmup=warmup,  # type: ignore[arg-type]
                       device=device, json_path=json_path, md_path=Path(md_path) if md_path else None,
                       plot_path=Path(plot_path) if plot_path else None, time_budget=time_budget,
                       compiled_resident=compiled_resident, profile_dir=Path(profile_dir) if profile_dir else None,
                       memory_profile_dir=Path(memory_profile_dir) if memory_profile_dir else None,
                       command=command, memory_budget=memory_budget, checkpoints=Path(checkpoints),
                       unsloth_offload_layers=unsloth_offload_layers, compile_warm=compile_warm,
                       device_memory_cap=device_memory_cap, sequence_chunks=sequence_chunks, expert_lora=expert_lora)


@dataclasses.dataclass(frozen=True)
class MultiGpuConfig:
    """The multi-GPU rows (``poros-fx bench --nproc N``, ``multi_gpu.py``): one model and sequence length,
    each row a torchrun job of ``rows`` processes; ``method`` and ``row_json`` are one worker's."""
    rows: tuple[tuple[str, int], ...] = ()  # (method, processes) of every row to run
    model: str = "qwen2.5-0.5b"  # model_name's
    layers: int | None = None  # decoder layers built (None: the model's)
    quantization: str = "nf4"
    seq: int = 512
    batch: int = 1  # rows per rank per step
    steps: int = 10
    warmup: int = MULTI_WARMUP
    device: str = "cuda"
    timeout: int = MULTI_TIMEOUT_S  # seconds one row may run
    out: Path = Path("poros-bench")  # multi_bench.json, multi_bench.md and logs/ in this folder
    command: str = ""
    method: str = "poros"  # a worker's row
    row_json: Path | None = None  # where a worker's rank 0 writes its row


def multi_rows(nproc: int, methods: str = ",".join(MULTI_METHODS),
               rows: str | None = None) -> tuple[tuple[str, int], ...]:
    """(method, processes) of every multi-GPU row: poros on 1 and on ``nproc`` processes and fsdp2_offload on
    ``nproc`` (those of ``methods``), or ``rows`` ("method:nproc,...") instead."""
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MULTI_METHODS]
    if unknown or not chosen:
        raise ValueError(f"unknown multi-GPU method(s) {unknown}; with --nproc, --methods lists some of "
                         f"{', '.join(MULTI_METHODS)}")
    if rows:
        out = []
        for item in rows.split(","):
            method, _, n = item.strip().partition(":")
            if method not in MULTI_METHODS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"--rows: {item!r} is not method:nproc with method one of {', '.join(MULTI_METHODS)} "
                                 "and nproc >= 1")
            out.append((method, int(n)))
        return tuple(out)
    return ((("poros", 1), ("poros", nproc)) if "poros" in chosen else ()) + (
        (("fsdp2_offload", nproc),) if "fsdp2_offload" in chosen else ())


def make_multi_config(*, nproc: int, models: str = "0.5b", seqs: str = "512", methods: str | None = None,
                      rows: str | None = None, layers: int | None = None, quantization: str | None = None,
                      batch: int = 1, steps: int = 10, warmup: int | None = None, device: str = "cuda",
                      timeout: int | None = None, out: str | Path = "poros-bench", command: str = "",
                      row_json: str | Path | None = None) -> MultiGpuConfig:
    """A checked ``MultiGpuConfig`` from the command-line strings: the first of ``models`` and of ``seqs``.
    With ``row_json``, one worker's: ``methods`` names its row's method."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if quantization not in (None, "nf4", "bf16"):
        raise ValueError(f"--quantization must be nf4 or bf16, got {quantization!r}")
    if steps < 1 or (warmup is not None and warmup < 1) or batch < 1:
        raise ValueError("--steps, --warmup and --batch must be >= 1")
    if timeout is not None and timeout < 1:
        raise ValueError(f"--row-timeout must be >= 1 second, got {timeout}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda with --nproc (torchrun gives each rank its GPU), got {device!r}")
    planned = multi_rows(nproc, methods or ",".join(MULTI_METHODS), rows)
    return MultiGpuConfig(rows=() if row_json else planned, method=planned[0][0],
                          row_json=Path(row_json) if row_json else None,
                          model=model_name(models.split(",")[0]), layers=layers, quantization=quantization or "nf4",
                          seq=_ints(seqs, "seqs")[0], batch=batch, steps=steps,
                          warmup=MULTI_WARMUP if warmup is None else warmup, device=device,
                          timeout=MULTI_TIMEOUT_S if timeout is None else timeout, out=Path(out),
                          command=command)


def shapes(config: BenchConfig) -> list[tuple[int, int]]:
    """The (seq, accum) pairs of the grid, the base pair first."""
    if config.grid == "full":
        return [(s, a) for s in config.seqs for a in config.accums]
    base_seq, base_accum = config.seqs[0], config.accums[0]
    return ([(base_seq, base_accum)] + [(s, base_accum) for s in config.seqs[1:]]
            + [(base_seq, a) for a in config.accums[1:]])


@dataclasses.dataclass(frozen=True)
class RowSpec:
    model: str
    method: str
    block_size: int | None
    seq: int
    accum: int

    def key(self) -> tuple:
        return (self.model, self.method, self.block_size, self.seq, self.accum)


def plan(config: BenchConfig, methods: Mapping[str, Method] = METHODS) -> tuple[list[RowSpec], list[str]]:
    """Every row to run, per model, and notes on the rows skipped. Within a (seq, accum) pair the rows
    of one model state run together, alternating which state comes first so each model switches
    state at most once per pair."""
    rows: list[RowSpec] = []
    notes: list[str] = []
    for model in config.models:
        chosen = []
        for name in config.methods:
            m = methods[name]
            if m.models is not None and model not in m.models:
                notes.append(f"{name} skipped for {model} (only {', '.join(m.models)})")
                continue
            chosen.append(m)
        # a base of another quantization is a model of its own: its rows come after the NF4 model's
        for quantization in sorted({m.quantization for m in chosen}, key=lambda q: q != "nf4"):
            for i, (seq, accum) in enumerate(shapes(config)):
                order: tuple[State, State] = ("prepared", "resident") if i % 2 == 0 else ("resident", "prepared")
                for state in order:
                    for m in (m for m in chosen if m.state == state and m.quantization == quantization):
                        for bs in (config.block_sizes if m.per_block_size else (None,)):
                            rows.append(RowSpec(model, m.name, bs, seq, accum))
    return rows, notes

