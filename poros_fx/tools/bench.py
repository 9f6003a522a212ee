"""The side-by-side benchmark (issue 3): PEFT baselines and poros in one process, one JSON matrix.

    python -m poros_fx.tools.bench --models 7b --json out/bench.json          # on the GPU
    poros-fx bench --models 0.5b,7b --methods poros --block-sizes 1,2,4 --json out/bench.json
    python -m poros_fx.tools.bench --device cpu --models tiny --steps 2       # CPU smoke run

Methods (``METHODS``): ``peft_resident`` (PEFT LoRA on a bitsandbytes NF4 base, eager),
``peft_checkpointing`` (the same + non-reentrant activation checkpointing), ``compiled_resident``
(the same under plain ``torch.compile``/Inductor; opt-in, 0.5B/7B only), ``compiled_regional`` (each
decoder layer under plain ``torch.compile``, resident) and ``compiled_regional_checkpointing`` (the same
with activation checkpointing), ``poros`` (streamed, one row per block size; the default options, so
prefetch "auto" and the device's codegen), ``poros_eager`` / ``poros_inductor`` (each codegen by name),
``poros_resident`` (``options={"stream": False}``), ``poros_budget`` (``options={"memory_budget":
--memory-budget}``: after the first step the blocks that fit stay resident), ``poros_micro_major``
(``options={"block_major": False}``: accumulated micro-batches one after the other; every other poros
method runs an accumulation row block-major, ``runtime/accumulate.py``) and, opt-in, ``poros_tensor_copies`` (``options={"group_copies": False}``: a copy per tensor
instead of per block) and ``poros_prefetch1`` (``options={"prefetch": 1}``: the fixed depth that was the
default before "auto"). Models: random-init
Qwen2.5 shapes (0.5b/7b/32b/72b), or ``tiny`` (a 2-layer qwen2 config, for CPU runs). Recipe: LoRA
r16 alpha 32 dropout 0.05 on all seven projections, AdamW, batch 1; one row per (seq, accum) pair of
the grid (``star``: the first seq and accum, plus each other seq at the first accum and each other
accum at the first seq; ``full``: every pair).

How the models are built: one ``poros_fx.io.loader.from_config`` call per model size, shared by every
row of that size. ``from_config`` generates and NF4-quantizes the base one tensor at a time on the
device and keeps it in the host store, so a 72B never exists in bf16 anywhere. The PEFT baselines
need the same NF4 base resident on the device: ``poros_fx.unprepare`` puts each tensor back where
``from_config`` left it (host memory), and ``model.to(device)`` then moves it tensor by tensor (a
quantized ``Params4bit`` carries its quant state along), so the device never holds more than the
NF4 base either; ``poros_fx.prepare`` takes it back into the store for the next poros row. This
reuses the loader's exact code path instead of a second builder, and every method trains the very
same weights (same seed), so their losses are comparable. Rows are ordered to switch between the
two states at most twice per (seq, accum) pair.

Per row: median seconds per optimizer step over ``--steps`` steps after ``--warmup`` steps
(``torch.cuda.synchronize`` around ``time.perf_counter`` on CUDA), ``max_memory_allocated`` over the
whole row (warm-up and compilation included; null on CPU), achieved H2D GB/s (the poros store's
``bytes_loaded`` during the timed steps over their time; poros rows only), the floor
``2 x streamed bytes x accum / pinned bandwidth`` (streamed bytes: what the blocks load in one pass,
the base without the gathered embedding table; each micro-batch streams it forward and again
for the backward; null on CPU), the first step's extra seconds over the median (compiled methods),
and the ratio of s/step to ``peft_resident`` of the same model, seq and accum (recomputed over the
whole merged file). A row that fails records ``"error": "ExceptionClass: first line"`` and the run
goes on. Results merge into an existing JSON (same model/method/block_size/seq/accum replaced), so
several device calls build one matrix. The JSON, the markdown table and the PNG plot are rewritten
after every row, so a call killed at its time limit keeps every row it finished; ``--time-budget``
stops starting rows once exceeded (the one in flight finishes) and says so in the JSON and markdown.

On the lent H200 run it as ``python3 -m poros_fx.tools.bench`` (the machine may lack typer, which only the
``poros-fx`` script needs); put the previous call's JSON at the ``--json`` path to extend it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import shlex
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn

from .tiny import SHAPE_CONFIGS, lora_targets

NO_CUDA_MESSAGE = "poros-fx bench needs a CUDA GPU; use --device cpu --models tiny for a smoke run"
SIZES = ("0.5b", "7b", "32b", "72b")
# the two real shapes of other families (tools/configs/): qwen3.5-27b, gemma-4-31b
MODEL_ORDER = ("tiny", *(f"qwen2.5-{s}" for s in SIZES), *SHAPE_CONFIGS)
DEFAULT_MODELS = "0.5b,7b,32b,72b"
DEFAULT_METHODS = "peft_resident,peft_checkpointing,poros,poros_resident"
DEFAULT_BLOCK_SIZES = "1,2,4"
DEFAULT_SEQS = "512,2048"
DEFAULT_ACCUMS = "1,4"
COMPILED_RESIDENT_MODELS = ("tiny", "qwen2.5-0.5b", "qwen2.5-7b")  # Inductor on a 32B+ resident base: not asked for
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_KEY = ("model", "method", "block_size", "seq", "accum")

State = Literal["prepared", "resident"]


# -- methods ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """What a method's setup returns: the callable a micro-batch goes through, and how to undo the setup."""

    forward: Callable[..., Any]  # forward(**batch, use_cache=False) -> output with .loss
    teardown: Callable[[], None] = lambda: None
    # the context an optimizer step's micro-batches run in (poros: block-major, runtime/accumulate.py)
    micro_batches: Callable[[list], Any] = lambda batches: contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Method:
    """One benchmarked method: the model state it needs and how it turns the model into a ``Runner``.

    ``setup(model, block_size)`` gets the shared PEFT model (in ``state``) and the row's block size
    (``None`` unless ``per_block_size``). Pass extra ``Method``s to ``run(..., methods=...)`` to add one.
    """

    name: str
    state: State
    setup: Callable[[nn.Module, int | None], Runner]
    compiled: bool = False  # the first step compiles: report compile_s
    streams: bool = False  # a poros store counts its loads: report h2d_gbps
    per_block_size: bool = False  # one row per --block-sizes value
    models: tuple[str, ...] | None = None  # only these models (None: all)
    budget: bool = False  # setup also takes memory_budget= (the run's --memory-budget)


def _peft_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(model)


def _peft_checkpointing(model: nn.Module, block_size: int | None) -> Runner:
    # non-reentrant checkpointing needs no enable_input_require_grads: it does not rely on the
    # checkpointed block's input requiring grad (the reentrant variant does)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode
    return Runner(model, teardown=model.gradient_checkpointing_disable)


def _compiled_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(torch.compile(model))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    from ..families import resolve
    from ..prepare import causal_lm

    lm = causal_lm(model)
    return lm.get_submodule(resolve(lm.config.model_type).layers)


def _regional(checkpointing: bool) -> Callable[[nn.Module, int | None], Runner]:
    """Resident PEFT with each decoder layer under plain ``torch.compile`` (Inductor): PyTorch's
    "regional compilation" recipe, one compile for every layer of the same structure; optionally with
    transformers' activation checkpointing (each layer's compiled forward rerun in the backward)."""

    def setup(model: nn.Module, block_size: int | None) -> Runner:
        layers = _decoder_layers(model)
        for layer in layers:
            layer.compile()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()

        def teardown() -> None:
            for layer in layers:
                layer._compiled_call_impl = None
            if checkpointing:
                model.gradient_checkpointing_disable()

        return Runner(model, teardown=teardown)

    return setup


def _poros_teardown(model: nn.Module) -> Callable[[], None]:
    from ..prepare import get_store

    def teardown() -> None:
        store = get_store(model)
        if store is not None:
            store.resident_cache.clear()  # stream=False keeps device copies; the next row must not see them
            store.schedules.clear()  # each compiled graph's schedule and runtime: dead once the row is over

    return teardown


def _poros_with(**options: Any) -> Callable[[nn.Module, int | None], Runner]:
    """A streamed poros method: the row's block size plus ``options``; with accumulation its micro-batches
    run block-major unless ``options`` say ``block_major=False``."""
    from ..runtime.accumulate import block_major

    def setup(model: nn.Module, block_size: int | None) -> Runner:
        return Runner(torch.compile(model, backend="poros", options={"block_size": block_size or 1, **options}),
                      teardown=_poros_teardown(model),
                      micro_batches=lambda batches: block_major(model, batches))

    return setup


_poros = _poros_with()
_poros_eager = _poros_with(codegen="eager")
_poros_inductor = _poros_with(codegen="inductor")
_poros_tensor_copies = _poros_with(group_copies=False)
_poros_prefetch1 = _poros_with(prefetch=1)
_poros_micro_major = _poros_with(block_major=False)


def _poros_budget(model: nn.Module, block_size: int | None, memory_budget: str | None = None) -> Runner:
    """Streamed with ``options={"memory_budget": ...}``: the first step measures, then blocks that fit
    stay resident (runtime/budget.py)."""
    from ..prepare import get_store

    runner = _poros_with(memory_budget=memory_budget)(model, block_size)
    clear = runner.teardown

    def teardown() -> None:
        store = get_store(model)
        if store is not None:  # the next row streams again
            store.forget_plan()
            store.memory_budget = None
        clear()

    return Runner(runner.forward, teardown=teardown, micro_batches=runner.micro_batches)


def _poros_resident(model: nn.Module, block_size: int | None) -> Runner:
    return Runner(torch.compile(model, backend="poros", options={"stream": False}), teardown=_poros_teardown(model))


METHODS: Mapping[str, Method] = types.MappingProxyType({
    "peft_resident": Method("peft_resident", "resident", _peft_resident),
    "peft_checkpointing": Method("peft_checkpointing", "resident", _peft_checkpointing),
    "compiled_resident": Method("compiled_resident", "resident", _compiled_resident, compiled=True,
                                models=COMPILED_RESIDENT_MODELS),
    "compiled_regional": Method("compiled_regional", "resident", _regional(False), compiled=True),
    "compiled_regional_checkpointing": Method("compiled_regional_checkpointing", "resident", _regional(True),
                                              compiled=True),
    "poros": Method("poros", "prepared", _poros, compiled=True, streams=True, per_block_size=True),
    # each codegen by name (poros runs the device's default one)
    "poros_eager": Method("poros_eager", "prepared", _poros_eager, compiled=True, streams=True, per_block_size=True),
    "poros_inductor": Method("poros_inductor", "prepared", _poros_inductor, compiled=True, streams=True,
                             per_block_size=True),
    "poros_resident": Method("poros_resident", "prepared", _poros_resident, compiled=True, streams=True),
    # streamed with --memory-budget: blocks that fit stay resident after the first step
    "poros_budget": Method("poros_budget", "prepared", _poros_budget, compiled=True, streams=True,
                           per_block_size=True, budget=True),
    # accumulation micro-batch after micro-batch, each copying the base (the default runs them block-major)
    "poros_micro_major": Method("poros_micro_major", "prepared", _poros_micro_major, compiled=True, streams=True,
                                per_block_size=True),
    # a fixed prefetch depth of 1 against the default "auto" (opt-in, for A/B runs)
    "poros_prefetch1": Method("poros_prefetch1", "prepared", _poros_prefetch1, compiled=True, streams=True,
                              per_block_size=True),
    # the runtime before a block became one copy: one copy and allocation per tensor (opt-in, for A/B runs)
    "poros_tensor_copies": Method("poros_tensor_copies", "prepared", _poros_tensor_copies, compiled=True,
                                  streams=True, per_block_size=True),
})


# -- configuration ----------------------------------------------------------------------------------

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
    batch: int = 1
    seed: int = 0
    command: str = ""  # the command line, for the markdown
    memory_budget: str | None = None  # poros_budget's options={"memory_budget": ...}


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


def make_config(*, models: str = DEFAULT_MODELS, methods: str = DEFAULT_METHODS,
                block_sizes: str = DEFAULT_BLOCK_SIZES, seqs: str = DEFAULT_SEQS, accums: str = DEFAULT_ACCUMS,
                grid: str = "star", steps: int = 10, warmup: int = 1, device: str = "cuda",
                json_path: str | Path = "poros-bench.json", md_path: str | Path | None = None,
                plot_path: str | Path | None = None, time_budget: float | None = None,
                compiled_resident: bool = False, profile_dir: str | Path | None = None, command: str = "",
                memory_budget: str | None = None, known_methods: Mapping[str, Method] = METHODS) -> BenchConfig:
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
            raise ValueError("poros_budget needs --memory-budget (e.g. 24GB)")
        from ..runtime.budget import parse_size
        from ..errors import PorosConfigError

        try:
            parse_size(memory_budget)
        except PorosConfigError as e:
            raise ValueError(str(e)) from None
    json_path = Path(json_path)
    return BenchConfig(models=tuple(model_name(m) for m in models.split(",") if m.strip()), methods=method_names,
                       block_sizes=_ints(block_sizes, "block-sizes"), seqs=_ints(seqs, "seqs"),
                       accums=_ints(accums, "accums"), grid=grid, steps=steps, warmup=warmup,  # type: ignore[arg-type]
                       device=device, json_path=json_path, md_path=Path(md_path) if md_path else None,
                       plot_path=Path(plot_path) if plot_path else None, time_budget=time_budget,
                       compiled_resident=compiled_resident, profile_dir=Path(profile_dir) if profile_dir else None,
                       command=command, memory_budget=memory_budget)


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
        for i, (seq, accum) in enumerate(shapes(config)):
            order: tuple[State, State] = ("prepared", "resident") if i % 2 == 0 else ("resident", "prepared")
            for state in order:
                for m in (m for m in chosen if m.state == state):
                    for bs in (config.block_sizes if m.per_block_size else (None,)):
                        rows.append(RowSpec(model, m.name, bs, seq, accum))
    return rows, notes


# -- measuring --------------------------------------------------------------------------------------

def measure_pinned_h2d(device: str | torch.device = "cuda", mib: int = 512, reps: int = 5) -> float:
    """Pinned host-to-device copy bandwidth in GB/s (median of ``reps`` copies of ``mib`` MiB)."""
    from .h2d import copy_seconds

    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    return host.numel() / statistics.median(copy_seconds(host, torch.device(device), reps)) / 1e9


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device, and (CUDA) the measured pinned H2D bandwidth."""
    import importlib.metadata as md

    env: dict[str, Any] = {"device": str(device), "python": sys.version.split()[0]}
    for name in ("poros-fx", "torch", "transformers", "peft", "bitsandbytes"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = None
    cuda = device.type == "cuda"
    env["gpu"] = torch.cuda.get_device_name(device) if cuda else None
    env["cuda"] = torch.version.cuda if cuda else None
    env["pinned_h2d_gbps"] = round(measure_pinned_h2d(device), 2) if cuda else None
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # compiled graphs hold their model's tensors and would recompile-guard on the next row


def build_config(model: str) -> Any:
    from .tiny import qwen25_config, shape_config, tiny_config

    if model in SHAPE_CONFIGS:
        return shape_config(model)
    return tiny_config("qwen2", layers=2) if model == "tiny" else qwen25_config(model.removeprefix("qwen2.5-"))


class ModelHolder:
    """The one model of a size shared by its rows, switched between the host store and the device."""

    def __init__(self, name: str, device: torch.device, seed: int) -> None:
        import peft

        from ..io.loader import from_config

        self.name = name
        self.device = device
        self.config = build_config(name)
        torch.manual_seed(seed)  # the LoRA A init
        # every linear of a decoder layer: the seven projections (Qwen3.5 also its Gated DeltaNet's five)
        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=lora_targets(self.config.model_type))
        self.model = from_config(self.config, "nf4", device=device, seed=seed, lora=lora, block_size=1,
                                 progress=False)
        self.state: State = "prepared"

    def ensure(self, state: State) -> nn.Module:
        from ..prepare import prepare, unprepare

        if state != self.state:
            if state == "resident":
                unprepare(self.model)  # back to host memory, tensor by tensor
                self.model.to(self.device)  # then onto the device, tensor by tensor
            else:
                prepare(self.model, device=self.device, block_size=1)
            self.state = state
            _free(self.device)
        return self.model


def _batches(vocab: int, seq: int, count: int, batch: int, device: torch.device, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def _error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _empty_row(spec: RowSpec) -> dict[str, Any]:
    return {"model": spec.model, "method": spec.method, "block_size": spec.block_size, "seq": spec.seq,
            "accum": spec.accum, "s_per_step": None, "peak_gb": None, "h2d_gbps": None, "floor_s": None,
            "compile_s": None, "ratio_vs_peft_resident": None, "first_step_s": None, "steps": 0,
            "base_gb": None, "peak_resident_base_gb": None, "loss": None, "wall_s": None, "error": None}


def run_row(holder: ModelHolder, method: Method, spec: RowSpec, config: BenchConfig, pinned_gbps: float | None,
            base_bytes: int, streamed_bytes: int) -> dict[str, Any]:
    """One row: set the method up on the shared model, warm up, time ``config.steps`` optimizer steps.

    ``base_bytes``: the host store's size; ``streamed_bytes``: what one pass loads (every block once:
    the embedding's table is gathered, not loaded), the floor's numerator."""
    from ..prepare import get_store
    from ..stats import stats

    device = holder.device
    row = _empty_row(spec)
    row["base_gb"] = round(base_bytes / 1e9, 3)
    row["streamed_gb"] = round(streamed_bytes / 1e9, 3)
    if pinned_gbps:
        row["floor_s"] = round(2 * streamed_bytes * spec.accum / (pinned_gbps * 1e9), 4)
        if spec.accum > 1:  # block-major: each block crosses twice per optimizer step, whatever the accumulation
            row["floor_block_major_s"] = round(2 * streamed_bytes / (pinned_gbps * 1e9), 4)
    model = holder.ensure(method.state)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = _batches(holder.config.vocab_size, spec.seq, spec.accum, config.batch, device, config.seed)
    runner = optimizer = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        runner = (method.setup(model, spec.block_size, memory_budget=config.memory_budget) if method.budget
                  else method.setup(model, spec.block_size))
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        torch.manual_seed(config.seed)  # the dropout masks

        def step() -> float:
            _sync(device)
            start = time.perf_counter()
            total = 0.0
            with runner.micro_batches(batches) if spec.accum > 1 else contextlib.nullcontext():
                for batch in batches:
                    loss = runner.forward(**batch, use_cache=False).loss / spec.accum
                    loss.backward()
                    total += loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            seconds = time.perf_counter() - start
            row["loss"] = float(total)
            return seconds

        first = step()
        for _ in range(config.warmup - 1):
            step()
        if method.streams:
            stats(model, reset=True)
        allocator_before = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        objects = len(gc.get_objects())
        with GcTimer() as collector:
            times = [step() for _ in range(config.steps)]
        # Python's garbage collector inside the timed steps: a host-bound step pays for every object the
        # process holds (a process that compiled other methods before holds millions)
        row["gc"] = {"s_per_step": round(collector.seconds / len(times), 5), "collections": collector.collections,
                     "python_objects": objects}
        if device.type == "cuda":  # the caching allocator in the timed steps: 0 device allocations once warm
            allocator = torch.cuda.memory_stats(device)
            row["allocator"] = {
                "device_allocs": allocator.get("num_device_alloc", 0) - allocator_before.get("num_device_alloc", 0),
                "alloc_retries": allocator.get("num_alloc_retries", 0) - allocator_before.get("num_alloc_retries", 0),
                "reserved_peak_gb": round(allocator.get("reserved_bytes.all.peak", 0) / 1e9, 3)}
        median = statistics.median(times)
        row.update(s_per_step=round(median, 5), first_step_s=round(first, 3), steps=len(times))
        if method.compiled:
            row["compile_s"] = round(max(0.0, first - median), 3)
        if method.streams:
            s = stats(model)
            row["h2d_gbps"] = _sig(s["bytes_loaded"] / sum(times) / 1e9)
            row["peak_resident_base_gb"] = round(s["peak_resident_base_bytes"] / 1e9, 3)
            row["copies_per_step"] = round(s["copies"] / len(times))  # host-to-device copy calls
            row["copied_gb_per_step"] = round(s["bytes_copied"] / len(times) / 1e9, 3)  # per optimizer step
            if s["residency_plan"] is not None:  # poros_budget: the plan the first step made
                plan = s["residency_plan"]
                row["memory_budget_gb"] = round(plan["budget"] / 1e9, 3)
                row["resident_blocks"] = len(plan["resident_blocks"])
                row["streamed_peak_gb"] = round(plan["streamed_peak"] / 1e9, 3)
                row["predicted_peak_gb"] = round(plan["predicted_peak"] / 1e9, 3)
                row["copied_gb_per_microbatch"] = round(plan["streamed_bytes_per_step"] / 1e9, 3)
                row["plan_adjustments"] = plan["adjustments"]  # kept blocks given back after the first step
            schedules = getattr(get_store(model), "schedules", [])
            row["prefetch"] = schedules[-1].prefetch if schedules else None
            if schedules and schedules[-1].prefetch_note:
                row["prefetch_note"] = schedules[-1].prefetch_note
        if device.type == "cuda":
            row["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 3)
        if config.profile_dir is not None:  # after the peak is read: the profiler allocates too
            from .profiling import profile_step

            slug = _label(spec).replace(" ", "-").replace(".", "")
            row["profile"] = profile_step(step, Path(config.profile_dir) / f"{slug}.trace.json.gz")
    finally:
        if runner is not None:
            runner.teardown()
        for p in params:
            p.grad = None
        runner = optimizer = batches = None  # the step closure's cells: frees the optimizer state and batches
        _free(device)
    return row


class GcTimer:
    """Time spent in Python's garbage collector while the context is open, and collections per generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")  # a tiny CPU model's rate is far below 0.001 GB/s: keep significant digits


def _num(x: Any) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# -- the run ----------------------------------------------------------------------------------------

def run(config: BenchConfig, methods: Mapping[str, Method] = METHODS,
        log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    """Run every planned row, merging each into ``config.json_path`` (and rewriting the markdown and
    the plot) as soon as it is measured, so a run killed midway keeps every finished row.

    Returns the merged document. A row's failure is recorded in its ``error`` and the run goes on.
    """
    from ..io.loader import estimate_host_bytes
    from ..io.sizes import block_bytes
    from ..prepare import resolve_device

    started = time.perf_counter()
    device = resolve_device(config.device)
    specs, notes = plan(config, methods)
    env = environment(device)
    env["command"] = config.command
    for note in notes:
        log(f"note: {note}")
    log(f"bench: {len(specs)} row(s) on {env['gpu'] or device}"
        + (f", pinned H2D {env['pinned_h2d_gbps']} GB/s" if env["pinned_h2d_gbps"] else ""))
    doc = start_run(load(config.json_path), env)
    save(doc, config)
    holder: ModelHolder | None = None
    build_error: str | None = None
    for i, spec in enumerate(specs):
        if config.time_budget is not None and time.perf_counter() - started > config.time_budget:
            stopped = (f"time budget of {config.time_budget:g} s exceeded after {i} of {len(specs)} row(s); not run: "
                       + ", ".join(_label(s) for s in specs[i:]))
            doc["env"]["runs"][-1]["stopped"] = stopped
            log(f"stopped: {stopped}")
            break
        row_started = time.perf_counter()
        if holder is None or holder.name != spec.model:
            holder = None
            _free(device)
            build_error = None
            try:
                log(f"building {spec.model} (random-init NF4, from_config) on {device}")
                holder = ModelHolder(spec.model, device, config.seed)
                build_s = round(time.perf_counter() - row_started, 1)
                doc["env"]["runs"][-1].setdefault("build_s", {})[spec.model] = build_s
                log(f"  built in {build_s} s")
            except Exception as e:  # noqa: BLE001 - a model that cannot be built fails its rows, not the run
                build_error = f"build failed: {_error(e)}"
                log(f"  {build_error}")
        row_started = time.perf_counter()  # wall_s: the row alone, without the model build
        row = _empty_row(spec)
        if holder is None:
            row["error"] = build_error
        else:
            try:
                row = run_row(holder, methods[spec.method], spec, config, env["pinned_h2d_gbps"],
                              estimate_host_bytes(holder.config, "nf4"), sum(block_bytes(holder.config, "nf4")[1]))
            except Exception as e:  # noqa: BLE001 - OOM or any failure: record it and go on
                row["error"] = _error(e)
            # freed here, after the except block: until then the traceback keeps the failed step's tensors
            _free(device)
        row["wall_s"] = round(time.perf_counter() - row_started, 1)  # device time a row costs, for planning
        log(_describe(row))
        upsert(doc, row)
        save(doc, config)
    holder = None
    _free(device)
    save(doc, config)
    log(f"wrote {config.json_path}, {md_path(config)}, {plot_path(config)} "
        f"({time.perf_counter() - started:.0f} s)")
    return doc


def _label(spec: RowSpec) -> str:
    bs = f" bs{spec.block_size}" if spec.block_size is not None else ""
    return f"{spec.model} {spec.method}{bs} seq{spec.seq} x{spec.accum}"


def _describe(row: dict[str, Any]) -> str:
    spec = RowSpec(*(row[k] for k in ROW_KEY))
    if row["error"]:
        return f"  {_label(spec)}: ERROR {row['error']}"
    parts = [f"{row['s_per_step']:.4f} s/step"]
    if row["peak_gb"] is not None:
        parts.append(f"peak {row['peak_gb']:.2f} GB")
    if row["h2d_gbps"] is not None:
        parts.append(f"H2D {row['h2d_gbps']:.4g} GB/s")
    if row["compile_s"] is not None:
        parts.append(f"compile {row['compile_s']:.1f} s")
    return f"  {_label(spec)}: " + ", ".join(parts)


# -- outputs ----------------------------------------------------------------------------------------

def _sort_key(row: dict[str, Any]) -> tuple:
    model = MODEL_ORDER.index(row["model"]) if row["model"] in MODEL_ORDER else len(MODEL_ORDER)
    order = list(METHODS)
    method = order.index(row["method"]) if row["method"] in order else len(order)
    return (model, row["model"], row["seq"], row["accum"], method, row["method"], row["block_size"] or 0)


def ratios(rows: list[dict[str, Any]]) -> None:
    """Set ``ratio_vs_peft_resident`` on every row (in place): its s/step over the ``peft_resident`` row
    of the same model, seq and accum (the matrix holds one), and ``ratio_cross_run: True`` when that
    row came from another run — step times move ±15–40 % between the hosts lent on different days,
    so only a same-run ratio compares like with like."""
    reference = {(r["model"], r["seq"], r["accum"]): (r.get("run"), r["s_per_step"]) for r in rows
                 if r["method"] == "peft_resident" and _num(r["s_per_step"])}
    for r in rows:
        run, ref = reference.get((r["model"], r["seq"], r["accum"]), (None, None))
        r["ratio_vs_peft_resident"] = round(r["s_per_step"] / ref, 4) if ref and _num(r["s_per_step"]) else None
        r.pop("ratio_cross_run", None)
        if r["ratio_vs_peft_resident"] is not None and run != r.get("run"):
            r["ratio_cross_run"] = True


def load(path: Path) -> dict[str, Any]:
    """The document at ``path``, or an empty one."""
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"env": {}, "rows": []}


def start_run(doc: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with this run's environment on top, its command added to ``commands`` and itself to ``runs``."""
    old = doc.get("env", {})
    commands = [c for c in old.get("commands", []) if c]
    if env.get("command") and env["command"] not in commands:
        commands.append(env["command"])
    runs = [*old.get("runs", []), dict(env)]
    return {"env": {**env, "commands": commands, "runs": runs}, "rows": list(doc.get("rows", []))}


def upsert(doc: dict[str, Any], row: dict[str, Any]) -> None:
    """Put ``row`` in ``doc`` in place of the row with the same model/method/block_size/seq/accum, marked
    with the run that measured it (``run``: its 1-based index in ``env.runs``, the newest)."""
    row["run"] = len(doc["env"].get("runs", [])) or None
    key = tuple(row[k] for k in ROW_KEY)
    doc["rows"] = [r for r in doc["rows"] if tuple(r[k] for k in ROW_KEY) != key] + [row]


def save(doc: dict[str, Any], config: BenchConfig) -> None:
    """Sort the rows, recompute the ratios, write the JSON (atomically), the markdown and the plot."""
    doc["rows"].sort(key=_sort_key)
    ratios(doc["rows"])
    path = config.json_path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # a run killed mid-write never leaves a half-written matrix
    write_outputs(doc, config)


def merge(path: Path, env: dict[str, Any], new_rows: list[dict[str, Any]], config: BenchConfig | None = None
          ) -> dict[str, Any]:
    """Merge ``new_rows`` (one run's) into the JSON at ``path`` and write it with its markdown and plot."""
    doc = start_run(load(path), env)
    for row in new_rows:
        upsert(doc, row)
    save(doc, config if config is not None else BenchConfig(json_path=path))
    return doc


def md_path(config: BenchConfig) -> Path:
    return config.md_path or config.json_path.with_suffix(".md")


def plot_path(config: BenchConfig) -> Path:
    return config.plot_path or config.json_path.with_suffix(".png")


def _fmt(x: Any, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sigfmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def markdown(doc: dict[str, Any]) -> str:
    """The matrix as a markdown table, with the environment and the command lines that built it."""
    env = doc["env"]
    lines = ["# poros-fx bench", "",
             (f"Device: {env.get('gpu') or env.get('device')}; torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, peft {env.get('peft')}, bitsandbytes {env.get('bitsandbytes')}; pinned H2D "
             f"{_fmt(env.get('pinned_h2d_gbps'), 1)} GB/s. Random-init Qwen2.5 shapes, NF4 base, LoRA r16 alpha 32 "
             "on all seven projections, AdamW, batch 1. s/step: median after warm-up; peak: max_memory_allocated; "
             "floor: 2 x bytes loaded per pass (every block once) x accum / pinned bandwidth; ratio: s/step over "
             "the same run's peft_resident (marked * where that run had none and another run's is used: step "
             "times move between the hosts lent on different days); run: the numbered run below that measured "
             "the row ('-': a run from before rows were numbered)."), "",
             "Runs (one process each):", ""]
    runs = env.get("runs", [])
    lines += [f"    [{i}] {run_env.get('command') or '?'}" for i, run_env in enumerate(runs, 1)] + [""]
    lines += [f"Run {i} stopped early: {run_env['stopped']}" for i, run_env in enumerate(runs, 1)
              if run_env.get("stopped")]
    header = ("| model | method | block | seq | accum | s/step | peak GB | H2D GB/s | floor s | compile s | ratio | run "
              "| error |")
    lines += ["", header, "|---" * (header.count("|") - 1) + "|"]
    for r in doc["rows"]:
        error = (r.get("error") or "").replace("|", "/")
        ratio = _fmt(r["ratio_vs_peft_resident"], 2) + ("*" if r.get("ratio_cross_run") else "")
        lines.append(f"| {r['model']} | {r['method']} | {r['block_size'] or '-'} | {r['seq']} | {r['accum']} | "
                     f"{_fmt(r['s_per_step'], 3)} | {_fmt(r['peak_gb'], 2)} | {_sigfmt(r['h2d_gbps'])} | "
                     f"{_fmt(r['floor_s'], 3)} | {_fmt(r['compile_s'], 1)} | {ratio} | {r.get('run') or '-'} | "
                     f"{error} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time and peak memory per model (x) and method (bars), one group per (seq, accum)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in doc["rows"] if not r.get("error")]
    groups = sorted({(r["model"], r["seq"], r["accum"]) for r in rows},
                    key=lambda g: _sort_key({"model": g[0], "seq": g[1], "accum": g[2], "method": "", "block_size": 0}))
    variants = sorted({(r["method"], r["block_size"]) for r in rows},
                      key=lambda v: _sort_key({"model": "", "seq": 0, "accum": 0, "method": v[0], "block_size": v[1]}))
    fig = Figure(figsize=(max(9.0, 2.5 + 0.35 * len(groups) * max(1, len(variants))), 8))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
    axes = fig.subplots(2, 1)
    width = 0.8 / max(1, len(variants))
    for ax, key, label in ((axes[0], "s_per_step", "s / step (median)"), (axes[1], "peak_gb", "peak GB (max allocated)")):
        for j, (method, bs) in enumerate(variants):
            xs, ys = [], []
            for i, g in enumerate(groups):
                for r in rows:
                    if (r["model"], r["seq"], r["accum"]) == g and (r["method"], r["block_size"]) == (method, bs) \
                            and _num(r[key]) is not None:
                        xs.append(i - 0.4 + width * (j + 0.5))
                        ys.append(r[key])
            if xs:
                bars = ax.bar(xs, ys, width=width, label=method + (f" bs{bs}" if bs else ""))
                ax.bar_label(bars, fmt="%.3g", fontsize=6)  # log-scale bar heights are hard to read
        ax.set_ylabel(label)
        ax.set_xticks(range(len(groups)), [f"{m}\nseq {s} x{a}" for m, s, a in groups], fontsize=8)
        if any(_num(r[key]) is not None for r in rows):
            ax.set_yscale("log")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, f"{key}: not measured (no CUDA)", transform=ax.transAxes, ha="center")
    fig.suptitle(f"poros-fx bench on {doc['env'].get('gpu') or doc['env'].get('device')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_outputs(doc: dict[str, Any], config: BenchConfig) -> None:
    md_path(config).write_text(markdown(doc), encoding="utf-8")
    plot(doc, plot_path(config))


# -- command line -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m poros_fx.tools.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated: tiny, 0.5b, 7b, 32b, 72b")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--block-sizes", default=DEFAULT_BLOCK_SIZES, help="poros block sizes (one row each)")
    p.add_argument("--seqs", default=DEFAULT_SEQS, help="sequence lengths; the first is the base")
    p.add_argument("--accums", default=DEFAULT_ACCUMS, help="gradient accumulation; the first is the base")
    p.add_argument("--grid", default="star", choices=("star", "full"),
                   help="star: base pair + each other seq / accum alone; full: every pair")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first compiles)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default="poros-bench.json", help="results; merged into when it exists")
    p.add_argument("--md", default=None, help="markdown table (default: JSON path with .md)")
    p.add_argument("--plot", default=None, help="PNG plot (default: JSON path with .png)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no new row starts after them")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one extra step per row: Chrome trace into DIR, summary into the row's 'profile'")
    p.add_argument("--memory-budget", default=None, help="poros_budget's memory_budget (e.g. 24GB)")
    p.add_argument("--compiled-resident", action="store_true",
                   help="add compiled_resident (plain torch.compile/Inductor; 0.5B and 7B only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m poros_fx.tools.bench``; returns the exit status (2: no CUDA without --device cpu, bad options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    try:
        config = make_config(models=args.models, methods=args.methods, block_sizes=args.block_sizes, seqs=args.seqs,
                             accums=args.accums, grid=args.grid, steps=args.steps, warmup=args.warmup,
                             device=args.device, json_path=args.json, md_path=args.md, plot_path=args.plot,
                             time_budget=args.time_budget, compiled_resident=args.compiled_resident,
                             profile_dir=args.profile, memory_budget=args.memory_budget,
                             command=shlex.join(["python", "-m", "poros_fx.tools.bench", *argv]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
