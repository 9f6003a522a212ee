"""The regions of one prepared model: found by a layer's structure and call, traced when new.

``RegionTable.region`` answers "which region runs this call of layer N, and at which sizes": the
layer's fingerprint (``key.py``), the call string (with the layer's mode) and which inputs need a
gradient pick the candidates; the first whose signature binds the call's tensors (``shapes.py``)
is it. A call no region takes is traced now (``trace.py``), once per structure: layers of one
structure share the region at every sequence length. Another live prepared model's region of the same
structure and call is taken before tracing (a run and its ``stream=False`` reference in one process,
two adapters on copies of one base): the trace and its compiled code are shared, the weights are
each model's own inputs.

Custom ops take tensors, ints and strings, not Python objects: ``poros::region`` names the table of
its prepared model by a handle, resolved here (``table_of``); a table lives as long as its host
store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Sequence

from torch import nn

from ...errors import PorosConfigError
from ..ddp import check_ddp_optimizer
from .key import check_state, fingerprint
from .shapes import meta_of
from .trace import Region, trace_region

logger = logging.getLogger("poros_fx")

# handle -> table; weak, so a compiled graph (which holds only the handle) keeps no model alive
_TABLES: weakref.WeakValueDictionary[int, "RegionTable"] = weakref.WeakValueDictionary()


def quiet_compile_events() -> Any:
    """A region traced or compiled inside Dynamo's own compile nests AOTAutograd's and Inductor's timed
    events in Dynamo's: their chromium event log is put back as it was afterwards, which keeps it
    from warning "Start event not in stack" for each of Dynamo's events that ends after ours."""
    from torch._dynamo import utils as dynamo_utils

    timed = getattr(dynamo_utils, "chromium_event_timed", None)
    return timed("poros_region", reset_event_log_on_exit=True) if timed is not None else contextlib.nullcontext()


def table_of(handle: int) -> "RegionTable":
    table = _TABLES.get(handle)
    if table is None:
        raise PorosConfigError("a compiled graph refers to a prepared model that no longer exists (it was "
                               "unprepared or freed); compile the model again")
    return table


def check_on_device(layer: int, device: Any, inputs: Sequence[Any]) -> None:
    """A region call's inputs (fake or real tensors) are on the layer's compute device; an adapter attached
    after ``prepare`` on CUDA is not (PEFT puts it where the base weights are: host memory)."""
    # a CPU scalar is passed on purpose (the attention's skip flag, attention.py: no device sync to read it)
    elsewhere = sorted({str(t.device) for t in inputs if t.device != device and t.dim() > 0})
    if elsewhere:
        raise PorosConfigError(
            f"decoder layer {layer} has tensors of its own on {', '.join(elsewhere)} while the model computes on "
            f"{device}: an adapter attached after poros_fx.prepare is created where PEFT finds the layer's base "
            "weights, which prepare keeps in host memory. Attach the adapter before poros_fx.prepare (prepare "
            "puts it on the compute device)")


class RegionTable:
    """The regions of one prepared model's decoder layers, keyed by structure; ``handle`` names it in
    the region ops' arguments."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        # (fingerprint no., call, grads, each input's dtype/device/rank) -> regions, symbolic ones first
        self.by_key: dict[Any, list[Region]] = {}
        self.objects: dict[int, tuple[Any, Any]] = {}  # fingerprint's object descriptions
        self.fingerprints: dict[tuple, int] = {}  # fingerprint -> its number (the keys hold the number)
        self._memo: tuple[Any, dict[int, int]] = (None, {})  # (the compile's TracingContext, layer -> fingerprint no.)
        self.regions: list[Region] = []
        self.handle = id(self)
        _TABLES[self.handle] = self

    def _fingerprint(self, layer: int) -> int:
        """``fingerprint`` of layer ``layer``, worked out once per compile: Dynamo, AOTAutograd and the
        passes each ask for every layer, and nothing changes a module while a frame compiles (one
        ``TracingContext``)."""
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        if context is None:
            return self._intern(layer)
        if self._memo[0] is not context:
            self._memo = (context, {})
        known = self._memo[1]
        if layer not in known:
            known[layer] = self._intern(layer)
        return known[layer]

    def _intern(self, layer: int) -> int:
        """A small number for the layer's fingerprint (a large tuple, slow to hash at every lookup)."""
        check_state(self.layers[layer], layer)
        return self.fingerprints.setdefault(fingerprint(self.layers[layer], self.objects), len(self.fingerprints))

    def region(self, layer: int, call: str, grads: str, inputs: Sequence[Any]) -> tuple[Region, tuple]:
        """The region for this call of layer ``layer`` on the op inputs ``inputs`` (fake or real
        tensors), traced now if no region takes it, and the values of its symbols for this call."""
        coarse = tuple((t.dtype, t.device, t.dim()) for t in inputs)
        check_on_device(layer, self.layers[layer]._poros_device, inputs)
        key = (self._fingerprint(layer), call, grads, coarse)
        for region in self.by_key.get(key, ()):
            values = region.signature.bind(inputs)
            if values is not None:
                self._used_by(region, layer)
                return region, values
        region = reused = self._from_another_model(key, inputs)
        if region is None:
            check_ddp_optimizer()  # under it, the trace's own frames fail to compile
            with quiet_compile_events():
                region = trace_region(self.layers[layer], call, grads, [meta_of(t) for t in inputs],
                                      index=len(self.regions))
        values = region.signature.bind(inputs)
        if values is None:
            raise AssertionError(f"poros: region {region.name} does not take the call it was traced for "
                                 f"({region.signature.describe()})")
        self.regions.append(region)
        self._file(key, region)
        # a first forward may cache plain attributes (bitsandbytes' compute dtype): file the region
        # under what the layer looks like now as well
        after = self._intern(layer)
        if after != key[0]:
            self._file((after, *key[1:]), region)
        if self._memo[0] is not None:
            self._memo[1][layer] = after
        self._used_by(region, layer)
        if reused is None:
            logger.info("poros: traced region %s (layer %d: forward %d nodes, backward %d nodes, %d saved; %s) in %.1f s",
                        region.name, layer, len(region.forward.graph.nodes),
                        len(region.backward.graph.nodes) if region.backward is not None else 0,
                        len(region.output_specs) - region.num_outputs,
                        "every sequence length" if region.signature.dynamic else "these sizes only",
                        region.trace_seconds)
        return region, values

    def _from_another_model(self, key: tuple, inputs: Sequence[Any]) -> Region | None:
        """A region another live prepared model traced for a layer of this structure and this call, as
        this table's: a trace depends on the layer's fingerprint, the call and its inputs' metadata, not
        on the weights (inputs), so two model copies in one process (a run and its reference) trace
        each structure once. The copy shares the graphs and the compiled code; only regions the other
        model's compile has lowered (``passes/lower_regions.py``) are taken."""
        number = key[0]
        full = next(f for f, n in self.fingerprints.items() if n == number)
        for other in list(_TABLES.values()):
            found = other.fingerprints.get(full) if other is not self else None
            if found is None:
                continue
            for region in other.by_key.get((found, *key[1:]), ()):
                if region.lowered and region.signature.bind(inputs) is not None:
                    logger.info("poros: region %s of another prepared model takes this call: its trace and "
                                "compiled code serve this model too", region.name)
                    return dataclasses.replace(region, index=len(self.regions), layers=[], trace_seconds=0.0,
                                               compile_seconds={})
        return None

    def _file(self, key: Any, region: Region) -> None:
        found = self.by_key.setdefault(key, [])
        found.append(region)
        found.sort(key=lambda r: not r.signature.dynamic)  # the general ones first: no size guards on a match

    def _used_by(self, region: Region, layer: int) -> None:
        if layer not in region.layers:
            region.layers.append(layer)
        # what the layer writes into the state it passes on (call.py): ``call_region`` reads it right
        # after the op, in code Dynamo traces (which then guards it)
        self.layers[layer]._poros_writes = region.writes
