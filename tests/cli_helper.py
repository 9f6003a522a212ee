"""Running the installed ``poros-fx`` script, as a user would (shared by the CLI tests)."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "poros-fx"


def cli(*args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), "poros-fx is not installed in this environment (pip install -e .)"
    env = {"COLUMNS": "200", "PATH": str(SCRIPT.parent), "HF_HUB_OFFLINE": "1"}
    if "OMP_NUM_THREADS" in os.environ:  # conftest's one thread per xdist worker reaches the script too
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    res = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res
