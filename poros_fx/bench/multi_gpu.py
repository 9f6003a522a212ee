"""The multi-GPU benchmark (issue 15): poros on 1 and on N GPUs of one host, and FSDP2 with CPU offload.

    poros-fx bench --nproc 2 --models 7b --json out/multi.json    # on a host with 2 GPUs: out/multi/
    poros-fx bench --nproc 2 --device cpu --models tiny --steps 2 --json /tmp/m.json  # CPU smoke run

Each row is one ``torchrun --standalone --nproc-per-node n -m poros_fx bench --worker multi-gpu ...`` run
(a fresh job, so rows do not share memory or compile caches), with the same recipe: random-init
Qwen2.5 shape (``from_config``, NF4 by default), LoRA r16 alpha 32 dropout 0.05 on all seven
projections, AdamW lr 1e-4, ``--batch`` rows of the first ``--seqs`` tokens per rank per step (each rank
its own batches), ``--warmup`` steps (2 unless given) then ``--steps`` timed steps. Rows:

* ``poros`` on 1 process and on ``--nproc`` processes: the base loaded once per host into a shared
  arena (``poros_fx.distributed.HostShare``), ``data_parallel`` + ``torch.compile(backend="poros")``,
  Dynamo's DDPOptimizer off;
* ``fsdp2_offload`` on ``--nproc`` processes: the same PEFT model (``from_config`` then
  ``poros_fx.unprepare``: the PEFT + bitsandbytes model as the loader builds it, on the host), each
  decoder layer and the root under ``torch.distributed.fsdp.fully_shard`` with
  ``CPUOffloadPolicy()``, the optimizer stepping the offloaded adapter. A row that cannot run records
  the error, and the launcher keeps every run's full log in ``<out>/logs/``.

Per row (``<out>/multi_bench.json`` and ``.md``): global tokens per second (``world x batch x seq`` over
the slowest rank's median step), s/step, per-GPU ``max_memory_allocated``, host memory per host (the
sum over its ranks of each rank's peak proportional set size, ``Pss`` from ``/proc/self/smaps_rollup``,
sampled every 0.2 s: shared pages count once, split between the ranks mapping them; an upper bound of
the host's peak), per-GPU achieved H2D (the poros store's ``bytes_loaded`` in the timed steps over
their time) and per-GPU pinned H2D with every rank copying at once (``bench/h2d.py``). Nothing here is
a timed assertion; the tests check the shape of the results on CPU.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

from .. import distributed
from ..handles import causal_lm, get_store
from ..io.loader import from_config
from ..prepare import unprepare
from ..runtime.share import host_key
from ..stats import stats
from .h2d import measure_ranks
from ..models.tiny import lora_targets
from .config import MultiGpuConfig, build_config

LOG_TAIL = 3000  # characters of a failed run's output kept in its row (the whole log is in logs/)


# -- the launcher ----------------------------------------------------------------------------------

def worker_command(config: MultiGpuConfig, method: str, nproc: int, row_json: Path) -> list[str]:
    """The torchrun command of one row: ``nproc`` processes of ``poros-fx bench --worker multi-gpu``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "poros_fx", "bench", "--worker", "multi-gpu", "--methods", method, "--json", str(row_json),
           "--models", config.model, "--quantization", config.quantization, "--seqs", str(config.seq),
           "--batch", str(config.batch), "--steps", str(config.steps), "--warmup", str(config.warmup),
           "--device", config.device]
    return cmd + (["--layers", str(config.layers)] if config.layers else [])


def launch(config: MultiGpuConfig) -> dict[str, Any]:
    """Every row, one torchrun job each; the JSON and markdown rewritten after each row."""
    out = config.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"command": config.command or None,
                           "recipe": {k: getattr(config, k) for k in ("model", "layers", "quantization", "seq", "batch",
                                                                     "steps", "warmup", "device")},
                           "rows": []}
    for method, nproc in config.rows:
        row_json = out / f"{method}-{nproc}.json"
        row_json.unlink(missing_ok=True)
        log_path = out / "logs" / f"{method}-{nproc}.log"
        cmd = worker_command(config, method, nproc, row_json)
        started = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=config.timeout, env=env)
            output, code = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\n[multi_bench] killed after {config.timeout} s (--row-timeout)"
            code = None
        log_path.write_text(f"$ {shlex.join(cmd)}\n{output}")
        row: dict[str, Any] = {"method": method, "nproc": nproc, "wall_s": round(time.perf_counter() - started, 1),
                               "log": str(log_path)}
        if row_json.exists():  # rank 0 wrote the row, or the ranks' errors
            row.update(json.loads(row_json.read_text()))
            row_json.unlink()
        if code != 0 and "error" not in row:  # died before rank 0 could write: the launcher's view
            row["error"] = f"exit code {code}: " + output[-LOG_TAIL:].strip()
        doc["rows"].append(row)
        write(doc, out)
    return doc


def write(doc: dict[str, Any], out: Path) -> None:
    (out / "multi_bench.json").write_text(json.dumps(doc, indent=1))
    (out / "multi_bench.md").write_text(markdown(doc))


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, list):
        return " / ".join(_fmt(v, digits) for v in x)
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def markdown(doc: dict[str, Any]) -> str:
    r = doc["recipe"]
    lines = [f"# Multi-GPU benchmark: {r['model']} ({r['quantization']}), seq {r['seq']}, batch {r['batch']} per rank, "
             f"{r['steps']} timed steps after {r['warmup']}, {r['device']}", "",
             f"`{doc['command']}`" if doc.get("command") else "", "",
             "| method | ranks (GPUs) | tokens/s (global) | s/step | per-GPU peak GB | "
             "host memory per host GB (Σ peak Pss) | achieved H2D GB/s per GPU | "
             "pinned H2D GB/s per GPU, all copying | loss | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        error = (row.get("error") or "").splitlines()
        shown = error[-1][:160] if error else ""
        lines.append(f"| {row['method']} | {row['nproc']} | {_fmt(row.get('tokens_per_s'), 4)} | "
                     f"{_fmt(row.get('s_per_step'), 4)} | {_fmt(row.get('peak_gb'))} | "
                     f"{_fmt(row.get('host_pss_gb'))} | "
                     f"{_fmt(row.get('h2d_gbps'))} | {_fmt(row.get('pinned_gbps'))} | {_fmt(row.get('loss'), 5)} | "
                     f"{shown} |")
    lines += ["", "Full logs (and the error of a row that could not run) are in `logs/` beside this file."]
    return "\n".join(lines) + "\n"


# -- one rank ----------------------------------------------------------------------------------------

def _smaps() -> dict[str, int]:
    """``/proc/self/smaps_rollup`` in bytes (Rss, Pss, Pss_Anon, Pss_Shmem, ...); empty elsewhere."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


@contextlib.contextmanager
def memory_sampler(every: float = 0.2) -> Iterator[dict[str, int]]:
    """The peak ``Pss`` and ``Rss`` of this process while the block runs (a sampling thread)."""
    peak = {"Pss": 0, "Rss": 0}
    done = threading.Event()

    def sample() -> None:
        while True:
            now = _smaps()
            for key in peak:
                peak[key] = max(peak[key], now.get(key, 0))
            if done.wait(every):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        now = _smaps()
        for key in peak:
            peak[key] = max(peak[key], now.get(key, 0))


def _config(config: MultiGpuConfig) -> Any:
    hf_config = build_config(config.model)
    if config.layers:
        hf_config.num_hidden_layers = config.layers
    return hf_config


def _lora(model_type: str) -> Any:
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=lora_targets(model_type))


def _poros_model(config: MultiGpuConfig, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """(model, what to call, context of each call): the shared base, DDP when there are several ranks."""
    import torch.distributed as dist

    torch.manual_seed(0)  # the LoRA init, the same on every rank
    hf_config = _config(config)
    model = from_config(hf_config, quantization=config.quantization, device=device, seed=0,
                        lora=_lora(hf_config.model_type), progress=False)
    model.train()
    wrapped = distributed.data_parallel(model) if dist.get_world_size() > 1 else model
    return model, torch.compile(wrapped, backend="poros"), distributed.no_ddp_optimizer


def _fsdp2_model(config: MultiGpuConfig, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """The same PEFT model under FSDP2 with CPU offload (every rank builds it; fully_shard keeps its shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    hf_config = _config(config)
    model = from_config(hf_config, quantization=config.quantization, device=device, seed=0,
                        lora=_lora(hf_config.model_type), progress=False, share=False)
    unprepare(model)  # the PEFT + bitsandbytes model as the loader built it: base on the host, adapter on the device
    model.train()
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs an accelerator
    for layer in causal_lm(model).model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model, model, contextlib.nullcontext


def worker(config: MultiGpuConfig) -> None:
    """One rank of one row: build, warm up, time, gather to rank 0, which writes the row's JSON."""
    import torch.distributed as dist

    distributed.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = distributed.rank_device()
    record: dict[str, Any] = {"rank": rank, "host": host_key().split("|")[0], "host_key": host_key(),
                              "device": str(device)}
    try:
        if device.type == "cuda":
            record["pinned_gbps"] = measure_ranks()[rank]["together"]
            torch.cuda.reset_peak_memory_stats(device)
        with memory_sampler() as memory:
            build = _poros_model if config.method == "poros" else _fsdp2_model
            model, step_model, call_context = build(config, device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
            vocab = _config(config).vocab_size
            times, loss, loaded = _steps(config, step_model, optimizer, call_context, g, vocab, device, model)
        record.update(host_pss_bytes=memory["Pss"], host_rss_bytes=memory["Rss"], s_per_step=statistics.median(times),
                      loss=loss, step_times=times)
        if loaded is not None and device.type == "cuda":
            record["h2d_gbps"] = loaded / sum(times) / 1e9
        if device.type == "cuda":
            record["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as e:  # recorded on this rank and raised after the gather, so every rank exits non-zero
        record["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()  # into the row's log
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    # the DDP module's reducer holds the process group: it goes first, while the group can still be torn
    # down (freed after destroy_process_group, its gloo threads wait for a peer that is gone)
    model = step_model = optimizer = call_context = None
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        config.row_json.write_text(json.dumps(summarize(records, config), indent=1))
    failed = [r for r in records if "error" in r]
    if failed:
        raise SystemExit(f"rank {failed[0]['rank']}: {failed[0]['error']}")


def _steps(config: MultiGpuConfig, step_model: Any, optimizer: torch.optim.Optimizer, call_context: Any,
           g: torch.Generator, vocab: int, device: torch.device,
           model: torch.nn.Module) -> tuple[list[float], float, int | None]:
    """Warm-up and timed steps; returns the timed steps' seconds, the last loss, and the base bytes the
    timed steps loaded (``None`` without a host store)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: list[float] = []
    loss_value = float("nan")
    for i in range(config.warmup + config.steps):
        if i == config.warmup and get_store(model) is not None:
            stats(model, reset=True)
        ids = torch.randint(0, vocab, (config.batch, config.seq), generator=g).to(device)
        sync()
        start = time.perf_counter()
        with call_context():
            loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= config.warmup:
            times.append(time.perf_counter() - start)
        loss_value = float(loss.detach())
    return times, loss_value, stats(model)["bytes_loaded"] if get_store(model) is not None else None


def summarize(records: list[dict[str, Any]], config: MultiGpuConfig) -> dict[str, Any]:
    """One row from every rank's record."""
    row: dict[str, Any] = {"ranks": records}
    errors = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if errors:
        row["error"] = "; ".join(errors)
        return row
    world = len(records)
    step = max(r["s_per_step"] for r in records)  # DDP makes every rank wait for the slowest
    row.update(s_per_step=round(step, 5), tokens_per_s=round(world * config.batch * config.seq / step, 2),
               loss=[round(r["loss"], 5) for r in records])
    hosts: dict[str, int] = {}
    for r in records:
        hosts[r["host_key"]] = hosts.get(r["host_key"], 0) + r["host_pss_bytes"]
    row["host_pss_gb"] = [round(v / 1e9, 3) for v in hosts.values()]
    if all("peak_bytes" in r for r in records):
        row["peak_gb"] = [round(r["peak_bytes"] / 1e9, 3) for r in records]
    if all("h2d_gbps" in r for r in records):
        row["h2d_gbps"] = [round(r["h2d_gbps"], 2) for r in records]
    if all("pinned_gbps" in r for r in records):
        row["pinned_gbps"] = [round(r["pinned_gbps"], 2) for r in records]
    return row
