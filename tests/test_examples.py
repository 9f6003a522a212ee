"""The examples in examples/ run as a user runs them: each in a fresh process, as ``__main__``, with its
own argv, from the repository root. The process forks from test_distributed.py's server, which imported
torch, transformers, peft and poros_fx once (``python examples/x.py`` spent ~8 s of its run on them)."""

import os
import runpy
import sys
import traceback
from pathlib import Path

import pytest

from test_distributed import _CONTEXT

ROOT = Path(__file__).resolve().parent.parent


def _run_example(script: str, args: list[str], log: str, env: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment, not the server's from when it started
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(ROOT)
    path = str(ROOT / "examples" / script)
    sys.argv = [path, *args]
    sys.path[0] = str(ROOT / "examples")  # what `python examples/x.py` puts first
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    proc = _CONTEXT.Process(target=_run_example, args=(script, args, str(log), dict(os.environ)))
    proc.start()
    proc.join(600)
    if proc.is_alive():
        proc.kill()
        proc.join()
    output = log.read_text()
    assert proc.exitcode == 0, output
    assert expect in output
