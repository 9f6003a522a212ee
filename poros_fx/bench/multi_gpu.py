"""The multi-GPU benchmark (issue 15): poros on 1 and on N GPUs of one host, and FSDP2 with CPU offload.

    python -m poros_fx.bench.multi_gpu --nproc 2 --model 7b --out out/multi    # on a host with 2 GPUs
    python -m poros_fx.bench.multi_gpu --device cpu --model tiny --nproc 2 --steps 2 --out /tmp/m  # CPU smoke

Each row is one ``torchrun --standalone --nproc-per-node n -m poros_fx.bench.multi_gpu worker ...`` run
(a fresh job, so rows do not share memory or compile caches), with the same recipe: random-init
Qwen2.5 shape (``from_config``, NF4 by default), LoRA r16 alpha 32 dropout 0.05 on all seven
projections, AdamW lr 1e-4, ``--batch`` rows of ``--seq`` tokens per rank per step (each rank its own
batches), ``--warmup`` steps then ``--steps`` timed steps. Rows:

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

import argparse
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
from ..models.tiny import lora_targets, qwen25_config, tiny_config

METHODS = ("poros", "fsdp2_offload")
LOG_TAIL = 3000  # characters of a failed run's output kept in its row (the whole log is in logs/)


# -- the launcher ----------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m poros_fx.bench.multi_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="launch", choices=("launch", "worker"),
                   help="launch (the default) runs every row; worker is one rank of one row (torchrun starts it)")
    p.add_argument("--nproc", type=int, default=None, help="processes (GPUs) of the multi-GPU rows (default: every "
                   "visible GPU; 2 on the CPU)")
    p.add_argument("--model", default="0.5b", help="0.5b, 7b, 32b, 72b (Qwen2.5 shapes, random init) or tiny")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: the model's)")
    p.add_argument("--quantization", default="nf4", choices=("nf4", "bf16"))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rows", default=None, help="method:nproc,... instead of the default rows (poros:1, "
                   "poros:N, fsdp2_offload:N)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when present")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one row may run")
    p.add_argument("--out", type=Path, default=Path("multi-bench"))
    p.add_argument("--method", default="poros", help=argparse.SUPPRESS)  # worker: its row's method
    p.add_argument("--row-json", type=Path, default=None, help=argparse.SUPPRESS)  # worker: where rank 0 writes
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}; known: {', '.join(METHODS)}")
    return args


def rows(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(method, processes) of every row to run."""
    if args.rows:
        out = []
        for item in args.rows.split(","):
            method, _, n = item.partition(":")
            if method not in METHODS or not n.isdigit() or int(n) < 1:
                raise SystemExit(f"--rows: {item!r} is not method:nproc with method in {METHODS}")
            out.append((method, int(n)))
        return out
    methods = args.methods.split(",")
    return ([("poros", 1), ("poros", args.nproc)] if "poros" in methods else []) + (
        [("fsdp2_offload", args.nproc)] if "fsdp2_offload" in methods else [])


def worker_command(args: argparse.Namespace, method: str, nproc: int, row_json: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "poros_fx.bench.multi_gpu", "worker", "--method", method, "--row-json", str(row_json),
           "--model", args.model, "--quantization", args.quantization, "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device]
    return cmd + (["--layers", str(args.layers)] if args.layers else [])


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Every row, one torchrun job each; the JSON and markdown rewritten after each row."""
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"command": shlex.join([sys.executable, "-m", "poros_fx.bench.multi_gpu",
                                                  *sys.argv[1:]]) if args.mode == "launch" else None,
                           "recipe": {k: getattr(args, k) for k in ("model", "layers", "quantization", "seq", "batch",
                                                                   "steps", "warmup", "device")},
                           "rows": []}
    for method, nproc in rows(args):
        row_json = out / f"{method}-{nproc}.json"
        row_json.unlink(missing_ok=True)
        log_path = out / "logs" / f"{method}-{nproc}.log"
        cmd = worker_command(args, method, nproc, row_json)
        started = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            output, code = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\n[multi_bench] killed after {args.timeout} s (--timeout)"
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


def _config(args: argparse.Namespace) -> Any:
    config = tiny_config("qwen2", layers=2) if args.model == "tiny" else qwen25_config(args.model)
    if args.layers:
        config.num_hidden_layers = args.layers
    return config


def _lora() -> Any:
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=lora_targets("qwen2"))


def _poros_model(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """(model, what to call, context of each call): the shared base, DDP when there are several ranks."""
    import torch.distributed as dist

    torch.manual_seed(0)  # the LoRA init, the same on every rank
    model = from_config(_config(args), quantization=args.quantization, device=device, seed=0, lora=_lora(),
                        progress=False)
    model.train()
    wrapped = distributed.data_parallel(model) if dist.get_world_size() > 1 else model
    return model, torch.compile(wrapped, backend="poros"), distributed.no_ddp_optimizer


def _fsdp2_model(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """The same PEFT model under FSDP2 with CPU offload (every rank builds it; fully_shard keeps its shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = from_config(_config(args), quantization=args.quantization, device=device, seed=0, lora=_lora(),
                        progress=False, share=False)
    unprepare(model)  # the PEFT + bitsandbytes model as the loader built it: base on the host, adapter on the device
    model.train()
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs an accelerator
    for layer in causal_lm(model).model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model, model, contextlib.nullcontext


def worker(args: argparse.Namespace) -> None:
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
            build = _poros_model if args.method == "poros" else _fsdp2_model
            model, step_model, call_context = build(args, device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
            vocab = _config(args).vocab_size
            times, loss, loaded = _steps(args, step_model, optimizer, call_context, g, vocab, device, model)
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
        args.row_json.write_text(json.dumps(summarize(records, args), indent=1))
    failed = [r for r in records if "error" in r]
    if failed:
        raise SystemExit(f"rank {failed[0]['rank']}: {failed[0]['error']}")


def _steps(args: argparse.Namespace, step_model: Any, optimizer: torch.optim.Optimizer, call_context: Any,
           g: torch.Generator, vocab: int, device: torch.device,
           model: torch.nn.Module) -> tuple[list[float], float, int | None]:
    """Warm-up and timed steps; returns the timed steps' seconds, the last loss, and the base bytes the
    timed steps loaded (``None`` without a host store)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: list[float] = []
    loss_value = float("nan")
    for i in range(args.warmup + args.steps):
        if i == args.warmup and get_store(model) is not None:
            stats(model, reset=True)
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        sync()
        start = time.perf_counter()
        with call_context():
            loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        loss_value = float(loss.detach())
    return times, loss_value, stats(model)["bytes_loaded"] if get_store(model) is not None else None


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One row from every rank's record."""
    row: dict[str, Any] = {"ranks": records}
    errors = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if errors:
        row["error"] = "; ".join(errors)
        return row
    world = len(records)
    step = max(r["s_per_step"] for r in records)  # DDP makes every rank wait for the slowest
    row.update(s_per_step=round(step, 5), tokens_per_s=round(world * args.batch * args.seq / step, 2),
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


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.mode == "worker":
        worker(args)
    else:
        doc = launch(args)
        print(markdown(doc))


if __name__ == "__main__":
    main()
