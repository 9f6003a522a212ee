"""The host side of a host store: the arena, the frozen tensors that are views of it, and their block layout.

``prepare`` moves every frozen tensor into one exact-size host arena (``arena.py``, page-locked when
the compute device is CUDA) and records each one as a ``HostEntry``: where it came from (so
``unprepare`` can put it back) and which blocks read it. ``HostTensors`` holds the arena, the entries
and the block layout they are loaded in.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from .arena import HostArena, nbytes


@dataclasses.dataclass(eq=False)
class HostEntry:
    """One frozen tensor in the store: its name, its host copy, its origin device and the blocks that read it."""

    name: str  # qualified name in the model, e.g. model.layers.0.self_attn.q_proj.weight
    host: torch.Tensor  # the host copy every load reads
    origin_device: torch.device  # where it lived before prepare
    blocks: tuple[int, ...]  # the blocks that read it (two for a tied embedding / lm_head)
    store_ref: "weakref.ref[Any]" = dataclasses.field(repr=False)  # the runtime.store.HostStore it belongs to
    # (weak: a compiled graph's schedule lists entries, and must not keep an unprepared model's store alive)
    members: tuple[torch.Tensor, ...] = ()  # a decoder layer's block: the host tensors its bytes span

    @property
    def store(self) -> Any:
        """The ``runtime.store.HostStore`` of this entry, or ``None`` once it is gone."""
        return self.store_ref()

    @property
    def spans(self) -> bool:
        """A layer's block (a view over other entries' bytes, not counted twice), not a tensor of its own."""
        return bool(self.members)

    @property
    def nbytes(self) -> int:
        return nbytes(self.host)  # the host tensor is a view of the arena


@dataclasses.dataclass(eq=False)
class HostTensors:
    """The arena of one prepared model, its entries (every frozen tensor, and each decoder layer's block
    spanning its tensors) and the blocks they are loaded in."""

    block_size: int  # decoder layers per block
    block_names: list[str]  # block index -> name ("embed", "layers.0", "layers.2-3", "head")
    entries: dict[int, HostEntry] = dataclasses.field(default_factory=dict)  # id(host) -> entry
    arena: HostArena | None = None  # the one host allocation every entry's tensor is a view of
    head_chunks: int = 1  # row chunks the lm_head weight is loaded in

    def block_bytes(self) -> list[int]:
        """Bytes of base weights each block loads (a tied tensor counts in each block that reads it; a
        layer loaded as one span of the arena counts that span, the alignment gaps between its tensors
        included)."""
        sizes = [0] * len(self.block_names)
        spanned = {id(t) for e in self.entries.values() if e.spans for t in e.members}
        for entry in self.entries.values():
            if id(entry.host) not in spanned:
                for b in entry.blocks:
                    sizes[b] += entry.nbytes
        return sizes

    def tensors(self) -> list[HostEntry]:
        """The entries of the frozen tensors themselves (not the layer blocks spanning them)."""
        return [e for e in self.entries.values() if not e.spans]

    def host_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors())

    def name_of(self, t: torch.Tensor) -> str:
        """The store's name for host tensor ``t`` (its shape when it is not an entry, e.g. a head chunk)."""
        entry = self.entries.get(id(t))
        return entry.name if entry is not None else f"a tensor of shape {tuple(t.shape)}"

    def moved_message(self, names: list[str]) -> str:
        """What to say when base tensors of the store are no longer in host memory (``model.to(device)``
        or ``model.cuda()`` after ``prepare`` moves every parameter, the frozen base included)."""
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"base tensors of this prepared model left the host store ({shown} are not in host memory): "
                "the model was moved (model.to(...) / model.cuda()) after poros_fx.prepare, which copies the whole "
                "frozen base to the device and defeats streaming. prepare already put the adapter and everything "
                "else on the compute device; do not move the model afterwards, or call poros_fx.unprepare(model) "
                "first and prepare it again where it is.")

    def pinned(self) -> bool:
        return self.arena is not None and self.arena.pinned

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the store holds (the arena's exact size; 0 for a CPU compute device)."""
        return self.arena.pinned_bytes if self.arena is not None else 0
