"""The timeline picture of one training step, and the memory the schedule predicts over it.

x is the schedule position: the forward graph's ops, then the backward graph's. One row per block shows
when it computes (forward), is recomputed and differentiated (backward), and where its loads and
evicts sit — a load drawn inside an earlier block's span is a prefetch. Below, the predicted device
memory of the graphs' own values (activations, loaded base weights, values saved for the backward;
not parameters, gradients or optimizer state), with its peak marked. The prediction walks the graphs
with the sizes from their fake tensors: a value is allocated where its op runs and freed after its
last use; views allocate nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.fx as fx

from ..passes.block_partition import BLOCK, FORWARD
from ..runtime.executor import GraphRuntime
from .block_graph import live_bytes, load_order
from .schedule import Schedule


@dataclasses.dataclass
class Timeline:
    phases: list[tuple[str, int, int]]  # (phase, first position, end position)
    spans: list[tuple[int, str, int, int]]  # (block, kind: forward/recompute/backward, start, end)
    loads: list[tuple[int, int]]  # (block, position)
    evicts: list[tuple[int, int]]
    memory: list[int]  # predicted bytes after each position
    peak: tuple[int, int]  # (position, bytes)


def _bytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        numel = val.numel()
        if not isinstance(numel, int):  # a symbolic size (RNG states): take the size it was traced with
            numel = getattr(getattr(numel, "node", None), "hint", None) or 0
        return int(numel) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0


def _allocates(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or target is getattr:
        return False
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return False
    # a multi-output op's tensors are counted at their getitem nodes
    if isinstance(node.meta.get("val"), (tuple, list)):
        return False
    return True


def _is(node: fx.Node, method) -> bool:
    return node.op == "call_function" and getattr(node.target, "__func__", None) is method


def build(schedule: Schedule) -> Timeline:
    graphs = [(p, schedule.graphs[p]) for p in ("forward", "backward") if p in schedule.graphs]
    phases, spans, loads, evicts, memory = [], [], [], [], []
    offset = 0
    for phase, gm in graphs:
        nodes = list(gm.graph.nodes)
        last_use: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for inp in n.all_input_nodes:
                last_use[inp] = i
        live = 0
        freed_at: dict[int, int] = {}

        def hold(node: fx.Node, index: int) -> None:
            nonlocal live
            size = _bytes(node.meta.get("val"))
            live += size
            end = last_use.get(node, index)
            freed_at[end] = freed_at.get(end, 0) + size

        for i, n in enumerate(nodes):
            pos = offset + i
            # backward inputs other than primals (parameters, host weights) are the saved values and
            # tangents: on the device from the start of the backward until their last use
            if n.op == "placeholder" and phase == "backward" and not n.name.startswith("primals_"):
                hold(n, i)
            # a turn-around block's forward copy is not evicted; the backward takes it over, no load
            block = n.meta.get(BLOCK, n.args[2] if _is(n, GraphRuntime.load) else -1)
            turned = block in schedule.reused_by_backward
            # and the backward's last blocks stay for the next step's forward (its loads are drawn: the step
            # drawn could be the first)
            left = phase == "backward" and block in schedule.reused_by_forward
            if _is(n, GraphRuntime.load) and not (turned and phase == "backward"):
                loads.append((n.args[2], pos))
            elif _is(n, GraphRuntime.book_evict) and not (turned and phase == "forward") and not left:
                evicts.append((n.meta.get(BLOCK, -1), pos))
            if _allocates(n) or _is(n, GraphRuntime.load):
                hold(n, i)  # a forward value saved for the backward lives until the forward's output
            if n.op == "call_function" and BLOCK in n.meta and not _is(n, GraphRuntime.load):
                kind = "forward" if phase == "forward" else ("recompute" if n.meta.get(FORWARD) else "backward")
                spans.append((n.meta[BLOCK], kind, pos, pos + 1))
            memory.append(live)
            live -= freed_at.pop(i, 0)
        phases.append((phase, offset, offset + len(nodes)))
        offset += len(nodes)
    spans = _merge(spans)
    peak_pos = max(range(len(memory)), key=memory.__getitem__) if memory else 0
    return Timeline(phases, spans, loads, evicts, memory, (peak_pos, memory[peak_pos] if memory else 0))


def _merge(spans: list[tuple[int, str, int, int]]) -> list[tuple[int, str, int, int]]:
    """Join a block's op positions into runs (a gap of a few ops from other blocks does not split it)."""
    merged: dict[tuple[int, str], list[list[int]]] = {}
    for block, kind, start, end in sorted(spans, key=lambda s: s[2]):
        runs = merged.setdefault((block, kind), [])
        if runs and start - runs[-1][1] <= 8:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [(b, k, s, e) for (b, k), runs in merged.items() for s, e in runs]


def render(schedule: Schedule, path: str | Path) -> Timeline:
    """Draw the timeline of ``schedule`` to ``path`` (PNG or SVG by its suffix); returns the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = build(schedule)
    names = [b.name for b in schedule.blocks]
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 2.2 + 0.35 * len(names)), sharex=True,
                                  gridspec_kw={"height_ratios": [max(2, len(names)), 2.5]})
    colors = {"forward": "#4C72B0", "recompute": "#DD8452", "backward": "#55A868"}
    for block, kind, start, end in tl.spans:
        ax.broken_barh([(start, end - start)], (block - 0.35, 0.7), color=colors[kind], alpha=0.85)
    if tl.loads:
        ax.scatter([p for _, p in tl.loads], [b for b, _ in tl.loads], marker="v", s=14, color="black", zorder=3,
                   label="load")
    if tl.evicts:
        ax.scatter([p for _, p in tl.evicts], [b for b, _ in tl.evicts], marker="x", s=12, color="#C44E52",
                   zorder=3, label="evict")
    for kind, color in colors.items():
        ax.bar(0, 0, color=color, label=kind)
    for phase, start, end in tl.phases:
        ax.axvline(start, color="grey", lw=0.6, ls="--")
        ax.text(start + 1, len(names) - 0.4, phase, fontsize=8, color="grey", va="top")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_ylabel("block")
    ax.legend(loc="upper right", fontsize=7, ncol=5)
    ax.set_title(f"{schedule.graph_id}: block_size={schedule.block_size} prefetch={schedule.prefetch} "
                 f"stream={schedule.stream}", fontsize=9)
    mem.plot(range(len(tl.memory)), [b / 2**20 for b in tl.memory], color="#8172B3", lw=1)
    peak_pos, peak = tl.peak
    mem.scatter([peak_pos], [peak / 2**20], color="#C44E52", zorder=3)
    mem.annotate(f"peak {peak / 2**20:.2f} MiB", (peak_pos, peak / 2**20), fontsize=8, xytext=(5, -12),
                 textcoords="offset points")
    mem.set_ylabel("predicted MiB")
    mem.set_xlabel("schedule position (forward ops, then backward ops)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return tl


def draw_block_graph(schedule: Schedule, path: str | Path) -> None:
    """``blocks.png``: the block DAG (``block_graph.py``), blocks left to right in load order, each edge an
    arc labelled with what it carries; arcs above the row skip blocks (state crossing layers: rotary
    tables, per-layer inputs, shared keys and values), the chain's edges run along it. Below, the bytes
    the saved crossing values hold over the step (forward, then backward) with the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    graph = schedule.block_graph
    names = [graph.nodes[i]["name"] for i in range(graph.number_of_nodes())]
    order = load_order(graph)
    x = {b: i for i, b in enumerate(order)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(order) + 2), 5.5),
                                      gridspec_kw={"height_ratios": [3, 2]})
    for b in order:
        top.scatter([x[b]], [0], s=500, color="#9ecae1", zorder=3)
        top.annotate(names[b], (x[b], 0), ha="center", va="center", fontsize=7, zorder=4)
    span = 1
    for a, b, data in graph.edges(data=True):
        carried = sum(c.nbytes for c in data["values"])
        skip = x[b] - x[a]
        span = max(span, skip)
        arc = FancyArrowPatch((x[a], 0.08 if skip > 1 else 0), (x[b], 0.08 if skip > 1 else 0),
                              connectionstyle=f"arc3,rad={-0.35 if skip > 1 else 0.0}", arrowstyle="-|>",
                              mutation_scale=8, color="#d95f0e" if skip > 1 else "#636363", lw=0.8, zorder=2)
        top.add_patch(arc)
        if skip == 1:
            top.annotate(f"{carried:,}", ((x[a] + x[b]) / 2, -0.12), ha="center", fontsize=6)
    top.set_xlim(-0.7, len(order) - 0.3)
    top.set_ylim(-0.4, 0.2 + 0.18 * span)
    top.axis("off")
    top.set_title(f"{schedule.graph_id}: block graph ({graph.number_of_edges()} edges; orange arcs skip blocks; "
                  "numbers: bytes to the next block)", fontsize=8)
    held = live_bytes(graph)
    bottom.step(range(len(held)), held, where="post", color="#3182bd")
    peak = max(range(len(held)), key=held.__getitem__) if held else 0
    if held:
        bottom.annotate(f"peak {held[peak]:,} bytes", (peak, held[peak]), fontsize=7)
    bottom.axvline(len(order) - 0.5, color="#bdbdbd", lw=0.8)
    bottom.set_xlabel("step position (forward blocks, then backward blocks in reverse)", fontsize=7)
    bottom.set_ylabel("saved crossing values", fontsize=7)
    bottom.tick_params(labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
