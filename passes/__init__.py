"""The poros-fx pass pipeline: the one place that says what runs when.

A pass is ``(graph_module, schedule) -> graph_module``. The backend runs ``JOINT_PASSES`` on the
joint forward+backward graph, partitions it (min-cut with the recompute tags when streaming, the
default partition otherwise), then runs ``GRAPH_PASSES`` on the forward and on the backward graph.
An inference graph (no grad: AOTAutograd compiles a forward only, with no joint graph) first goes
through ``INFERENCE_PASSES``. ``lower_regions`` runs ``REGION_PASSES`` once on each region's own
forward and backward graphs (a decoder layer, ``poros_fx/compiler/regions/``) before compiling it
(the 4-bit matmul lowering; with the eager codegen, views that real kernels' strides may refuse become
reshapes, and dropout's gradient on the CPU is eager's ``grad * noise``; with Inductor a convolution's
backward is one opaque call, so it holds for every length; with ``sequence_chunks`` the graph runs one
token chunk at a time). ``capture_regions`` comes
last: with ``options={"cuda_graphs": True}`` the region calls go
through CUDA graphs (``poros_fx/runtime/cuda_graphs.py``).
After every pass the dump hook (``poros_fx.compiler.dump``) writes the graph when dumping is on.
"""

from __future__ import annotations

from .block_partition import block_partition
from .capture_regions import capture_regions
from .cpu_dropout_backward import cpu_dropout_backward
from .lower_matmul_4bit import lower_matmul_4bit
from .lower_regions import lower_regions
from .lower_rng import lower_rng
from .offload import offload
from .opaque_convolution_backward import opaque_convolution_backward
from .order_sequence_chunks import order_sequence_chunks
from .prefetch import prefetch
from .recompute import recompute
from .reshape_views import reshape_views
from .residency import residency
from .rng import rng

JOINT_PASSES = (block_partition, recompute)
INFERENCE_PASSES = (block_partition,)
GRAPH_PASSES = (lower_matmul_4bit, rng, lower_rng, lower_regions, prefetch, residency, offload, capture_regions)
REGION_PASSES = (lower_matmul_4bit, reshape_views, cpu_dropout_backward, opaque_convolution_backward,
                 order_sequence_chunks)

__all__ = ["GRAPH_PASSES", "INFERENCE_PASSES", "JOINT_PASSES", "REGION_PASSES", "block_partition", "capture_regions",
           "cpu_dropout_backward", "lower_matmul_4bit",
           "lower_regions", "lower_rng", "offload", "opaque_convolution_backward", "order_sequence_chunks", "prefetch", "recompute", "reshape_views", "residency", "rng"]
