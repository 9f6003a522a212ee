"""Graph dumps: what the compiler captured and what every pass made of it, readable by people.

With ``options={"dump": folder}`` or ``POROS_FX_DUMP=folder`` each compiled graph gets a folder
``graph_N`` holding ``00_joint.py`` (the captured joint graph), ``NN_<phase>_<pass>.py`` after every
pass (readable Python, devices shown), ``schedule.txt`` (the schedule table), ``timeline.png``
(blocks over the step: compute, recompute, loads, evicts; predicted memory with its peak),
``blocks.png`` (the block DAG, ``block_graph.py``: what crosses between blocks, held how long) and, for
each decoder-layer region the graph calls, ``regions/rK_joint.py``, ``rK_forward.py`` and
``rK_backward.py`` (the one layer's joint graph and its partition, after the region passes). A step that runs
block-major adds ``NN_lockstep_forward.py`` / ``NN_lockstep_backward.py``: the segments its lockstep
runs the graph in (``runtime/lockstep.py``), each a small graph of its own.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch.fx as fx

from .schedule import Schedule
from .timeline import draw_block_graph, render


class Dumper:
    def __init__(self, folder: str | None) -> None:
        self.folder: Path | None = None
        self.count = 0
        if folder:
            root = Path(folder)
            root.mkdir(parents=True, exist_ok=True)
            n = sum(1 for p in root.iterdir() if p.name.startswith("graph_"))
            while (root / f"graph_{n}").exists():
                n += 1
            self.folder = root / f"graph_{n}"
            self.folder.mkdir()

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def graph(self, gm: fx.GraphModule, label: str) -> None:
        if self.folder is None:
            return
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        (self.folder / f"{self.count:02d}_{label}.py").write_text(text)
        self.count += 1

    def lockstep(self, plan: Any, label: str) -> None:
        """A block-major lockstep plan (``runtime/lockstep.py``): its segments' graphs, as Python."""
        if self.folder is None:
            return
        (self.folder / f"{self.count:02d}_lockstep_{label}.py").write_text(plan.readable())
        self.count += 1

    def schedule(self, schedule: Schedule) -> None:
        """The schedule table and, once the graphs exist, the timeline picture (``timeline.png``)."""
        if self.folder is None:
            return
        (self.folder / "schedule.txt").write_text(schedule.table())
        for use in schedule.regions.values():
            folder = self.folder / "regions"
            folder.mkdir(exist_ok=True)
            for label, gm in (("joint", use.region.joint), ("forward", use.region.forward),
                              ("backward", use.region.backward)):
                if gm is not None:
                    text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
                    (folder / f"{use.name}_{label}.py").write_text(text)
        if schedule.graphs:
            try:
                render(schedule, self.folder / "timeline.png")
                if schedule.block_graph is not None:
                    draw_block_graph(schedule, self.folder / "blocks.png")
            except Exception as err:  # a picture must never stop a training run
                warnings.warn(f"poros dump: timeline picture not written ({type(err).__name__}: {err})")

    def __repr__(self) -> str:
        return f"Dumper({os.fspath(self.folder) if self.folder else None})"
