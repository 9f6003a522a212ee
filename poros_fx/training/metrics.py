"""The run's metrics, one JSON object per line in ``OUT/metrics.jsonl`` (and TensorBoard when installed).

A line per optimizer step (``step``, ``loss``, ``learning_rate``, ``grad_norm`` when clipping,
``tokens``, ``tokens_per_second``, ``seconds``) and one per evaluation (``step``, ``eval_loss``,
``eval_perplexity``). A resumed run first cuts the file back to its saved step (a run killed after a
save logged steps it takes again), then appends to it. With the ``tensorboard`` package installed the
same scalars also go to ``OUT/tensorboard/`` (``tensorboard --logdir OUT/tensorboard``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends metric records to ``folder/metrics.jsonl`` (and TensorBoard's event files when it is installed)."""

    def __init__(self, folder: Path, enabled: bool = True) -> None:
        self.path: Optional[Path] = folder / METRICS_FILE if enabled else None
        self.writer: Any = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except ImportError:
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(str(folder / TENSORBOARD_DIR))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(("eval/" if key.startswith("eval_") else "train/") + key, value, record["step"])

    def cut_after(self, step: int) -> None:
        """Drop the records of the steps after ``step`` (what a stopped run logged past its last save)."""
        if self.path is None or not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is None or _step_of(line) <= step]
        if len(kept) != len(lines):
            self.path.write_text("".join(kept), encoding="utf-8")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_of(line: str) -> Optional[int]:
    """The ``step`` of one metrics line, or None for a line that is not a record (a line cut off by a kill)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None
