"""The ``poros`` torch.compile backend: Dynamo's graph -> AOTAutograd -> our passes -> our runtime.

``torch.compile(model, backend="poros", options={...})`` resolves here through the
``torch_dynamo_backends`` entry point. The joint graph goes through ``passes.JOINT_PASSES``, is
partitioned (min-cut with recompute tags when streaming, so the backward reloads and recomputes each
block; the default partition with ``stream=False``), and the forward and backward graphs go through
``passes.GRAPH_PASSES`` before they run, boxed, under a ``GraphRuntime``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx.graph import _BoxedCodeGen

from ..passes import GRAPH_PASSES, INFERENCE_PASSES, JOINT_PASSES, REGION_PASSES
from ..passes.block_partition import BLOCK, FORWARD
from ..passes.rng import PHASE

from ..errors import PorosConfigError
from ..handles import CHECKPOINTING_MESSAGE, ENTRY_ATTR
from ..options import AUTO, PorosOptions, cuda_graphs_choice
from ..runtime.budget import resolve_budget
from ..runtime.cuda_graphs import RegionGraphs
from ..runtime.depth import choose_prefetch
from ..runtime.executor import GraphRuntime
from ..runtime.store import HostStore
from .ddp import check_ddp_optimizer
from .device_fit import check_step_fits, device_memory, traced_tokens
from .dump import Dumper
from .graph_metadata import forget_module_classes
from .host_fit import reserve_offload
from .ops import LOAD
from .regions import REGION
from .schedule import Schedule

logger = logging.getLogger("poros_fx")

UNPREPARED_WARNING = ("poros backend: the compiled model was not prepared with poros_fx.prepare, so its base stays "
                      "on its device; it runs resident with block recompute (activation memory of one block). "
                      "Call poros_fx.prepare(model) before torch.compile to stream the base.")


def _find_store(example_inputs: list[Any]) -> HostStore | None:
    for t in example_inputs:
        entry = getattr(t, ENTRY_ATTR, None) if isinstance(t, torch.Tensor) else None
        if entry is not None:
            return entry.store
    return None


def _check_host_inputs(graph: fx.GraphModule, schedule: Schedule) -> None:
    """Joint placeholders ``primals_i`` are Dynamo's inputs in order; a host tensor's placeholder must
    have its shape, or the names in the schedule (and the dumps) would point at the wrong weights."""
    placeholders = {n.name: n for n in graph.graph.find_nodes(op="placeholder")}
    for name, entry in schedule.host_inputs.items():
        val = placeholders[name].meta.get("val") if name in placeholders else None
        if val is None or tuple(val.shape) != tuple(entry.host.shape):
            raise AssertionError(f"poros backend: joint input {name} is not the host tensor {entry.name}; "
                                 "AOTAutograd's input order changed (please report this with your torch version)")


def _measured_depth(store: HostStore | None) -> tuple[int, str]:
    """The backward's prefetch depth from the forward's measured first run (runtime/depth.py)."""
    if store is None:
        return 1, "prefetch auto: 1 (the model is not prepared: nothing streams)"
    sizes = store.host.block_bytes()
    layer = max(sizes[1:-1]) if len(sizes) > 2 else max(sizes, default=0)
    free = torch.cuda.mem_get_info(store.device)[0] if store.device.type == "cuda" else None
    return choose_prefetch(store.timing, device_type=store.device.type, block_bytes=layer, free_bytes=free,
                           budgeted=store.budget.memory_budget is not None)


OFFLOAD_CUDA_WARNING = ("poros backend: offload_boundaries on CUDA is not yet validated bit for bit (its GPU parity "
                        "test failed once, unexplained; docs/limitations.md): compare a run with stream=False before "
                        "relying on exactness")


def _warn_inline_layers(gm: fx.GraphModule, store: HostStore, schedule: Schedule) -> None:
    """Say so when a model with regions has decoder layers traced inline in this graph (each layer
    traced and compiled on its own, and ``codegen`` not applied to them), and why."""
    if store.regions is None or gm.graph.find_nodes(op="call_function", target=REGION):
        return
    pattern = f".{schedule.layer_attr}."
    if not any(pattern in str(fqn) for n in gm.graph.nodes for fqn, _ in (n.meta.get("nn_module_stack") or {}).values()):
        return
    warnings.warn(f"poros backend: decoder layers are traced into this graph one by one instead of running as "
                  f"compiled regions ({schedule.codegen} codegen does not apply to them; compiling takes longer): a "
                  "layer was called with a value a region cannot take (a KV cache object: pass use_cache=False when "
                  "training)", stacklevel=2)


def _warn_split_layers(gm: fx.GraphModule, store: HostStore, schedule: Schedule) -> None:
    """Say where, and what it costs, when this graph is a piece of a step Dynamo split inside the
    decoder layers (a graph break there): the pieces run one after the other, so no block of one is
    prefetched during another, and a piece that names no layer loads all its base tensors as one block."""
    if store.split_warned or not (schedule.layers_from_loads or schedule.blocks[0].name == "no-layers"):
        return
    if schedule.blocks[0].name == "no-layers" and not any(n.target is LOAD for n in gm.graph.nodes):
        return  # a piece without base tensors (loss code, a tail): nothing streams in it anyway
    store.split_warned = True
    traces = [_source_line(n.meta["stack_trace"]) for n in gm.graph.nodes if n.meta.get("stack_trace")]
    traces = [t for t in traces if t]
    where = f" It starts at {traces[0]} and ends at {traces[-1]}." if traces else ""
    cost = ("its layers are told apart by the base tensors they load" if schedule.layers_from_loads
            else f"it is one block: its {len(schedule.blocks[0].weights)} base tensors are resident together")
    warnings.warn(f"poros backend: Dynamo split the step inside the decoder layers (a graph break), so this graph is "
                  f"one piece of it: no block is prefetched across pieces, and {cost}.{where} TORCH_LOGS=graph_breaks "
                  "names the break; remove it (or keep regions=True, where a layer is one op) for full streaming. "
                  "Warned once per prepared model.", stacklevel=2)


def _check_chunked_loss(opts: PorosOptions, store: HostStore) -> None:
    """``options={"chunked_loss": ...}`` must be what the model's forward was traced with: it changes the
    Python Dynamo traces (the loss, ``logits=None``), and the backend only sees the graph after that."""
    traced = store.chunked_loss()
    if opts.chunked_loss is not None and opts.chunked_loss != traced:
        raise PorosConfigError(f"options={{'chunked_loss': {opts.chunked_loss}}}, but this step was traced with "
                               f"chunked_loss={traced}: it changes the model's forward, which Dynamo traced before the "
                               "backend saw the option. Set it on the model first: poros_fx.prepare(model, "
                               "chunked_loss=...) (@poros_fx.step, PorosTrainer and poros-fx train do this for you)")


def _source_line(stack_trace: str) -> str | None:
    """``file.py:123 (function): code`` of the innermost frame of a node's stack trace."""
    lines = stack_trace.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.strip().startswith("File ")]
    if not frames:
        return None
    m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', lines[frames[-1]])
    if not m:
        return None
    code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < len(lines) else ""
    return f"{os.path.basename(m.group(1))}:{m.group(2)} ({m.group(3)}: {code})"


def _reused_by_backward(schedule: Schedule, phase: str, store_head_chunks: int) -> frozenset[int]:
    """The blocks a training forward leaves on the device for its backward, which starts with them: the
    head, and with prefetch >= 1 the last layer block too (the forward's window at its end holds both,
    so the peak bound (1 + prefetch) x largest block still holds); none when the head is loaded in row
    chunks (it would be resident whole). ``options={"turnaround": False}``: none (for A/B runs)."""
    if phase != "forward" or not schedule.stream or not schedule.options.turnaround or len(schedule.blocks) < 3:
        return frozenset()
    if store_head_chunks > 1:  # a chunked head is never resident whole, not even across the turn
        return frozenset()
    head = len(schedule.blocks) - 1
    return frozenset({head, head - 1} if schedule.prefetch >= 1 else {head})


def _reused_by_forward(schedule: Schedule) -> frozenset[int]:
    """The blocks a training backward leaves on the device for the next step's forward, which starts with
    them: the forward's first ``prefetch`` layer blocks (the backward ends with them; the forward's window
    at its start holds the same ones, so the peak bound (1 + prefetch) x largest block still holds). With
    CUDA graphs the first ``1 + prefetch``: the load slots (``runtime/load_slots.py``) hold the forward's
    whole first window between steps anyway, so one more block costs no memory and saves its copy. The
    runtime leaves the first that many blocks the memory budget does not keep (a kept block stays anyway;
    ``GraphRuntime._left_for_forward``); nothing is left by a step that measures for the budget.
    ``options={"turnaround": False}``: none."""
    if not schedule.stream or not schedule.options.turnaround or len(schedule.blocks) < 3:
        return frozenset()
    window = schedule.prefetch + (1 if schedule.options.cuda_graphs else 0)
    return frozenset(range(1, min(1 + window, len(schedule.blocks) - 1)))


def _set_budget(store: Any, request: int | str | None, least_memory: bool) -> None:
    """The budget the options ask for wins over prepare's (``least_memory``: none); a new request plans
    anew. ``"auto"`` is resolved once, at the first graph that asks for it (``runtime/budget.py``)."""
    if request is None and not least_memory:
        return
    if request == store.budget.request:
        return
    budget, source = resolve_budget(request, store.device)
    if budget != store.budget.memory_budget:
        store.forget_plan()
        store.budget.memory_budget = budget
    store.budget.request, store.budget.source = request, source


def _check_no_checkpointing(gm: fx.GraphModule) -> None:
    """Dynamo captures ``torch.utils.checkpoint`` (Hugging Face gradient checkpointing switched on after
    ``prepare``, or the user's own) as a ``tag_activation_checkpoint`` call; its recompute tags would
    fight the backend's own, so refuse it with the reason instead of a partitioner error."""
    for module in gm.modules():
        for n in module.graph.nodes if isinstance(module, fx.GraphModule) else ():
            if isinstance(n.target, torch._ops.HigherOrderOperator) and "activation_checkpoint" in n.target.name():
                raise PorosConfigError(CHECKPOINTING_MESSAGE.format(where=" (torch.utils.checkpoint in the captured step)"))


def _check_sequence_chunks(opts: PorosOptions, store: HostStore) -> None:
    """``options={"sequence_chunks": ...}`` must be what the model's regions are traced with (prepare's, or
    ``prepare.set_trace_options``)."""
    if opts.sequence_chunks is not None and opts.sequence_chunks != store.sequence_chunks:
        raise PorosConfigError(f"options={{'sequence_chunks': {opts.sequence_chunks}}}, but this model's regions run "
                               f"its layers in {store.sequence_chunks} token chunk(s): set it when the model is prepared "
                               f"(prepare(..., sequence_chunks={opts.sequence_chunks})), or let @poros_fx.step, "
                               "PorosTrainer or poros-fx train set it")


def _check_fits_device(store: HostStore, gm: fx.GraphModule, example_inputs: list[Any], schedule: Schedule) -> None:
    """A streamed CUDA training step estimated over the device's memory is refused before it runs
    (``device_fit.py``)."""
    if schedule.device.type != "cuda" or not schedule.stream or not torch.is_grad_enabled():
        return
    tokens = traced_tokens([n.name for n in gm.graph.find_nodes(op="placeholder")], example_inputs)
    lm = store.lm_ref() if store.lm_ref is not None else None
    if tokens is None or lm is None:
        return
    memory, note = device_memory(schedule.device, store.budget.memory_budget)
    check_step_fits(store, lm, tokens, memory, note, offload_boundaries=schedule.offload_boundaries)


def poros(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Callable:
    """The backend. ``options``: the streaming options, as ``options.PorosOptions`` declares them."""
    opts = PorosOptions.from_dict(options)
    check_ddp_optimizer()  # Dynamo's DDPOptimizer would split the step between a block's load and its use
    _check_no_checkpointing(gm)
    store = _find_store(example_inputs)
    if store is None:
        warnings.warn(UNPREPARED_WARNING, stacklevel=2)
    dumper = Dumper(opts.dump)
    requested = opts.prefetch if opts.prefetch is not None else (store.prefetch if store else 1)
    device = store.device if store else torch.device("cpu")
    offload_boundaries = (opts.offload_boundaries if opts.offload_boundaries is not None
                          else bool(store and store.offload_boundaries))
    graphs, graphs_note = cuda_graphs_choice(opts, device, offload_boundaries, store.sequence_chunks if store else 1)
    if store is not None:
        _set_budget(store, None if opts.least_memory else opts.memory_budget, opts.least_memory)
    # on CUDA only: on the CPU a load is a synchronous copy, and a deeper window only raises the peak
    budgeted = store is not None and store.device.type == "cuda" and store.budget.memory_budget is not None
    schedule = Schedule(
        graph_id=dumper.folder.name if dumper.folder else hex(id(gm)),
        options=dataclasses.replace(opts, cuda_graphs=graphs),
        graphs_note=graphs_note,
        graphs_asked=opts.cuda_graphs is True,
        device=device,
        block_size=opts.block_size or (store.host.block_size if store else 1),
        # "auto": the forward loads one block ahead; two under a memory budget, whose kept blocks sit
        # between streamed ones (runtime/budget.py): one ahead, the load after a kept block would wait
        # for the compute stream to reach that kept block, and the copy stream would idle while it computes
        prefetch=(2 if budgeted else 1) if requested == AUTO else requested,
        stream=opts.stream,
        auto_prefetch=requested == AUTO and opts.stream,
        layer_attr=store.family.layer_attr if store else "layers",
        codegen=opts.codegen or (store.codegen if store else "eager"),
        offload_boundaries=offload_boundaries,
        store_ref=weakref.ref(store) if store is not None else None,
        dumper=dumper if dumper.enabled else None,
        region_passes=REGION_PASSES,
    )
    if store is not None:
        _check_chunked_loss(opts, store)
        _check_sequence_chunks(opts, store)
        _check_fits_device(store, gm, example_inputs, schedule)
        if device.type == "cuda" and opts.cuda_graphs is None and not opts.least_memory and not graphs:
            warnings.warn(f"poros: CUDA graphs {graphs_note}", stacklevel=2)  # the default fell back
        if graphs:
            if store.residency.region_graphs is None:
                store.residency.region_graphs = RegionGraphs(store.device)
        if schedule.offload_boundaries and schedule.stream and schedule.device.type == "cuda":
            warnings.warn(OFFLOAD_CUDA_WARNING, stacklevel=2)
        store.schedules.append(schedule)
        _warn_inline_layers(gm, store, schedule)
    primals = (f"primals_{i}" for i in itertools.count(1))
    schedule.host_inputs = {name: getattr(t, ENTRY_ATTR) for name, t in zip(primals, example_inputs)
                            if isinstance(t, torch.Tensor) and getattr(t, ENTRY_ATTR, None) is not None}
    # every tensor of the store, not just this graph's inputs (a layer's block stays in the arena when
    # its tensors are moved)
    moved = [e.name for e in store.host.tensors() if e.host.device.type != "cpu"] if store is not None else []
    if moved:
        raise PorosConfigError(store.host.moved_message(moved))

    # the first step of a large model compiles for minutes: say where it is (logging.INFO on "poros_fx")
    logger.info("poros: Dynamo captured %d nodes (%d host tensors); AOTAutograd traces the joint graph",
                len(gm.graph.nodes), len(schedule.host_inputs))

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        started = time.perf_counter()
        schedule.phase_seconds["joint_trace"] = started - aot_started
        logger.info("poros: joint graph of %d nodes; %s partition", len(joint.graph.nodes),
                    "min-cut (recompute per block)" if schedule.stream else "default")
        schedule.num_fwd_outputs = num_fwd_outputs
        _check_host_inputs(joint, schedule)
        dumper.graph(joint, "joint")
        for joint_pass in JOINT_PASSES:
            joint = joint_pass(joint, schedule)
            dumper.graph(joint, f"joint_{joint_pass.__name__}")
        if schedule.store is not None:
            _warn_split_layers(joint, schedule.store, schedule)
        partition = min_cut_rematerialization_partition if schedule.stream else default_partition
        # graph-safe RNG gives each random op a private generator: exact between forward and recompute
        # but not the stream eager draws from. The plain wrappers save and restore the global state.
        # No CSE: it would merge the two loads of a tied embedding / lm_head into one that lives (and is
        # saved) from the embedding to the head.
        with functorch_config.patch(graphsafe_rng_functionalization=False, cse=False):
            fw, bw = partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        fw_out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        # activations the backward keeps (inputs and lifted constants cost nothing extra)
        schedule.saved_boundaries = [n.name for n in fw_out[num_fwd_outputs:]
                                     if isinstance(n, fx.Node) and n.op not in ("placeholder", "get_attr")]
        for n in bw.graph.nodes:
            if n.meta.get(FORWARD) and n.op == "call_function":
                schedule.blocks[n.meta[BLOCK]].recomputed_nodes += 1
        schedule.phase_seconds["partition"] = time.perf_counter() - started
        logger.info("poros: partitioned in %.1f s: forward %d nodes, backward %d nodes (compiled at the first "
                    "backward)", schedule.phase_seconds["partition"], len(fw.graph.nodes), len(bw.graph.nodes))
        for graph in (joint, fw, bw):
            forget_module_classes(graph)
        return fw, bw

    def compiler(phase: str) -> Callable:
        def compile_graph(graph: fx.GraphModule, _inputs: Any) -> Callable:
            started = time.perf_counter()
            graph.meta[PHASE] = phase
            store = schedule.store  # held weakly: the compiled graph must not keep the model's base alive
            if schedule.auto_prefetch and phase == "backward":
                schedule.prefetch, schedule.prefetch_note = _measured_depth(store)
            reused = _reused_by_backward(schedule, phase, store.host.head_chunks if store else 1)
            if phase == "forward":  # by the forward's prefetch (a backward with prefetch "auto" measures its own)
                schedule.reused_by_backward = reused
                schedule.reused_by_forward = _reused_by_forward(schedule) if schedule.blocks else frozenset()
            schedule.runtime = GraphRuntime(store, schedule.stream, phase,
                                            measure=schedule.auto_prefetch and phase == "forward",
                                            reused_by_backward=reused, schedule=schedule,
                                            training=bool(schedule.blocks),
                                            reused_by_forward=schedule.reused_by_forward if phase == "backward"
                                            else frozenset())
            if not schedule.blocks:  # an inference graph: no joint graph went through the partitioner
                schedule.num_fwd_outputs = len(next(iter(graph.graph.find_nodes(op="output"))).args[0])
                for inference_pass in INFERENCE_PASSES:
                    graph = inference_pass(graph, schedule)
                    dumper.graph(graph, f"{phase}_{inference_pass.__name__}")
                if store is not None:
                    _warn_split_layers(graph, store, schedule)
            for graph_pass in GRAPH_PASSES:
                graph = graph_pass(graph, schedule)
                dumper.graph(graph, f"{phase}_{graph_pass.__name__}")
            schedule.graphs[phase] = graph
            if phase == "forward" and store is not None:
                reserve_offload(graph, schedule, store, tokens)
            dumper.schedule(schedule)
            forget_module_classes(graph)
            graph.graph.set_codegen(_BoxedCodeGen())
            graph.recompile()
            wrapped = schedule.runtime.wrap(graph)
            schedule.phase_seconds[f"{phase}_passes"] = time.perf_counter() - started
            return wrapped

        return compile_graph

    tokens = traced_tokens([n.name for n in gm.graph.find_nodes(op="placeholder")], example_inputs)
    aot_started = time.perf_counter()
    compiled = aot_module_simplified(gm, example_inputs, fw_compiler=compiler("forward"),
                                     bw_compiler=compiler("backward"), partition_fn=partition_fn)
    forget_module_classes(gm)  # AOTAutograd's compiled function keeps Dynamo's graph
    return compiled

