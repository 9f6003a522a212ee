"""A test's script in a fresh process forked from test_distributed.py's server, which imported torch,
transformers, peft and poros_fx once (a spawned interpreter spends ~8 s on them before its first line)."""

import os
import sys
import traceback
from typing import Callable

from test_distributed import _CONTEXT


def _child(run: Callable[[], None], env: dict[str, str], out: str, err: str | None) -> None:
    os.environ.clear()  # the test's environment, not the server's from when it started
    os.environ.update(env)
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out_fd, 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if err else out_fd, 2)
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_forked(run: Callable[[], None], env: dict[str, str], out: str, err: str | None = None,
               timeout: float = 600) -> int | None:
    """``run()`` (picklable: a module-level function or a partial of one) in a forked process with ``env`` as
    its environment, stdout to the file ``out`` and stderr to ``err`` (or ``out``); its exit code (0, a
    ``SystemExit``'s code, 1 after an exception's traceback; killed after ``timeout`` seconds)."""
    proc = _CONTEXT.Process(target=_child, args=(run, env, out, err))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode
