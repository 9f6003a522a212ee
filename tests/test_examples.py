"""The examples in examples/ run as a user runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,expect", [
    ("step_decorator.py", "poros-fx prepared model"),
    ("trainer.py", "step 4: loss"),
    ("parity.py", "exact: streamed == stream=False on all surfaces"),
    ("finetune.py", "adapter, tokenizer and run.toml in"),
    ("sft.py", "step 4: loss"),
])
def test_example_runs(script, expect, tmp_path):
    args = {"parity.py": ["--steps", "3"], "finetune.py": ["--steps", "2", "--out", str(tmp_path / "a")]}.get(script, [])
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert expect in res.stdout
