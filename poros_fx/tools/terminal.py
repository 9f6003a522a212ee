"""What the command line prints: the one console, the one-line error exit, and the step progress log.

Apart from the typer app (``cli``) so that the modules doing a command's work (``sources``,
``run_state``, ``train_run``) report and exit the way the commands do without importing the app.
Only typer and rich are imported here: ``poros-fx --help`` stays quick.
"""

from __future__ import annotations

import statistics
from typing import Optional

import typer
from rich.console import Console

console = Console()


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` in red on stderr (unwrapped, so paths stay whole) and return the exit to raise."""
    Console(stderr=True).print(f"[red]error:[/red] {message}", soft_wrap=True, markup=True, highlight=False)
    return typer.Exit(code)


class StepLog:
    """A rich progress bar (loss, s/step) on a terminal; plain periodic lines otherwise (logs, CI, pipes)."""

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

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.times.append(seconds)
        # the first step compiles; the rate shown is that of the steps after it
        rate = statistics.mean(self.times[1:]) if len(self.times) > 1 else seconds
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4f}", rate=f"{rate:.2f} s/{self.unit}")
        elif step == self.start + 1 or step % self.every == 0 or step == self.steps:
            console.print(f"{self.unit} {step}/{self.steps}  loss {loss:.4f}  {rate:.2f} s/{self.unit}"
                          + (f"  (first {self.unit} compiles)" if step == self.start + 1 else ""), highlight=False)

    def note(self, message: str) -> None:
        """A line between the progress updates (above the bar on a terminal)."""
        (self.bar.console if self.bar is not None else console).print(message, soft_wrap=True, highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
