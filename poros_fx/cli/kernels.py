"""Which code runs Qwen3.5's Gated DeltaNet layers here, and what exactness each path keeps (``doctor``).

transformers runs a Gated DeltaNet layer's causal conv1d and its chunked gated delta rule with the
``causal-conv1d`` and ``flash-linear-attention`` (``fla``) kernels when those packages are installed,
else with its pure-torch reference functions (much slower; they refuse packed sequences). Either way a
layer is one poros region, traced once per structure and run for the forward, the recompute and
``stream=False`` alike:

* reference path: aten ops in the region's graph. Streamed == ``stream=False`` bit for bit, and with
  ``codegen="eager"`` == the plain eager loop (tests/test_families.py, CPU).
* kernel path: the packages' kernels inside the region. Streamed == ``stream=False`` holds where the
  kernels are deterministic (the same kernels on the same inputs); equality with the eager loop holds
  as far as Inductor leaves those calls alone. Not measured here: no GPU run has used them yet.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

PACKAGES = (("causal-conv1d", "causal_conv1d", "the depthwise causal conv1d"),
            ("flash-linear-attention", "fla", "the chunked gated delta rule"))


def linear_attention_paths() -> list[tuple[str, str]]:
    """``(what, which code runs it and what exactness it keeps)`` for each of the two kernels."""
    rows = []
    for dist, module, what in PACKAGES:
        if importlib.util.find_spec(module) is not None:
            try:
                version = md.version(dist)
            except md.PackageNotFoundError:
                version = "?"
            rows.append((what, f"{dist} {version} kernel: streamed == stream=False where it is deterministic "
                               "(not yet measured on a GPU)"))
        else:
            rows.append((what, f"transformers' pure-torch reference ({dist} not installed): streamed == "
                               "stream=False == eager loop (codegen eager), tested on the CPU"))
    return rows
