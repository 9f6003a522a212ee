"""A region's MLP and linear projections a token chunk at a time, each chunk recomputed in its backward.

At long sequences a decoder layer's transient is its MLP's: gate, up, their product and the dropout
in front of the down projection are each ``tokens x intermediate`` (at seq 65536 and a 7B shape about
2.5 GB each), and the region's backward holds them all at once. Next come the adapters': each LoRA
projection saves its dropped-out input in the adapter's fp32 and the dropout's mask (5 bytes per input
feature and token; q, k, v and o together ~72 KB per token at a 7B shape). With ``sequence_chunks=K``
the region's trace calls the layer's MLP (``Family.mlp``, a module applied to each token on its own)
and every linear layer outside it on ``K`` slices of the sequence and concatenates the results; every
node of those calls is tagged ``MUST_RECOMPUTE`` before the min-cut partition, so the region saves
only those modules' inputs, and its backward (ordered as the autograd engine runs, ``reordering_to_mimic_autograd_engine``) recomputes one
chunk right before that chunk's gradient. A dropout inside a chunk is replayed from the random state
the partitioner saves for it (``run_and_save_rng_state`` / ``run_with_rng_state``).

Region forward, before (one MLP call on the whole sequence, ``s1`` tokens)::

    mm = aten.mm(view, t)                      # gate: [s1, intermediate]
    ...
    return (add_1, view, mm, mm_1, mul, ...)   # the backward reads the intermediates

After (``K = 2``; the backward recomputes ``mm``/``mm_1``/``mul`` of each half)::

    slice_1 = aten.slice(x, 1, 0, s1 // 2)
    mm = aten.mm(view(slice_1), t)             # tagged MUST_RECOMPUTE
    ...
    slice_2 = aten.slice(x, 1, s1 // 2, s1)
    ...
    cat = aten.cat([chunk_0, chunk_1], 1)
    return (add_1, x, ...)                     # the MLP's input only

Streamed and ``stream=False`` run the same region, so they stay equal bit for bit. Against the plain
eager loop the chunked matmuls are other kernel calls (and the adapter's weight gradients sum per
chunk): ``sequence_chunks=1`` (the default) is the setting that stays equal to it.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from .joint import is_tangent, reached_from
from .views import with_children

CHUNK = "poros_sequence_chunk"  # meta["custom"] key on the nodes of one chunk of one module's call (its label)
CHUNKS_ATTR = "_poros_sequence_chunks"  # on a prepared decoder layer: K (part of its region fingerprint)
MLP_ATTR = "_poros_mlp"  # on a prepared decoder layer: the attribute name of its MLP


class TokenChunks(nn.Module):
    """``inner`` applied to ``chunks`` slices of the token dimension (-2) of its one input, concatenated;
    chunk ``i``'s nodes are labelled ``first_label + i``. ``inner`` is held, not registered: the layer's
    parameter names stay as they are."""

    def __init__(self, inner: nn.Module, chunks: int, first_label: int = 0) -> None:
        super().__init__()
        self.__dict__["inner"] = inner
        self.chunks = chunks
        self.first_label = first_label

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        what = type(self.inner).__name__
        if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            raise TypeError(f"sequence_chunks: the layer calls {what} with more than one hidden-states tensor; only a "
                            "module applied token by token can run in chunks")
        tokens = hidden.shape[-2]
        outputs = []
        for i in range(self.chunks):
            start, stop = i * tokens // self.chunks, (i + 1) * tokens // self.chunks
            with fx_traceback.annotate({CHUNK: self.first_label + i}):
                # contiguous: a chunk of a batch of rows is a strided slice, and a module may view it flat
                # (Qwen3.5-MoE's experts block); at batch 1 it is contiguous already and nothing is copied
                out = self.inner(hidden[..., start:stop, :].contiguous())
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"sequence_chunks: {what} returned {type(out).__name__}, not one tensor; only a "
                                "module applied token by token can run in chunks")
            outputs.append(out)
        return torch.cat(outputs, dim=-2)


def chunked_layer(layer: nn.Module) -> nn.Module:
    """What a region traces for ``layer``: the layer itself, or (``sequence_chunks`` > 1) a shallow copy of
    it whose MLP and every linear projection outside it (attention's q/k/v/o and the like) run in token
    chunks. The copies share every parameter, buffer and submodule; the prepared model is not changed."""
    chunks = layer.__dict__.get(CHUNKS_ATTR, 1)
    if chunks <= 1:
        return layer
    return _with_chunks(layer, chunks, layer.__dict__[MLP_ATTR], itertools.count())


def _with_chunks(module: nn.Module, chunks: int, whole: str | None, wrapped: Iterator[int]) -> nn.Module:
    """``module``, or a shallow copy whose child ``whole`` and whose linear layers at any depth are
    ``TokenChunks`` (each numbered by ``wrapped``, so every chunk of the layer has a label of its own)."""
    def replace(name: str, child: nn.Module, depth: int) -> nn.Module | None:
        if (depth == 0 and name == whole) or is_linear(child):
            return TokenChunks(child, chunks, first_label=next(wrapped) * chunks)
        return None

    return with_children(module, replace)


def is_linear(module: nn.Module) -> bool:
    """A linear layer: ``nn.Linear`` (bitsandbytes' 4-bit one too), or an adapter around one (PEFT's LoRA
    layers hold it as ``base_layer``). It maps each token's features on their own."""
    return isinstance(getattr(module, "base_layer", module), nn.Linear)


def tag_recompute(joint: fx.GraphModule) -> int:
    """Mark the forward nodes of every chunk's MLP call ``MUST_RECOMPUTE`` (one checkpoint id per chunk)
    for the min-cut partitioner; returns how many it marked. A backward node can carry its forward
    node's annotation: only nodes that no tangent reaches are forward nodes."""
    backward = reached_from(joint, {n for n in joint.graph.find_nodes(op="placeholder") if is_tangent(n)})
    marked = 0
    for node in joint.graph.nodes:
        chunk = (node.meta.get("custom") or {}).get(CHUNK)
        if chunk is None or node in backward or node.op != "call_function":
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = chunk
        marked += 1
    return marked


def _sample_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def static_rng_states(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Give the random states the partitioner saves for a recomputed dropout (``run_and_save_rng_state``'s
    first output, the backward's ``rng_state_output_k``) the generator state's fixed size. The
    partitioner makes them from a real state under the trace's fake mode, which gives them sizes of
    new symbols under a symbolic trace; no input of the region holds those. Returns how many it set."""
    states = [n for n in fw.graph.find_nodes(op="call_function", target=operator.getitem)
              if n.args[1] == 0 and getattr(n.args[0], "target", None) is torch._prims.rng_prims.run_and_save_rng_state]
    placeholders = [p for p in bw.graph.find_nodes(op="placeholder") if p.name.startswith("rng_state_output_")]
    if len(states) != len(placeholders):
        raise AssertionError(f"{len(states)} saved random states in a region's forward, {len(placeholders)} read by its backward")
    for state, placeholder in zip(states, placeholders):
        op_input = next(a for a in state.args[0].args[1:] if isinstance(a, fx.Node))
        fake = op_input.meta["val"]
        value = fake.fake_mode.from_tensor(_sample_state(fake.device), static_shapes=True)
        state.meta["val"] = placeholder.meta["val"] = value
    return len(states)
