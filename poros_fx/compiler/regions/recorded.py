"""What transformers records from inside a layer (a mixture of experts' router logits) as more outputs
of the layer's region.

transformers 5 collects such outputs with forward hooks (``utils/output_capturing.py``): a model called
with ``output_router_logits=True`` opens a collector (``_active_collector``: a dict of lists, one per
requested output), and a hook on each router module appends its logits to the collector's list. A
region's trace runs the layer once, on fake tensors, and its compiled code runs no hook; so the call
names the collector's keys in its string, the trace opens a collector of its own for them, and what the
layer's modules appended there becomes more outputs of the region (``trace.py``: a write named
``@router_logits``). ``call_region`` appends those outputs to the caller's collector, in the order the
hooks would have, layer after layer::

    collector {"router_logits": []}                        the model's forward, under Dynamo
    ->  poros.region([hidden, ...], ..., "#0:T\\x1f...\\x1f@record=router_logits", ...)
        returns (hidden, logits)                            the layer's output, then its router's logits
    ->  collector["router_logits"].append(logits)           as the router's hook does in eager mode

The auxiliary loss is then computed from them by the model's own code, in the outer graph.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from transformers.utils.output_capturing import _active_collector, maybe_install_capturing_hooks

from ...errors import PorosConfigError
from ...handles import text_config
from .call import SEP

RECORD = "@record="  # the call string's entry naming the collector's keys (``rebuild_call`` skips it)
RECORDED = "@"  # a region write whose name starts with it: a recorded output, not state for later layers
ROUTER_LOGITS = "router_logits"


def _collector() -> dict | None:
    """The collector the model's forward opened, while Dynamo traces it (``CompileableContextVar`` keeps it
    as a plain global then; a region is called only then)."""
    return _active_collector.global_var if _active_collector.compiling else None


def record_entry() -> str | None:
    """The keys transformers' collector holds at this call as a call-string entry (``None``: none). Read in
    code Dynamo traces: a call that records and one that does not get regions of their own. The hidden
    states are recorded by the decoder layer's own hook, around the region's call, and ``_``-keys are the
    collector's settings."""
    collector = _collector()
    keys = sorted(k for k in collector.keys() if k != "hidden_states" and not k.startswith("_")) if collector else []
    return RECORD + ",".join(keys) if keys else None


def recorded_keys(call: str) -> list[str]:
    """The keys ``record_entry`` put into ``call``."""
    for entry in call.split(SEP):
        if entry.startswith(RECORD):
            return [k for k in entry[len(RECORD):].split(",") if k]
    return []


@contextlib.contextmanager
def recording(keys: list[str]) -> Iterator[dict[str, list]]:
    """A collector of its own for ``keys`` while a region's trace runs its layer: the layer's hooks append
    to it, not to the caller's. transformers' context variable behaves as a plain global while Dynamo
    compiles (``CompileableContextVar``): both are set aside and put back."""
    collected: dict[str, list] = {k: [] for k in keys}
    saved = (_active_collector.compiling, _active_collector.global_var)
    _active_collector.compiling, _active_collector.global_var = False, None
    token = _active_collector.context_var.set(collected if keys else None)
    try:
        yield collected
    finally:
        _active_collector.context_var.reset(token)
        _active_collector.compiling, _active_collector.global_var = saved


def append_recorded(key: str, outputs: tuple) -> None:
    """Put a region's recorded outputs ``outputs`` (write ``key``, ``RECORDED`` + the collector's key) into
    the caller's collector, as the hooks would have."""
    _collector()[key[len(RECORDED):]].extend(outputs)


def recorded_chunks_error(keys: list[str]) -> str:
    """A layer run in token chunks records once per chunk: the model would read each chunk's rows as a whole
    layer's (its auxiliary loss lines the router logits up with the attention mask by position)."""
    return (f"{', '.join(f'output_{k}' for k in keys)}=True with sequence_chunks > 1: each decoder layer runs in "
            f"token chunks and its {', '.join(keys)} would come per chunk, not per layer. Use sequence_chunks=1, or "
            "set the model's config output_router_logits=False (PorosSFTTrainer: SFTConfig(router_aux_loss_coef=0.0))")


def check_no_router_logits_with_chunks(config: object, chunks: int) -> None:
    """``recorded_chunks_error`` for a model whose config asks for its router logits, before anything is traced
    (a call that asks for them itself is refused when its region is traced)."""
    text = text_config(config)
    if chunks > 1 and getattr(text, "output_" + ROUTER_LOGITS, False):
        raise PorosConfigError(recorded_chunks_error([ROUTER_LOGITS]))


def install_recorders(model: nn.Module) -> int:
    """transformers' recording hooks on every model under ``model`` whose config has ``output_router_logits``
    (a mixture of experts with an auxiliary loss), now: transformers installs them at the first call that
    asks for an output, which under ``torch.compile`` breaks that call's graph (a hook registered while
    Dynamo traces) and makes the next call's graph another one. Returns how many models got them."""
    installed = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        text = text_config(config)
        if (ROUTER_LOGITS in (getattr(module, "_can_record_outputs", None) or {})
                and hasattr(text, "output_" + ROUTER_LOGITS)):
            maybe_install_capturing_hooks(module)
            installed += 1
    return installed
