"""Host and GPU memory of the streamed loader (``poros_fx.load_pretrained`` / ``from_config``), case by case.

    python3 benchmarks/scripts/load_memory.py --out OUT                       # all default cases on CUDA
    python3 benchmarks/scripts/load_memory.py --cases ckpt-7b --out OUT       # one case
    python3 benchmarks/scripts/load_memory.py --device cpu --shape tiny --out OUT   # the CPU smoke run (tests)

Cases are KIND-SIZE, KIND one of

* ``ckpt``: ``poros_fx.load_pretrained(folder, "nf4", lora=...)`` of a random-init bf16 checkpoint of the
  Qwen2.5 SIZE shape written to ``--workdir`` by ``save_pretrained`` (a separate writer process, on the
  CPU; reused when a complete one is already there);
* ``std``: the standard ``AutoModelForCausalLM.from_pretrained(folder, quantization_config=
  BitsAndBytesConfig(nf4, double quant, bf16 compute), device_map={"": 0})`` of the same checkpoint;
* ``config``: ``poros_fx.from_config(qwen25_config(SIZE), "nf4", seed=0, lora=...)`` (no checkpoint),

and SIZE one of ``tiny``, ``0.5b``, ``7b``, ``32b``, ``72b`` (``--shape`` replaces every case's SIZE), or
``SIZE:N``: that shape with only N decoder layers (``ckpt-32b:4`` is a 7 GB checkpoint whose tensors, and so
the loader's per-tensor GPU peak, are those of the 32B model; its full 65 GB would not fit the disk).

Each case runs in a fresh child process (``--one CASE``), so no peak of one case leaks into the next.
The child imports everything, creates the CUDA context and warms bitsandbytes up, then measures only
the load call: GPU ``max_memory_allocated`` / ``max_memory_reserved`` (peak stats reset before), the
process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` when the kernel allows it), a
sampler thread's peaks of ``VmRSS`` / ``RssAnon`` / ``RssFile`` (file-backed pages: the memory-mapped
safetensors shards count in RSS while they are mapped) and the system's lowest ``MemAvailable`` (catches
page-locked memory even if the kernel does not count it in RSS). The row compares the peak RSS growth
with the target ``<= 1.1 x (base + one decoder layer)`` and the GPU peak with ``<= 0.5 GB`` (32B).

Writes ``load_memory.json`` and ``load_memory.md`` into ``--out`` after every case (a run cut short
keeps what it measured). Only the standard library besides torch/transformers/peft/bitsandbytes/poros_fx.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from poros_fx.runtime.host_ram import proc_meminfo as meminfo  # noqa: E402
from poros_fx.bench.profiling import (Sampler, child_env, proc_status, reset_peak_rss, result_stream,  # noqa: E402
                                      run_child as run_command, sampling)
from poros_fx.bench.tables import cell as fmt, environment, markdown_table, write_report  # noqa: E402
from poros_fx.units import GIB, table_gb as gb, table_gib as fmt_gib  # noqa: E402
KINDS = ("ckpt", "std", "config")
SIZES = ("tiny", "0.5b", "7b", "32b", "72b")
DEFAULT_CASES = "ckpt-0.5b,std-0.5b,ckpt-7b,config-32b,config-72b"
ROW_MARK = "LOAD_MEMORY_ROW "
ENV_MARK = "LOAD_MEMORY_ENV "
RSS_TARGET = 1.1  # host RSS growth during the load <= 1.1 x (base + one decoder layer)
GPU_TARGET_BYTES = 0.5e9  # GPU peak during the load <= 0.5 GB (the target at 32B)
GPU_TARGET_SIZE = "32b"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# poros_fx.models.tiny.tiny_config("qwen2", **TINY)
TINY = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 2048}

# parameters (embedding + head, per decoder layer, layers) of each shape, for the estimates below and the
# disk check, without importing torch in the parent
PARAMS = {"tiny": (1.05e6, 0.59e6, 4), "0.5b": (136.1e6, 14.91e6, 24), "7b": (1089.0e6, 233.1e6, 28),
          "32b": (1555.8e6, 487.6e6, 64), "72b": (2489.4e6, 877.7e6, 80)}
# rough seconds on an H200 host (16 cores): a child's start-up (imports, CUDA context) plus so many seconds per
# billion parameters; --time-budget skips a case whose estimate does not fit in what is left
START_S = 15
LOAD_S_PER_B = {"ckpt": 8, "std": 6, "config": 3}
WRITE_S_PER_B = 25
CPU_SLOWDOWN = 8  # NF4 quantization on the CPU

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:7.1f}s pid {os.getpid()}] {msg}",
          file=sys.stderr, flush=True)


# -- cases ------------------------------------------------------------------------------------------

def parse_case(case: str) -> tuple[str, str]:
    """``KIND-SIZE`` or ``KIND-SIZE:LAYERS`` (the SIZE shape with only LAYERS decoder layers)."""
    kind, _, size = case.partition("-")
    shape, _, layers = size.partition(":")
    if kind not in KINDS or shape not in SIZES or (layers and not (layers.isdigit() and int(layers) > 0)):
        raise SystemExit(f"unknown case {case!r}: expected KIND-SIZE or KIND-SIZE:LAYERS with KIND in {KINDS} "
                         f"and SIZE in {SIZES}")
    return kind, size


def split_size(size: str) -> tuple[str, int | None]:
    shape, _, layers = size.partition(":")
    return shape, (int(layers) if layers else None)


def params(size: str) -> float:
    shape, layers = split_size(size)
    fixed, per_layer, default_layers = PARAMS[shape]
    return fixed + per_layer * (layers or default_layers)


def estimate(kind: str, size: str, device: str) -> float:
    """Seconds one case's child is expected to take (not counting the checkpoint write)."""
    rate = LOAD_S_PER_B[kind] * (1 if device == "cuda" else CPU_SLOWDOWN)
    return START_S + rate * params(size) / 1e9


def write_estimate(size: str) -> float:
    return 10 + WRITE_S_PER_B * params(size) / 1e9


def resolve_cases(text: str, shape: str | None) -> list[str]:
    out: list[str] = []
    for case in (c.strip() for c in text.split(",") if c.strip()):
        kind, size = parse_case(case)
        name = f"{kind}-{shape}" if shape else f"{kind}-{size}"
        if name not in out:
            out.append(name)
    return out


def make_config(size: str):
    """``poros_fx.models.tiny``'s config for the shape; with ``:LAYERS``, the same with that many decoder layers."""
    from poros_fx.models.tiny import qwen25_config, tiny_config

    shape, layers = split_size(size)
    config = tiny_config("qwen2", **TINY) if shape == "tiny" else qwen25_config(shape)
    if layers is not None:
        attn = config._attn_implementation
        fields = {**config.to_dict(), "num_hidden_layers": layers}
        fields.pop("layer_types", None)  # one entry per layer; rebuilt for the new depth
        config = type(config)(**fields)
        config._attn_implementation = attn
    return config


def checkpoint_dir(workdir: Path, size: str) -> Path:
    return workdir / f"qwen25-{size.replace(':', '-L')}-bf16"


def marker_path(folder: Path) -> Path:
    return folder / "LOAD_MEMORY_WRITTEN.json"


def checkpoint_ready(folder: Path, size: str) -> bool:
    try:
        return json.loads(marker_path(folder).read_text())["size"] == size
    except (OSError, ValueError, KeyError, TypeError):
        return False


def lora_config():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS))


# -- child: write a checkpoint ----------------------------------------------------------------------

def write_checkpoint(size: str, workdir: Path) -> dict[str, Any]:
    """Random-init bf16 model of ``size`` built on the CPU, ``save_pretrained`` (2GB shards), freed."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    folder = checkpoint_dir(workdir, size)
    if checkpoint_ready(folder, size):
        log(f"checkpoint {folder} already written; reused")
        return {"folder": str(folder), "reused": True, "write_s": 0.0}
    need = params(size) * 2 * 1.05
    workdir.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        shutil.rmtree(folder)
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise RuntimeError(f"not enough disk in {workdir}: the bf16 checkpoint needs ~{need / GIB:.1f} GiB, "
                           f"{free / GIB:.1f} GiB free")
    started = time.perf_counter()
    torch.manual_seed(0)
    log(f"building a random-init bf16 {size} model on the CPU ({torch.get_num_threads()} threads)")
    model = transformers.AutoModelForCausalLM.from_config(make_config(size), dtype=torch.bfloat16)
    built = time.perf_counter()
    nparams = sum(p.numel() for p in model.parameters())
    log(f"built {nparams / 1e9:.3f} B parameters in {built - started:.1f} s; saving to {folder}")
    model.save_pretrained(folder, max_shard_size="2GB")
    saved = time.perf_counter()
    del model
    files = sorted(p.name for p in folder.iterdir())
    disk = sum(p.stat().st_size for p in folder.iterdir())
    info = {"folder": str(folder), "reused": False, "size": size, "params": nparams, "disk_bytes": disk,
            "files": len(files), "build_s": round(built - started, 2), "save_s": round(saved - built, 2),
            "write_s": round(saved - started, 2), "writer_hwm_bytes": proc_status().get("VmHWM")}
    marker_path(folder).write_text(json.dumps(info))
    log(f"saved {disk / GIB:.2f} GiB in {len(files)} files in {saved - built:.1f} s")
    return info


# -- child: measure one load ------------------------------------------------------------------------

def _warm_up(device: str) -> None:
    """The CUDA context and bitsandbytes' quantization kernels, before anything is measured."""
    import torch

    if device == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    w = torch.randn(128, 128, dtype=torch.bfloat16)
    q = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64)
    q = q.to(device)
    if device == "cuda":
        q = q.to("cpu")
        torch.cuda.synchronize()
    del q, w


def _layer_bytes(config) -> tuple[int, int]:
    from poros_fx.io.sizes import block_bytes

    _, sizes = block_bytes(config, "nf4", 1)
    layers = sizes[1:-1]
    return (max(layers) if layers else 0), len(layers)


def _store_numbers(model) -> dict[str, Any]:
    from poros_fx.handles import get_store

    store = get_store(model)
    if store is None:
        return {}
    out: dict[str, Any] = {"entries": len(store.host.entries),
                           "base_bytes": sum(e.host.numel() * e.host.element_size() for e in store.host.tensors())}
    try:
        out["store_host_bytes"] = int(store.host.host_bytes())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["store_host_bytes_error"] = repr(e)
    pinned_bytes = getattr(store.host, "pinned_bytes", None)
    out["pinned_bytes"] = int(pinned_bytes()) if callable(pinned_bytes) else None
    pinned = getattr(store.host, "pinned", None)
    out["pinned"] = bool(pinned()) if callable(pinned) else None
    return out


@contextlib.contextmanager
def _phase_marks(sampler: Sampler, device: str) -> Iterator[None]:
    """Mark the memory where the loader's tensor-by-tensor phase ends (``_finish``: adapter, then
    ``prepare`` moving the base into the host store) by wrapping those two functions for the load."""
    from poros_fx.io import loader

    originals = {name: getattr(loader, name) for name in ("_finish", "prepare")}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            sampler.mark(f"{name} start")
            try:
                return fn(*a, **k)
            finally:
                if device == "cuda":
                    import torch

                    torch.cuda.synchronize()
                sampler.mark(f"{name} end")
        return wrapper

    for name, fn in originals.items():
        setattr(loader, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(loader, name, fn)


def _after_malloc_trim() -> tuple[int | None, int | None]:
    """VmRSS and RssAnon after glibc's ``malloc_trim(0)``: what the load freed but the allocator kept."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None, None
    now = proc_status()
    return now.get("VmRSS"), now.get("RssAnon")


def _load(kind: str, size: str, device: str, workdir: Path):
    import torch

    import poros_fx

    config = make_config(size)
    if kind == "config":
        return poros_fx.from_config(config, quantization="nf4", device=device, seed=0, lora=lora_config(),
                                    progress=False)
    folder = checkpoint_dir(workdir, size)
    if not checkpoint_ready(folder, size):
        raise RuntimeError(f"no complete checkpoint in {folder} (the writer did not finish?)")
    if kind == "ckpt":
        return poros_fx.load_pretrained(folder, quantization="nf4", device=device, lora=lora_config(), progress=False)
    import transformers

    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_use_double_quant=True,
                                                 bnb_4bit_compute_dtype=torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=bnb_config, device_map={"": 0} if device == "cuda" else {"": "cpu"})


def measure(case: str, device: str, workdir: Path, sample_s: float) -> dict[str, Any]:
    kind, size = parse_case(case)
    row: dict[str, Any] = {"case": case, "kind": kind, "size": size, "device": device, "status": "error"}
    import torch

    import poros_fx
    from poros_fx.io.loader import estimate_host_bytes

    config = make_config(size)
    row["expected_base_bytes"] = estimate_host_bytes(config, "nf4")
    row["layer_bytes"], row["layers"] = _layer_bytes(config)
    log(f"{case}: warming up ({device})")
    _warm_up(device)
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["gpu_free_before_bytes"], row["gpu_total_bytes"] = torch.cuda.mem_get_info()
        row["gpu_allocated_before_bytes"] = torch.cuda.memory_allocated()
    before = proc_status()
    row["rss_before_bytes"] = before.get("VmRSS")
    row["hwm_before_reset_bytes"] = before.get("VmHWM")
    row["hwm_reset"] = reset_peak_rss()
    before = proc_status()
    row["anon_before_bytes"], row["file_before_bytes"] = before.get("RssAnon"), before.get("RssFile")
    row["mem_available_before_bytes"] = meminfo("MemAvailable")
    log(f"{case}: loading (RSS {fmt_gib(row['rss_before_bytes'])} GiB, VmHWM reset: {row['hwm_reset']})")
    def gpu_now() -> dict[str, Any]:
        return {"gpu_allocated": torch.cuda.memory_allocated(), "gpu_max_allocated_so_far": torch.cuda.max_memory_allocated()}

    started = time.perf_counter()
    with sampling(sample_s, gpu_now if device == "cuda" else None, log) as sampler, _phase_marks(sampler, device):
        try:
            model = _load(kind, size, device, workdir)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the row records it and the run goes on
            model = None
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=12)
        sampler.mark("returned")
    row["wall_s"] = round(time.perf_counter() - started, 3)
    row["phases"] = sampler.marks
    # the GPU peak of the tensor-by-tensor phase alone (quantization), before the adapter moves to the GPU
    row["gpu_max_allocated_materialize_bytes"] = next(
        (m["gpu_max_allocated_so_far"] for m in sampler.marks if m["phase"] == "_finish start"
         and "gpu_max_allocated_so_far" in m), None)
    row["timeline"] = sampler.coarse_timeline()
    after = proc_status()
    row.update(hwm_bytes=after.get("VmHWM"), rss_after_bytes=after.get("VmRSS"), anon_after_bytes=after.get("RssAnon"),
               file_after_bytes=after.get("RssFile"), vm_lck_bytes=after.get("VmLck"), vm_pin_bytes=after.get("VmPin"),
               rss_peak_sampled_bytes=sampler.peak.get("VmRSS"), anon_peak_bytes=sampler.peak.get("RssAnon"),
               file_peak_bytes=sampler.peak.get("RssFile"), shmem_peak_bytes=sampler.peak.get("RssShmem"),
               samples=sampler.samples, mem_available_min_bytes=sampler.min_available)
    if row["mem_available_before_bytes"] is not None and sampler.min_available is not None:
        row["system_used_peak_delta_bytes"] = row["mem_available_before_bytes"] - sampler.min_available
    if device == "cuda":
        row["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        row["gpu_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row["gpu_allocated_after_bytes"] = torch.cuda.memory_allocated()
        row["gpu_free_after_bytes"] = torch.cuda.mem_get_info()[0]
    row["rss_after_malloc_trim_bytes"], row["anon_after_malloc_trim_bytes"] = _after_malloc_trim()
    if model is not None:
        row["status"] = "ok"
        row.update(_store_numbers(model))
        if kind != "std":  # a standard load has no adapter (its trainable tensors are the bf16 embedding etc.)
            row["adapter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if kind == "std":
            row["model_bytes"] = int(model.get_memory_footprint())
        if kind != "std":
            row["load_report"] = dict(vars(poros_fx.load_report(model)))
    derive(row)
    log(f"{case}: {row['status']} in {row['wall_s']:.1f} s; " + summary(row))
    return row


def derive(row: dict[str, Any]) -> None:
    """Ratios against the targets (in place)."""
    base = row.get("base_bytes") or row.get("expected_base_bytes")
    row["ratio_base_bytes"] = base
    denom = (base or 0) + (row.get("layer_bytes") or 0)
    hwm, rss0 = row.get("hwm_bytes"), row.get("rss_before_bytes")
    if hwm is not None and rss0 is not None:
        # with a failed reset VmHWM may hold an earlier peak; the sampled VmRSS peak is the fallback
        peak = hwm if row.get("hwm_reset") else (row.get("rss_peak_sampled_bytes") or hwm)
        row["rss_peak_bytes"] = peak
        row["rss_peak_delta_bytes"] = peak - rss0
    if denom and row.get("rss_peak_delta_bytes") is not None:
        row["rss_ratio"] = round(row["rss_peak_delta_bytes"] / denom, 4)
        row["rss_ratio_abs"] = round(row["rss_peak_bytes"] / denom, 4)
        row["rss_target_ok"] = row["rss_ratio"] <= RSS_TARGET
    if denom and row.get("anon_peak_bytes") is not None and row.get("anon_before_bytes") is not None:
        row["anon_ratio"] = round((row["anon_peak_bytes"] - row["anon_before_bytes"]) / denom, 4)
    if row.get("file_peak_bytes") is not None and row.get("file_before_bytes") is not None:
        row["file_peak_delta_bytes"] = row["file_peak_bytes"] - row["file_before_bytes"]
    if denom and row.get("system_used_peak_delta_bytes") is not None:
        row["system_ratio"] = round(row["system_used_peak_delta_bytes"] / denom, 4)
    if row.get("gpu_max_allocated_bytes") is not None:
        row["gpu_max_allocated_gb"] = round(row["gpu_max_allocated_bytes"] / 1e9, 4)
        row["gpu_max_reserved_gb"] = round(row["gpu_max_reserved_bytes"] / 1e9, 4)
        row["gpu_target_ok"] = row["gpu_max_allocated_bytes"] <= GPU_TARGET_BYTES


def summary(row: dict[str, Any]) -> str:
    return (f"base {fmt_gib(row.get('ratio_base_bytes'))} GiB, layer {fmt_gib(row.get('layer_bytes'), 3)} GiB, "
            f"RSS peak +{fmt_gib(row.get('rss_peak_delta_bytes'))} GiB (ratio {fmt(row.get('rss_ratio'))}, anon "
            f"{fmt(row.get('anon_ratio'))}, system {fmt(row.get('system_ratio'))}), file-backed peak "
            f"+{fmt_gib(row.get('file_peak_delta_bytes'))} GiB, GPU max alloc {fmt(row.get('gpu_max_allocated_gb'))} GB "
            f"reserved {fmt(row.get('gpu_max_reserved_gb'))} GB")


# -- parent -----------------------------------------------------------------------------------------


def run_child(flags: list[str], mark: str, timeout: float | None,
              extra_env: list[str] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Run this script with ``flags`` in a fresh process; (the JSON it printed after ``mark``, error)."""
    return run_command([sys.executable, str(Path(__file__).resolve()), *flags], mark, timeout,
                       child_env(ROOT, extra_env), ROOT)


def main_child(args: argparse.Namespace) -> int:
    result = result_stream()  # everything a library prints goes to stderr; stdout carries only the result line
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.env:
        mark, payload = ENV_MARK, environment(args.device, ROOT)
    elif args.write:
        mark = ROW_MARK
        try:
            payload = write_checkpoint(args.write, Path(args.workdir))
        except Exception as e:  # noqa: BLE001
            payload = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=12)}
    else:
        mark = ROW_MARK
        try:
            payload = measure(args.one, args.device, Path(args.workdir), args.sample_ms / 1000)
        except Exception as e:  # noqa: BLE001
            payload = {"case": args.one, "status": "error", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=12)}
    result.write(mark + json.dumps(payload) + "\n")
    result.flush()
    sys.stderr.flush()
    os._exit(0)  # skip tearing down a 40 GB base (and its page-locking) at exit: the process is done


def markdown(doc: dict[str, Any]) -> str:
    env = doc["env"]
    lines = [
        "# Streamed loader memory (benchmarks/scripts/load_memory.py)", "",
        "Commands (the rows come from these runs, merged; the last ran last):" if doc.get("commands") else "Command:",
        "", "```", *(doc.get("commands") or [doc["command"]]), "```", "",
        *[f"Note: {n}" for n in doc.get("notes", [])], *([""] if doc.get("notes") else []),
        (f"torch {env.get('torch')} (CUDA {env.get('cuda')}), GPU {env.get('gpu_name')}, transformers "
         f"{env.get('transformers')}, peft {env.get('peft')}, bitsandbytes {env.get('bitsandbytes')}, host RAM "
         f"{fmt_gib(env.get('host_ram_bytes'), 1)} GiB, {env.get('cpu_count')} CPUs, git {env.get('git')}."), "",
    ]
    header = ["case", "status", "load s", "write s", "base GiB", "layer MiB", "pinned GiB", "RSS before GiB",
              "RSS peak +GiB", "ratio (<= 1.1)", "anon ratio", "system ratio", "file-backed peak +GiB",
              "GPU max alloc GB", "GPU max alloc before adapter GB", "GPU max reserved GB", "GPU after GB",
              "adapter GB", "GPU <= 0.5 GB"]
    rows = []
    for r in doc["rows"]:
        status = r.get("status", "?")
        if r.get("child_env"):
            status += f" ({' '.join(r['child_env'])})"
        if r.get("error"):
            status += f": {r['error'][:160]}".replace("\n", " ")
        ratio = fmt(r.get("rss_ratio"))
        if r.get("rss_target_ok") is not None:
            ratio += "" if r["rss_target_ok"] else " (over)"
        gpu_ok = fmt(r.get("gpu_target_ok")) if split_size(r.get("size") or "-")[0] == GPU_TARGET_SIZE else "n/a"
        layer = r.get("layer_bytes")
        rows.append([
            r.get("case"), status, fmt(r.get("wall_s")), fmt(r.get("write_s")),
            fmt_gib(r.get("ratio_base_bytes"), 3), "-" if layer is None else f"{layer / 2**20:.1f}",
            fmt_gib(r.get("pinned_bytes"), 3), fmt_gib(r.get("rss_before_bytes")), fmt_gib(r.get("rss_peak_delta_bytes")),
            ratio, fmt(r.get("anon_ratio")), fmt(r.get("system_ratio")), fmt_gib(r.get("file_peak_delta_bytes")),
            fmt(r.get("gpu_max_allocated_gb")), gb(r.get("gpu_max_allocated_materialize_bytes")),
            fmt(r.get("gpu_max_reserved_gb")), gb(r.get("gpu_allocated_after_bytes")),
            gb(r.get("adapter_bytes")), gpu_ok])
    lines += markdown_table(header, rows)
    lines += [
        "",
        ("Columns: *base* is the host store's bytes (sum of its entries; for `std` rows the loader's estimate of the "
        "same NF4 layout), *layer* one decoder layer's NF4 bytes (`poros_fx.io.sizes.block_bytes`), *pinned* the "
        "store's `pinned_bytes()` when it has one. *RSS peak +* is the process's peak RSS during the load (VmHWM after "
        "a `/proc/self/clear_refs` reset; the sampled VmRSS peak when the reset failed) minus its RSS just before; "
        "*ratio* = that / (base + layer), the target is <= 1.1. *anon ratio* counts only anonymous memory "
        "(RssAnon sampled every few ms): the memory-mapped safetensors pages are file-backed RSS, whose growth is "
        "*file-backed peak +*. *system ratio* uses the drop of /proc/meminfo MemAvailable instead (counts page-locked "
        "memory whether or not RSS does). GPU columns are torch's `max_memory_allocated` / `max_memory_reserved` "
        "during the load, reset before it; *before adapter* is that peak when the tensor-by-tensor phase ended "
         "(quantization only, before `_finish` moves the adapter to the GPU); *GPU after* is what stays allocated (the LoRA adapter, *adapter*: every "
         "trainable parameter, fp32); the 0.5 GB target applies at 32B. Each case ran in a fresh process "
        "after imports, CUDA context creation and a bitsandbytes warm-up."),
        "",
    ]
    return "\n".join(lines)


def write_outputs(doc: dict[str, Any], out: Path | None) -> None:
    write_report(out, "load_memory", doc, markdown(doc))


def main_parent(args: argparse.Namespace) -> int:
    cases = resolve_cases(args.cases, args.shape)
    workdir = Path(args.workdir).resolve()
    out = Path(args.out).resolve() if args.out else None
    command = shlex.join([sys.executable, *sys.argv])
    log(f"cases: {', '.join(cases)}; workdir {workdir}; out {out}; time budget {args.time_budget}")
    started = time.perf_counter()

    def left() -> float | None:
        return None if args.time_budget is None else args.time_budget - (time.perf_counter() - started)

    env, err = run_child(["--env", "--device", args.device], ENV_MARK, 300)
    env = env or {"error": err}
    env["command"] = command
    env["host_ram_bytes"] = env.get("host_ram_bytes") or meminfo("MemTotal")
    log(f"env: torch {env.get('torch')} CUDA {env.get('cuda')} GPU {env.get('gpu_name')} bitsandbytes "
        f"{env.get('bitsandbytes')} RAM {fmt_gib(env.get('host_ram_bytes'), 1)} GiB")
    doc: dict[str, Any] = {"env": env, "command": command, "cwd": os.getcwd(), "rows": []}
    written: dict[str, dict[str, Any]] = {}
    for case in cases:
        kind, size = parse_case(case)
        needs_write = kind in ("ckpt", "std") and size not in written
        if needs_write and checkpoint_ready(checkpoint_dir(workdir, size), size):
            written[size] = {"folder": str(checkpoint_dir(workdir, size)), "reused": True, "write_s": 0.0}
            needs_write = False
        need = estimate(kind, size, args.device) + (write_estimate(size) if needs_write else 0)
        remaining = left()
        if remaining is not None and need > remaining:
            row = {"case": case, "kind": kind, "size": size, "status": "skipped",
                   "error": f"time budget: needs ~{need:.0f} s, {remaining:.0f} s left"}
            log(f"{case}: skipped ({row['error']})")
            doc["rows"].append(row)
            write_outputs(doc, out)
            continue
        write_info = written.get(size)
        if needs_write:
            log(f"{case}: writing the {size} checkpoint in a writer process")
            write_info, err = run_child(["--write", size, "--workdir", str(workdir)], ROW_MARK, left())
            write_info = write_info or {"error": err}
            written[size] = write_info
        if write_info is not None and write_info.get("error"):
            row = {"case": case, "kind": kind, "size": size, "status": "error",
                   "error": f"checkpoint write failed: {write_info['error']}", "write": write_info}
            log(f"{case}: {row['error']}")
        else:
            log(f"{case}: measuring in a fresh process")
            timeout = left() if args.time_budget is not None else args.case_timeout
            row, err = run_child(["--one", case, "--device", args.device, "--workdir", str(workdir),
                                  "--sample-ms", str(args.sample_ms)], ROW_MARK, timeout, args.child_env)
            row = row or {"case": case, "kind": kind, "size": size, "status": "error", "error": err}
            if args.child_env:
                row["child_env"] = list(args.child_env)
            if write_info is not None:
                row["write"] = write_info
                row["write_s"] = write_info.get("write_s")
                write_info = {**write_info, "write_s": 0.0}  # counted once, in the first row that needed it
                written[size] = write_info
        doc["rows"].append(row)
        write_outputs(doc, out)
    total = time.perf_counter() - started
    doc["total_s"] = round(total, 1)
    write_outputs(doc, out)
    print(markdown(doc), flush=True)
    log(f"done in {total:.1f} s" + (f"; wrote {out / 'load_memory.json'} and {out / 'load_memory.md'}" if out else ""))
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma list of KIND-SIZE or KIND-SIZE:LAYERS (default {DEFAULT_CASES})")
    ap.add_argument("--with-standard-7b", action="store_true", help="also run std-7b")
    ap.add_argument("--shape", choices=SIZES, help="replace every case's SIZE (tiny for CPU runs)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--workdir", default="/tmp/poros_load", help="where checkpoints are written (and reused)")
    ap.add_argument("--out", help="folder for load_memory.json and load_memory.md")
    ap.add_argument("--time-budget", type=float, help="seconds; cases that would not fit are skipped")
    ap.add_argument("--case-timeout", type=float, default=3600, help="seconds per child without --time-budget")
    ap.add_argument("--child-env", action="append", metavar="KEY=VALUE",
                    help="environment of the measured children (repeatable), e.g. MALLOC_MMAP_THRESHOLD_=65536")
    ap.add_argument("--sample-ms", type=float, default=10.0, help="RSS sampling interval in the child")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: measure one case
    ap.add_argument("--write", help=argparse.SUPPRESS)  # child: write one checkpoint (SIZE or SIZE:LAYERS)
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)  # child: print the environment
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.with_standard_7b and "std-7b" not in args.cases.split(","):
        args.cases += ",std-7b"
    if args.one or args.write or args.env:
        return main_child(args)
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
