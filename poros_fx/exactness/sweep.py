"""``poros-fx exactness``: draw N training configurations, run each, and write what happened as a table.

Each example is checked by ``config_runs.check`` (streamed == ``stream=False``, == the eager loop with the
eager codegen, or a ``PorosError`` before the first optimizer step). Examples come from Hypothesis with a
fixed seed per worker, so a sweep is repeatable; ``workers`` > 1 runs that many processes at once (each its
own seed), which on a GPU machine keeps its CPU cores busy compiling. ``shrink`` stops at the first
failure and lets Hypothesis shrink it to the smallest configuration that still fails.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import platform
import queue
from pathlib import Path
from typing import Any, Callable, Optional

import hypothesis
import torch
from hypothesis import HealthCheck, given, settings

from .config_runs import InvalidConfig, Outcome, check
from .training_configs import TrainingConfig, configs


@dataclasses.dataclass
class Row:
    worker: int
    index: int
    status: str
    seconds: float
    compared: tuple[str, ...]
    drawn: str  # TrainingConfig.describe()
    detail: str
    config: str  # repr(TrainingConfig), to replay it


def sweep(examples: int, device: str, seed: int, *, worker: int = 0, shrink: bool = False,
          progress: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """``examples`` configurations drawn with ``seed``, each checked on ``device``. With ``shrink``, the first
    failure is shrunk and the smallest failing configuration is the last row."""
    rows: list[Row] = []
    drawn: list[TrainingConfig] = []
    phases = [hypothesis.Phase.generate] + ([hypothesis.Phase.shrink] if shrink else [])

    @hypothesis.seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, phases=phases, print_blob=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(configs(device))
    def one(config: TrainingConfig) -> None:
        drawn.append(config)
        if worker > 0 and len(drawn) == 1:
            hypothesis.reject()  # every seed draws the simplest configuration first: worker 0 runs it
        try:
            outcome = check(config, device)
        except InvalidConfig:
            hypothesis.reject()
        row = _row(worker, len(rows), config, outcome)
        rows.append(row)
        if progress is not None:
            progress(row)
        if shrink and not outcome.holds:
            raise AssertionError(row.detail)

    try:
        one()
    except AssertionError:  # shrunk: Hypothesis re-ran the smallest failing example last
        failing = [r for r in rows if r.status not in ("equal", "refused")]
        if failing:
            rows.append(dataclasses.replace(failing[-1], index=len(rows), drawn="smallest: " + failing[-1].drawn))
    return rows


def quiet_libraries() -> None:
    """No progress bars or info lines from datasets and transformers in this process: the rows are the
    sweep's output."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecations per Trainer
    try:
        import datasets  # the trl extra (the SFT surface)
    except ImportError:
        return
    datasets.disable_progress_bars()


def _row(worker: int, index: int, config: TrainingConfig, outcome: Outcome) -> Row:
    return Row(worker=worker, index=index, status=outcome.status, seconds=round(outcome.seconds, 1),
               compared=outcome.compared, drawn=config.describe(), detail=outcome.detail, config=repr(config))


def _worker(args: tuple[int, int, str, int, Any]) -> list[Row]:
    examples, seed, device, worker, finished = args
    torch.set_num_threads(1)
    quiet_libraries()
    return sweep(examples, device, seed, worker=worker, progress=finished.put)


def parallel_sweep(examples: int, device: str, seed: int, workers: int,
                   progress: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """``examples`` spread over ``workers`` processes (spawned: CUDA does not survive a fork), seeds
    ``seed``, ``seed + 1``, ...; ``progress`` sees each row as its example finishes, whichever worker ran it."""
    if workers <= 1:
        return sweep(examples, device, seed, progress=progress)
    shares = [examples // workers + (1 if i < examples % workers else 0) for i in range(workers)]
    rows: list[Row] = []
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, concurrent.futures.ProcessPoolExecutor(max_workers=workers,
                                                                             mp_context=context) as pool:
        finished = manager.Queue()
        futures = [pool.submit(_worker, (n, seed + i, device, i, finished)) for i, n in enumerate(shares) if n]
        while not all(f.done() for f in futures) or not finished.empty():
            try:
                row = finished.get(timeout=1.0)
            except queue.Empty:
                continue
            rows.append(row)
            if progress is not None:
                progress(row)
        for future in futures:
            future.result()  # a worker that died raises here
    return sorted(rows, key=lambda r: (r.worker, r.index))


def counts(rows: list[Row]) -> dict[str, int]:
    out = {s: 0 for s in ("equal", "refused", "differs", "crashed")}
    for r in rows:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        pass
    return env


def write_json(path: Path, rows: list[Row], env: dict[str, Any], command: str) -> None:
    path.write_text(json.dumps({"command": command, "environment": env, "counts": counts(rows),
                                "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")


def write_markdown(path: Path, rows: list[Row], env: dict[str, Any], command: str) -> None:
    c = counts(rows)
    lines = [f"# Drawn training configurations on {env['device']} ({env['date']})", "",
             f"`{command}`", "",
             ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("date", "device")), "",
             f"{len(rows)} examples: {c['equal']} equal, {c['refused']} refused before the first optimizer step, "
             f"{c['differs']} differ, {c['crashed']} crashed.", "",
             "Columns: the surface, family and shape (L layers, h hidden/heads x head dim, kv heads, i intermediate, "
             "v vocabulary), base and adapter (r rank, a alpha, p dropout, t targets), data (b batch, lengths per "
             "micro-batch, padding, ign: labels -100, nib: num_items_in_batch), the loop (acc accumulation x steps, "
             "bm block-major, clip, toggles, edit, resume), the options and modes (D deterministic, T TF32, "
             "A autocast bf16, F fast SDPA).", "",
             "| # | outcome | s | compared with | drawn | detail |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        detail = r.detail.replace("|", "\\|")[:240]
        lines.append(f"| {i} | {r.status} | {r.seconds} | {', '.join(r.compared)} | {r.drawn.replace('|', '/')} | "
                     f"{detail} |")
    path.write_text("\n".join(lines) + "\n")
