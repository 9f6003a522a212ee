"""The Schedule: what the passes decided for one compiled graph, in one object that dumps read.

Passes fill it (block partition: blocks and node owners; recompute: regions; RNG: slots; residency:
loads, prefetch positions and evicts); ``table()`` renders it for people.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..options import PorosOptions
from ..runtime.budget import describe
from .block_graph import describe as describe_blocks


@dataclasses.dataclass
class Block:
    index: int
    name: str  # "embed", "layers.0", "layers.2-3", "head"
    weights: list[str] = dataclasses.field(default_factory=list)
    nbytes: int = 0  # base bytes this block loads
    forward_nodes: int = 0
    recomputed_nodes: int = 0  # forward nodes the backward reruns


@dataclasses.dataclass
class Load:
    phase: str  # "forward" | "backward"
    block: int
    weight: str
    nbytes: int
    issued_before_block: int  # the block whose first op the load now precedes (prefetch distance = block - this)
    position: int = -1  # node index in the final graph


@dataclasses.dataclass
class Evict:
    phase: str
    block: int
    weight: str
    after_node: str
    position: int = -1


@dataclasses.dataclass
class RngSlot:
    index: int
    block: int
    op: str
    forward_node: str = ""
    backward_node: str = ""


@dataclasses.dataclass
class RegionUse:
    """A compiled region (``compiler/regions/``) as one graph uses it: the blocks that call it, and its
    sizes and costs (trace once per structure, compile once per codegen)."""

    name: str  # "r0"
    codegen: str
    forward_nodes: int
    backward_nodes: int
    saved: int  # tensors its forward hands its backward
    trace_seconds: float
    compile_seconds: float
    blocks: set[int] = dataclasses.field(default_factory=set)
    region: Any = dataclasses.field(default=None, repr=False)  # the compiler.regions.Region (its graphs, for dumps)

    @classmethod
    def of(cls, region: Any, codegen: str) -> "RegionUse":
        return cls(name=region.name, codegen=codegen, forward_nodes=len(region.forward.graph.nodes),
                   backward_nodes=len(region.backward.graph.nodes) if region.backward is not None else 0,
                   saved=len(region.output_specs) - region.num_outputs, trace_seconds=region.trace_seconds,
                   compile_seconds=region.compile_seconds.get(codegen, 0.0), region=region)


@dataclasses.dataclass
class Schedule:
    graph_id: str
    options: PorosOptions  # as the step runs them: cuda_graphs resolved (options.cuda_graphs_choice)
    device: torch.device
    block_size: int
    prefetch: int
    stream: bool
    layer_attr: str = "layers"
    graphs_note: str = ""  # whether region calls replay from CUDA graphs, and why (options.cuda_graphs_choice)
    graphs_asked: bool = False  # options={"cuda_graphs": True} (not the default)
    reused_by_backward: frozenset = frozenset()  # blocks whose forward copies the backward takes over (no evict, no reload)
    reused_by_forward: frozenset = frozenset()  # blocks whose backward copies the next forward takes over
    layers_from_loads: bool = False  # module paths named no layer (a graph break inside one): placed by loads
    num_fwd_outputs: int = 0  # joint graph outputs that belong to the forward
    blocks: list[Block] = dataclasses.field(default_factory=list)
    # the blocks as a DAG (networkx; compiler/block_graph.py): load order, what crosses blocks, liveness
    block_graph: Any = dataclasses.field(default=None, repr=False)
    host_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # placeholder name -> HostEntry
    loads: list[Load] = dataclasses.field(default_factory=list)
    evicts: list[Evict] = dataclasses.field(default_factory=list)
    rng_slots: list[RngSlot] = dataclasses.field(default_factory=list)
    saved_boundaries: list[str] = dataclasses.field(default_factory=list)  # forward values the backward keeps
    # blocks whose activations the backward keeps instead of recomputing them (options save_activations)
    activation_blocks: frozenset = frozenset()
    offload_boundaries: bool = False  # block outputs saved for the backward wait in host memory (passes/offload.py)
    offloaded: list[str] = dataclasses.field(default_factory=list)  # of saved_boundaries: those offloaded
    runtime: Any = None  # runtime.executor.GraphRuntime of the graph being compiled
    auto_prefetch: bool = False  # options={"prefetch": "auto"}: the backward's depth is measured
    prefetch_note: str = ""  # how the backward's depth was chosen (auto)
    graphs: dict[str, Any] = dataclasses.field(default_factory=dict)  # "forward"/"backward" -> final GraphModule
    codegen: str = "eager"  # how the regions of this graph run ("inductor" | "eager")
    regions: dict[str, RegionUse] = dataclasses.field(default_factory=dict)  # region name -> its use here
    # what lower_regions runs on each region's own graphs: passes.REGION_PASSES (the pipeline lists it)
    region_passes: tuple = ()
    # the model's runtime.store.HostStore (its budget plan), held weakly: the compiled graph keeps its schedule
    store_ref: Any = dataclasses.field(default=None, repr=False)
    dumper: Any = dataclasses.field(default=None, repr=False)  # compiler.dump.Dumper writing this graph's dumps
    # host seconds of this graph's one-time work, by phase: "joint_trace" (AOTAutograd up to the partition),
    # "partition", "forward_passes" / "backward_passes" (the passes and codegen of each graph) and
    # "forward_first_run" / "backward_first_run" (each graph's first run, with what it does once)
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def store(self) -> Any:
        return self.store_ref() if self.store_ref is not None else None

    def load_source(self, load: Any) -> tuple[str, int]:
        """(host-store name, bytes copied) of a ``poros.load`` node; a chunked head's load reads a row
        slice of its host tensor (``lm_head.weight[rows 0:19008]``)."""
        src, rows = load.args[0], ""
        while getattr(src, "op", None) == "call_function":  # views of the host tensor (head chunks)
            if src.target is torch.ops.aten.slice.Tensor and not rows:
                rows = f"[rows {src.args[2]}:{src.args[3]}]"
            src = src.args[0]
        entry = self.host_inputs.get(getattr(src, "name", ""))
        val = load.meta.get("val")
        nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else (entry.nbytes if entry else 0)
        return (entry.name if entry else getattr(src, "name", str(src))) + rows, nbytes

    def block_name(self, index: int) -> str:
        return self.blocks[index].name if 0 <= index < len(self.blocks) else f"block{index}"

    def table(self) -> str:
        """One line per block: loads per phase, prefetch position, evicts, recompute region, RNG slots."""
        head = (f"graph {self.graph_id}: stream={self.stream} block_size={self.block_size} prefetch={self.prefetch} "
                f"device={self.device}\n" + (f"{self.prefetch_note}\n" if self.prefetch_note else ""))
        cols = ["block", "name", "base_bytes", "fw_loads", "fw_issued_at", "bw_loads", "bw_issued_at", "evicts",
                "fw_nodes", "recomputed", "rng_slots", "region"]
        rows = [cols]
        for b in self.blocks:
            block_loads = [ld for ld in self.loads if ld.block == b.index]
            fw = [ld for ld in block_loads if ld.phase == "forward"]
            bw = [ld for ld in block_loads if ld.phase == "backward"]

            def at(ls: list) -> str:
                return ",".join(sorted({self.block_name(ld.issued_before_block) for ld in ls})) or "-"

            rng = [str(s.index) for s in self.rng_slots if s.block == b.index]
            region = ",".join(r.name for r in self.regions.values() if b.index in r.blocks) or "-"
            rows.append([str(b.index), b.name, str(b.nbytes), str(len(fw)), at(fw), str(len(bw)), at(bw),
                         str(sum(e.block == b.index for e in self.evicts)), str(b.forward_nodes),
                         str(b.recomputed_nodes), _span(rng), region])
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        tail = f"\nsaved for backward ({len(self.saved_boundaries)}): {', '.join(self.saved_boundaries)}\n"
        if self.activation_blocks:
            tail += (f"activations kept for the backward, not recomputed (save_activations): "
                     f"{', '.join(self.block_name(i) for i in sorted(self.activation_blocks))}\n")
        if self.offloaded:
            tail += f"offloaded to host memory ({len(self.offloaded)}): {', '.join(self.offloaded)}\n"
        if self.block_graph is not None:
            tail += describe_blocks(self.block_graph)
        for r in self.regions.values():
            tail += (f"region {r.name} ({r.codegen}): blocks {_span([str(b) for b in sorted(r.blocks)])}, forward "
                     f"{r.forward_nodes} nodes, backward {r.backward_nodes} nodes, {r.saved} saved tensors, traced in "
                     f"{r.trace_seconds:.1f} s, compiled in {r.compile_seconds:.1f} s (once for every graph)\n")
        if self.store is not None:
            tail += f"memory: {describe(self.store)}\n"
            tail += (f"accumulation: block-major ({self.store.residency.ledger.block_major_steps} step(s) so far: each block loaded "
                     "once for all micro-batches of an optimizer step)\n" if self.runtime is not None
                     and self.runtime.block_major else "accumulation: micro-batch after micro-batch\n")
        return head + "\n".join(lines) + tail


def _span(items: list[str]) -> str:
    if not items:
        return "-"
    return items[0] if len(items) == 1 else f"{items[0]}..{items[-1]} ({len(items)})"
