"""The examples in examples/ run as a user runs them: each in a fresh process, as ``__main__``, with its
own argv, from the repository root. The process forks from test_distributed.py's server, which imported
torch, transformers, peft and poros_fx once (``python examples/x.py`` spent ~8 s of its run on them)."""

import functools
import os
import runpy
import sys
from pathlib import Path

import pytest

from forked_helper import run_forked

ROOT = Path(__file__).resolve().parent.parent


def _run_example(script: str, args: list[str]) -> None:
    """``python examples/SCRIPT ARGS`` from the repository root, in this process."""
    os.chdir(ROOT)
    path = str(ROOT / "examples" / script)
    sys.argv = [path, *args]
    sys.path[0] = str(ROOT / "examples")  # what `python examples/x.py` puts first
    runpy.run_path(path, run_name="__main__")


@pytest.mark.parametrize("script,expect", [
    ("step_decorator.py", "poros-fx prepared model"),
    ("trainer.py", "step 4: loss"),
    ("parity.py", "exact: streamed == stream=False on all surfaces"),
    ("finetune.py", "adapter, tokenizer and run.toml in"),
    ("sft.py", "step 4: loss"),
])
def test_example_runs(script, expect, tmp_path):
    args = {"parity.py": ["--steps", "3"], "finetune.py": ["--steps", "2", "--out", str(tmp_path / "a")]}.get(script, [])
    log = tmp_path / "out.log"
    code = run_forked(functools.partial(_run_example, script, args), dict(os.environ), str(log))
    output = log.read_text()
    assert code == 0, output
    assert expect in output
