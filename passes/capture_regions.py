"""Capture regions: point every region call at a site whose calls CUDA graphs capture and replay.

With ``options={"cuda_graphs": True}`` on a CUDA device, each node that runs a compiled region (set up
by ``lower_regions``, directly or through an RNG wrapper) calls it through ``graph_site``: the model's
``RegionGraphs`` (``poros_fx/runtime/cuda_graphs.py``) warm the call up, record it once per step shape and
replay it after that. The site is named by the graph and the node, so a layer's forward, its recompute
and its backward are three sites; the same region serves them all. Without the option (or on the CPU)
the pass changes nothing.

Forward (streamed), before / after::

    run_and_save_rng_state = run_and_save_rng_state_cuda0_region_r0_forward([getitem_2, cos, sin, wait, ...], 140230, 1, call, '1011...')
    run_and_save_rng_state = run_and_save_rng_state_cuda0_graphed_region_r0_forward([getitem_2, cos, sin, wait, ...], 140230, 1, call, '1011...')

Backward::

    region_backward = region_r0_backward([wait_9, ..., getitem_31, getitem_40], 140230, 0)
    region_backward = graphed_region_r0_backward([wait_9, ..., getitem_31, getitem_40], 140230, 0)
"""

from __future__ import annotations

import weakref

import torch.fx as fx

from poros_fx.compiler.schedule import Schedule
from poros_fx.runtime.cuda_graphs import graph_site

from .lower_regions import RUNNER, calling
from .rng import PHASE


def capture_regions(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    store = schedule.store
    graphs = store.residency.region_graphs if store is not None and schedule.options.cuda_graphs else None
    if graphs is None:
        return gm
    found = weakref.ref(graphs)  # the compiled graph must not keep the model's pool alive
    for n in gm.graph.nodes:
        runner = n.meta.get(RUNNER) if n.op == "call_function" else None
        if runner is None:
            continue
        run, wrapper, slot = runner
        site = graph_site(run, found, f"{schedule.graph_id}/{gm.meta[PHASE]}/{n.name}")
        n.target = site if wrapper is None else calling(wrapper, slot, site)
        n.meta[RUNNER] = (site, wrapper, slot)
    return gm
