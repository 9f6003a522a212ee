"""What the command line prints: the one console, the one-line error exit, and the step progress log.

Apart from the typer app (``cli``) so that the modules doing a command's work (``sources``,
``run_state``, ``train_run``) report and exit the way the commands do without importing the app.
Only typer and rich are imported here: ``poros-fx --help`` stays quick.
"""

from __future__ import annotations

import datetime
import shlex
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

class _Console(Console):
    """rich's console, whose lines are wrapped at the terminal's width on a terminal and never elsewhere (a log
    or a pipe keeps every line whole, not cut at 80 columns)."""

    def print(self, *objects: Any, soft_wrap: Optional[bool] = None, **kwargs: Any) -> None:
        super().print(*objects, soft_wrap=not self.is_terminal if soft_wrap is None else soft_wrap, **kwargs)


console = _Console()


def quoted(command: str, *paths: object) -> str:
    """``command`` with ``{}`` filled by ``paths`` quoted for a POSIX shell: a command the user can paste."""
    return command.format(*(shlex.quote(str(p)) for p in paths))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as the one error line (``error: ...`` on stderr, unwrapped so paths stay whole) and
    return the exit to raise: every command's errors look the same (exit code 2 for bad input)."""
    Console(stderr=True).print("[red]error:[/red] " + escape(" ".join(message.split())), soft_wrap=True,
                               highlight=False)
    return typer.Exit(code)


def check_writable(path: Path) -> None:
    """Make ``path``'s folder and try a file in it, before any work that would end by writing ``path``;
    ``fail`` with the reason if that cannot be done."""
    if path.is_dir():
        raise fail(f"cannot write {path}: it is a folder; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".poros-write-check-"):
            pass
    except OSError as e:
        raise fail(f"cannot write {path}: {e.strerror or e}; give another path") from None


def folder_problem(folder: Path) -> Optional[str]:
    """Why files cannot be written into ``folder`` (made if missing), or None when they can; the folders made
    for the check are removed again, so a refused command leaves nothing behind."""
    made: list[Path] = []
    try:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".poros-write-check-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for path in reversed(made):
            path.rmdir()
    return None


class StepLog:
    """A rich progress bar (loss, s/step, tokens/s, ETA) on a terminal; plain periodic lines otherwise (logs,
    CI, pipes). The first step compiles: rates and the ETA come from the steps after it."""

    def __init__(self, steps: int, every: Optional[int], start: int = 0, label: str = "training",
                 unit: str = "step") -> None:
        self.steps = steps
        self.start = start
        self.every = every or max(1, (steps - start) // 10)
        self.label = label
        self.unit = unit
        self.bar = None
        self.task = None
        self.times: list[float] = []
        self.tokens: list[int] = []

    def __enter__(self) -> "StepLog":
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]}"),
                                TimeElapsedColumn(), console=console)
            self.bar.__enter__()
            self.task = self.bar.add_task(self.label, total=self.steps, completed=self.start, loss="-",
                                          rate=f"(the first {self.unit} compiles)")
        return self

    def step(self, step: int, loss: float, seconds: float, tokens: Optional[int] = None) -> None:
        self.times.append(seconds)
        if tokens is not None:
            self.tokens.append(tokens)
        # the first step compiles; the rates shown are those of the steps after it
        timed = self.times[1:] if len(self.times) > 1 else self.times
        rate = statistics.mean(timed)
        parts = [f"{rate:.2f} s/{self.unit}"]
        if self.tokens:
            counted = self.tokens[1:] if len(self.tokens) > 1 else self.tokens
            parts.append(f"{sum(counted) / sum(timed):,.0f} tok/s")
        if step < self.steps:
            parts.append(f"ETA {datetime.timedelta(seconds=round(rate * (self.steps - step)))}")
        text = "  ".join(parts)
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4f}", rate=text)
        elif step == self.start + 1 or step % self.every == 0 or step == self.steps:
            console.print(f"{self.unit} {step}/{self.steps}  loss {loss:.4f}  {text}"
                          + (f"  (first {self.unit} compiles)" if step == self.start + 1 else ""), highlight=False)

    def note(self, message: str) -> None:
        """A line between the progress updates (above the bar on a terminal)."""
        (self.bar.console if self.bar is not None else console).print(message, soft_wrap=True, highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
