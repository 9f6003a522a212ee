"""``--compile-warm``: a compiled row's first step cold (a fresh Inductor cache) and warm (a second process).

Cold: the row runs in the bench's process inside ``torch._inductor.utils.fresh_cache`` (an empty
``TORCHINDUCTOR_CACHE_DIR`` with Triton's cache inside it, Inductor's in-memory caches cleared), kept
after the row. Warm: the bench then starts ``python -m poros_fx bench`` for that row alone with
the same cache folder, as a user's second run on the machine would (a new process: Dynamo, AOTAutograd
and the regions start from nothing but the on-disk caches). The row gets ``first_step_cold_s`` /
``compile_cold_s`` from the first and ``first_step_warm_s`` / ``compile_warm_s`` (and the second
process's ``warm_process``: s/step, wall seconds, error) from the second. compile_s is the first
step's seconds over the median step, as for every compiled row.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from torch._inductor.utils import fresh_cache

from .config import BenchConfig, RowSpec

WARM_STEPS = 3  # the second process's timed steps: enough for the median its compile_s subtracts
WARM_TIMEOUT_S = 3600


@contextlib.contextmanager
def cold_cache(root: Path) -> Iterator[Path]:
    """An empty Inductor (and Triton) cache folder under ``root``, in force inside the context and kept."""
    with fresh_cache(dir=str(root), delete=False):
        yield Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def warm_command(spec: RowSpec, config: BenchConfig, json_path: Path) -> list[str]:
    """The second process's command line: the bench for this row alone, without ``--compile-warm``."""
    command = [sys.executable, "-m", "poros_fx", "bench", "--models", spec.model, "--methods", spec.method,
               "--block-sizes", str(spec.block_size or 1), "--seqs", str(spec.seq), "--accums", str(spec.accum),
               "--steps", str(min(config.steps, WARM_STEPS)), "--warmup", "1", "--device", config.device,
               "--json", str(json_path)]
    if config.memory_budget is not None:
        command += ["--memory-budget", config.memory_budget]
    return command


def cache_env(cache: Path) -> dict[str, str]:
    """The environment that points a process at ``cache`` (as ``fresh_cache`` does)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}


def add_warm(row: dict[str, Any], spec: RowSpec, config: BenchConfig, cache: Path) -> None:
    """Move the row's cold numbers to ``*_cold_s`` and add the second process's as ``*_warm_s`` (in place)."""
    row["first_step_cold_s"], row["compile_cold_s"] = row.get("first_step_s"), row.get("compile_s")
    with tempfile.TemporaryDirectory(prefix="poros-bench-warm-") as tmp:
        json_path = Path(tmp) / "warm.json"
        try:
            done = subprocess.run(warm_command(spec, config, json_path), env={**os.environ, **cache_env(cache)},
                                  capture_output=True, text=True, timeout=WARM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            row["warm_process"] = {"error": f"timed out after {WARM_TIMEOUT_S} s"}
            return
        rows = json.loads(json_path.read_text())["rows"] if json_path.exists() else []
    if not rows:
        tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        row["warm_process"] = {"error": f"exited {done.returncode}: {tail[-1] if tail else 'no output'}"}
        return
    warm = rows[0]
    row["first_step_warm_s"], row["compile_warm_s"] = warm["first_step_s"], warm["compile_s"]
    row["warm_process"] = {"s_per_step": warm["s_per_step"], "wall_s": warm["wall_s"], "error": warm["error"],
                           "compile_cache": warm.get("compile_cache"), "first_step_phases": warm.get("first_step_phases")}
