"""Peak bytes a decoder layer's region allocates while its forward or its backward runs, at a real shape
with one layer, on the CPU.

    python docs/bench/cpu/probe_region_peak.py SHAPE      # qwen3-30b-a3b, gpt-oss-120b (models/configs/)

Runs probe_region_saved.py (one layer of SHAPE, NF4 base with NF4 experts, one streamed step of 512 tokens,
eager codegen), then walks each region graph in program order: a node's result is alive from the node to
its last user (the eager codegen frees it there); views and reshapes of another value allocate nothing;
the graph's inputs (the loaded block, the activations) are not counted. Prints the peak and what is
alive at it."""
import runpy
import sys
from pathlib import Path

import torch

ALIASES = {"view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "slice", "select", "alias", "squeeze",
           "unsqueeze", "detach", "t", "as_strided", "split", "split_with_sizes", "unbind"}

probe = runpy.run_path(str(Path(__file__).with_name("probe_region_saved.py")))
get_store, model, size = probe["get_store"], probe["model"], probe["size"]


def nbytes(value) -> int:
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    return torch.Size([size(s) for s in value.shape]).numel() * value.element_size()


def allocates(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "_opname", getattr(node.target, "__name__", ""))
    return node.op == "call_function" and name not in ALIASES and name != "getitem"


def peak(graph: torch.fx.GraphModule) -> tuple[int, str, list[tuple[int, str]]]:
    nodes = list(graph.graph.nodes)
    last = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    alive: dict[torch.fx.Node, int] = {}
    best, where, largest = 0, "", []
    for i, node in enumerate(nodes):
        if allocates(node):
            alive[node] = nbytes(node.meta.get("val"))
        total = sum(alive.values())
        if total > best:
            best, where = total, f"{node.name} ({node.target})"
            largest = sorted(((b, n.name) for n, b in alive.items()), reverse=True)[:4]
        for a in node.all_input_nodes:
            if last.get(a) == i:
                alive.pop(a, None)
    return best, where, largest


for region in get_store(model).regions.regions:
    for label, graph in (("forward", region.forward), ("backward", region.backward)):
        if graph is None:
            continue
        best, where, largest = peak(graph)
        print(f"layers {region.layers} {label}: peak {best} bytes at {where}; largest alive: "
              + ", ".join(f"{n} {b}" for b, n in largest))
