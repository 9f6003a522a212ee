"""Regions: every decoder layer runs as one compiled region, traced and compiled once per structure.

The package, in the order its modules build on each other:

- ``call.py``: a layer call as tensors and a string (custom ops take no Python objects);
- ``shapes.py``: symbolic sizes, a region's signature, binding a call's sizes;
- ``views.py``: shallow copies of a layer with submodules replaced (``sequence_chunks.py``, ``parameter_lora.py``);
- ``recorded.py``: what transformers' hooks record inside a layer (router logits) as more outputs of its region;
- ``key.py``: what makes two layers one region (fingerprint), the mode Dynamo must guard;
- ``trace.py``: a layer's joint graph, partitioned once (``Region``, ``Packing``);
- ``split.py``: a forward cut in two, so the backward's rerun computes the saved tensors alone;
- ``compile.py``: one artifact per codegen (Inductor or the aten graph);
- ``table.py``: a model's regions, found by key and signature, traced when new;
- ``ops.py``: the ``poros::region`` / ``poros::region_backward`` ops and the prepared layer's forward.
"""

from .call import SEP, flatten_call, rebuild_call
from .compile import CODEGENS, compile_region, keep_output_strides
from .key import MERGE_ERROR, check_no_dora_on_nf4, check_not_merged, check_no_parameter_lora, check_state, fingerprint, mode_entry, mode_modules, state, state_names
from .ops import (REGION, REGION_BACKWARD, ROLE, call_region, called_region, compile_for, expanded_targets,
                  layer_forward, runners, saved_only_runner)
from .shapes import Signature, TensorSpec, meta_of
from .table import RegionTable, table_of
from .trace import Packing, Region, SymbolicTraceError, block_view, trace_region

__all__ = ["CODEGENS", "MERGE_ERROR", "REGION", "REGION_BACKWARD", "ROLE", "SEP", "Packing", "Region", "RegionTable",
           "Signature", "SymbolicTraceError", "TensorSpec", "block_view", "call_region", "called_region",
           "check_no_dora_on_nf4", "check_not_merged", "check_no_parameter_lora", "check_state", "compile_for", "compile_region", "expanded_targets", "fingerprint",
           "flatten_call", "keep_output_strides", "layer_forward", "meta_of", "mode_entry", "mode_modules", "rebuild_call",
           "runners", "saved_only_runner", "state", "state_names", "table_of", "trace_region"]
