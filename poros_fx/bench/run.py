"""Measuring: the shared model of a size, one row's timed steps, and the run over every planned row."""

from __future__ import annotations

import contextlib
import gc
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch._dynamo.utils import calculate_time_spent, counters

from .config import ROW_KEY, BenchConfig, RowSpec, build_config, cap_device_memory, plan
from .methods import METHODS, Method, State
from .report import _label, load, md_path, plot_path, save, start_run, upsert
from . import unsloth
from .warm import add_warm, cold_cache
from ..runtime.host_ram import proc_meminfo
from ..io.loader import estimate_host_bytes
from ..io.loader import from_config
from ..io.sizes import block_bytes
from ..prepare import get_store
from ..prepare import prepare, set_trace_options, unprepare
from ..options import resolve_device
from ..stats import stats
from .h2d import copy_back_seconds, copy_seconds
from .memory_profile import memory_step
from .profiling import proc_status, profile_step
from ..models.tiny import expert_paths_of_config, lora_targets


def measure_pinned_h2d(device: str | torch.device = "cuda", mib: int = 512, reps: int = 5,
                       back: bool = False) -> float:
    """Pinned host-to-device copy bandwidth in GB/s (median of ``reps`` copies of ``mib`` MiB); ``back``:
    device-to-host instead."""

    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    seconds = (copy_back_seconds if back else copy_seconds)(host, torch.device(device), reps)
    return host.numel() / statistics.median(seconds) / 1e9


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
    env["pinned_d2h_gbps"] = round(measure_pinned_h2d(device, back=True), 2) if cuda else None
    env["host_ram_gb"], env["host_available_gb"] = _gigabytes(proc_meminfo("MemTotal")), _host_available_gb()
    return env


def _gigabytes(count: int | None) -> float | None:
    return None if count is None else round(count / 1e9, 2)


def _host_available_gb() -> float | None:
    """The host's available memory now (``MemAvailable``): page-locked buffers come out of it."""
    return _gigabytes(proc_meminfo("MemAvailable"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # compiled graphs hold their model's tensors and would recompile-guard on the next row


class ModelHolder:
    """The one model of a size shared by its rows, switched between the host store and the device."""

    def __init__(self, name: str, device: torch.device, seed: int, expert_lora: bool = False,
                 quantization: str = "nf4") -> None:
        import peft


        self.name = name
        self.quantization = quantization
        self.device = device
        self.config = build_config(name)
        torch.manual_seed(seed)  # the LoRA A init
        # every linear of a decoder layer: the seven projections (Qwen3.5 also its Gated DeltaNet's five)
        experts = expert_paths_of_config(self.config) if expert_lora else []
        self.expert_lora = bool(experts)
        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0 if experts else 0.05,
                               target_modules=lora_targets(self.config.model_type), target_parameters=experts or None)
        self.model = from_config(self.config, quantization, device=device, seed=seed, lora=lora, block_size=1,
                                 progress=False)
        self.state: State = "prepared"

    def ensure(self, state: State) -> nn.Module:

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


def _failed_at(e: BaseException, frames: int = 6) -> list[str]:
    """The innermost frames of ``e``'s traceback (``file:line function``): where a row failed, for a
    failure that cannot be reproduced without the device."""
    stack = traceback.extract_tb(e.__traceback__)[-frames:]
    return [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in stack]


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

    device = holder.device
    row = _empty_row(spec)
    if holder.expert_lora:
        row["expert_lora"] = True
    row["quantization"] = holder.quantization
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
        if method.streams and config.sequence_chunks > 1:
            set_trace_options(model, {"sequence_chunks": config.sequence_chunks})
            row["sequence_chunks"] = config.sequence_chunks
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

        cache_before = compile_cache_counters()
        dynamo_before = calculate_time_spent()
        first = step()
        row["compile_cache"] = {k: v - cache_before.get(k, 0) for k, v in compile_cache_counters().items()
                                if v != cache_before.get(k, 0)}  # hits and misses of the first step's compiles
        if method.compiled:  # where the first step's seconds went: Dynamo's phases, and ours (stats "compile")
            row["first_step_phases"] = {"dynamo": {k: round(v - dynamo_before.get(k, 0.0), 3)
                                                   for k, v in calculate_time_spent().items()
                                                   if v != dynamo_before.get(k, 0.0)},
                                        "poros": stats(model)["compile"] if method.streams else None}
        for _ in range(max(config.warmup, method.warmup) - 1):
            step()
        if device.type == "cuda":  # the untimed steps' peak; the timed steps' own below (CUDA graphs add their pool)
            warm_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
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
            timed_peak = torch.cuda.max_memory_allocated(device)
            graphs = stats(model)["cuda_graphs"] if method.streams else None
            if graphs is not None:  # replays write the pool, which max_memory_allocated does not see: added on top
                row["cuda_graphs"] = {k: v for k, v in graphs.items() if k != "broken"} | {"broken": len(graphs["broken"])}
                row["graph_pool_gb"] = round(graphs["pool_bytes"] / 1e9, 3)
                row["load_slots_gb"] = round(graphs["load_slots"]["bytes"] / 1e9, 3)  # inside max_memory_allocated
                timed_peak += graphs["pool_bytes"]
            row["peak_gb"] = round(max(warm_peak, timed_peak) / 1e9, 3)
            # apart: the first steps compile and plan (their peak can be far above a trained step's)
            row["untimed_peak_gb"], row["timed_peak_gb"] = round(warm_peak / 1e9, 3), round(timed_peak / 1e9, 3)
        host = proc_status()  # the host store is pinned memory of this process: counted in its RSS
        if "VmRSS" in host:  # the peak is the process's so far: the model's build and earlier rows included
            row["host_rss_gb"] = round(host["VmRSS"] / 1e9, 3)
            row["host_peak_rss_gb"] = round(host.get("VmHWM", 0) / 1e9, 3)
        slug = _label(spec).replace(" ", "-").replace(".", "")
        if config.profile_dir is not None:  # after the peak is read: the profiler allocates too
            row["profile"] = profile_step(step, Path(config.profile_dir) / f"{slug}.trace.json.gz")
        if config.memory_profile_dir is not None and device.type == "cuda":
            row["memory_profile"] = memory_step(step, Path(config.memory_profile_dir) / f"{slug}.memory.pickle", device)
    finally:
        if runner is not None:
            runner.teardown()
        if method.streams and config.sequence_chunks > 1:
            set_trace_options(model, {"sequence_chunks": 1})  # the next row traces whole layers again
        for p in params:
            p.grad = None
        runner = optimizer = batches = None  # the step closure's cells: frees the optimizer state and batches
        _free(device)
    return row


def compile_cache_counters() -> dict[str, int]:
    """Dynamo's counters of Inductor's FX graph cache and AOTAutograd's cache (hits, misses, bypasses)."""
    return {**{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            **{k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}}


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


# -- the run ----------------------------------------------------------------------------------------

def run(config: BenchConfig, methods: Mapping[str, Method] = METHODS,
        log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    """Run every planned row, merging each into ``config.json_path`` (and rewriting the markdown and
    the plot) as soon as it is measured, so a run killed midway keeps every finished row.

    Returns the merged document. A row's failure is recorded in its ``error`` and the run goes on.
    """

    started = time.perf_counter()
    device = resolve_device(config.device)
    specs, notes = plan(config, methods)
    env = environment(device)
    env["command"] = config.command
    if config.device_memory_cap is not None:
        env["device_memory_cap_gb"] = round(cap_device_memory(device, config.device_memory_cap) / 1e9, 3)
    for note in notes:
        log(f"note: {note}")
    log(f"bench: {len(specs)} row(s) on {env['gpu'] or device}"
        + (f", pinned H2D {env['pinned_h2d_gbps']} GB/s" if env["pinned_h2d_gbps"] else ""))
    doc = start_run(load(config.json_path), env)
    save(doc, config)
    holder: ModelHolder | None = None
    build_error: str | None = None
    cache_root = Path(tempfile.mkdtemp(prefix="poros-bench-inductor-")) if config.compile_warm else None
    for i, spec in enumerate(specs):
        if config.time_budget is not None and time.perf_counter() - started > config.time_budget:
            stopped = (f"time budget of {config.time_budget:g} s exceeded after {i} of {len(specs)} row(s); not run: "
                       + ", ".join(_label(s) for s in specs[i:]))
            doc["env"]["runs"][-1]["stopped"] = stopped
            log(f"stopped: {stopped}")
            break
        row_started = time.perf_counter()
        method = methods[spec.method]
        if method.own_process:  # Unsloth: a checkpoint and a process of its own, not the shared model
            row = _empty_row(spec)
            try:
                unsloth.measure(row, spec, config, build_config(spec.model), log)
            except Exception as e:  # noqa: BLE001 - the checkpoint could not be written (disk, memory): the run goes on
                row["error"] = _error(e)
            row["wall_s"] = round(time.perf_counter() - row_started, 1)
            log(_describe(row))
            upsert(doc, row)
            save(doc, config)
            continue
        if holder is None or (holder.name, holder.quantization) != (spec.model, method.quantization):
            holder = None
            _free(device)
            build_error = None
            try:
                log(f"building {spec.model} (random-init {method.quantization}, from_config) on {device}")
                holder = ModelHolder(spec.model, device, config.seed, config.expert_lora, method.quantization)
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
            warm = config.compile_warm and method.compiled
            try:
                with cold_cache(cache_root) if warm else contextlib.nullcontext() as cache:
                    row = run_row(holder, method, spec, config, env["pinned_h2d_gbps"],
                                  estimate_host_bytes(holder.config, holder.quantization),
                                  sum(block_bytes(holder.config, holder.quantization)[1]))
            except Exception as e:  # noqa: BLE001 - OOM or any failure: record it and go on
                row["error"], row["failed_at"] = _error(e), _failed_at(e)
                row["host_available_gb_at_failure"] = _host_available_gb()  # a page-locked allocation failing?
            # freed here, after the except block: until then the traceback keeps the failed step's tensors
            _free(device)
            if warm and not row["error"]:
                log(f"  warm: a second process on {cache}")
                add_warm(row, spec, config, cache)
        row["wall_s"] = round(time.perf_counter() - row_started, 1)  # device time a row costs, for planning
        log(_describe(row))
        upsert(doc, row)
        save(doc, config)
    holder = None
    _free(device)
    if cache_root is not None:
        shutil.rmtree(cache_root, ignore_errors=True)
    save(doc, config)
    log(f"wrote {config.json_path}, {md_path(config)}, {plot_path(config)} "
        f"({time.perf_counter() - started:.0f} s)")
    return doc



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
    if row.get("compile_warm_s") is not None:
        parts.append(f"warm {row['compile_warm_s']:.1f} s")
    return f"  {_label(spec)}: " + ", ".join(parts)

