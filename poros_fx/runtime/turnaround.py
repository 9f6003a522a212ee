"""Turn-around: the copies one phase of a training step leaves on the device for the other.

A training forward's last blocks stay on the device for the backward, which starts with them
(``reused_by_backward``), and a backward's last blocks stay for the next forward
(``reused_by_forward``), so neither phase loads them again. The copies wait in the store's
``Residency`` (``copies_for_backward`` / ``copies_for_forward``), booked in the ledger once, until the
other phase takes them over (``take_stashed``) or they are given back (``_release``,
``Residency.drop_copies_for_forward``). ``Turnaround`` is the part of a ``GraphRuntime``
(``executor.py``) that leaves, takes and gives back these copies.
"""

from __future__ import annotations

from typing import Any

import torch

from .arena import nbytes


class Turnaround:
    """A graph's turn-around blocks: the forward blocks whose copies its backward takes over, the backward
    blocks whose copies the next forward takes over, and which layer blocks those are under the budget's
    plan (cached per plan)."""

    store: Any  # runtime.store.HostStore (GraphRuntime.store)
    phase: str

    def _init_turnaround(self, reused_by_backward: frozenset[int], reused_by_forward: frozenset[int]) -> None:
        # forward blocks whose copies stay for the backward, which starts with them (turn-around)
        self.reused_by_backward = reused_by_backward
        # backward blocks whose copies stay for the next forward, which starts with them (the other way round)
        self.reused_by_forward = reused_by_forward
        self._left: tuple[set[int], frozenset[int]] | None = None  # (the plan's kept hosts, _left_for_forward())

    def _turnaround_copies(self, key: tuple[int, ...]) -> list[torch.Tensor] | None:
        """The copies of the group at host addresses ``key`` that the other phase left for this one, taken
        out of the stash (``None``: none left)."""
        residency = self.store.residency
        stash = residency.copies_for_backward if self.phase == "backward" else residency.copies_for_forward
        return stash.pop(key, None) if stash else None

    def _take_stashed(self, loaded: torch.Tensor) -> bool:
        """Whether ``loaded`` is a copy the other phase left and booked: this phase takes it over (and books
        its evict), so its load is not booked again."""
        residency = self.store.residency
        if self.phase == "backward" and id(loaded) in residency.stashed_ids:
            residency.stashed_ids.discard(id(loaded))  # booked by the forward; the backward evicts it
            return True
        if self.phase == "forward" and id(loaded) in residency.forward_stashed_ids:
            residency.forward_stashed_ids.discard(id(loaded))  # booked by the backward; the forward evicts it
            return True
        return False

    def _stays_for_other_phase(self, loaded: torch.Tensor) -> bool:
        """Whether ``loaded`` stays on the device for the other phase, which books its evict."""
        residency = self.store.residency
        if self.phase == "forward" and id(loaded) in residency.stashed_ids:
            return True  # a turn-around copy: the backward takes it over (and evicts it)
        if self.phase == "backward" and id(loaded) in residency.forward_stashed_ids:
            return True  # one the next forward takes over
        return False

    def _leave_turnaround(self, key: tuple[int, ...], block: int, out: list[torch.Tensor]) -> None:
        """Keep ``out`` (block ``block``'s copies) for the other phase when it starts with this block."""
        store = self.store
        if self.phase == "forward" and block in self.reused_by_backward:
            self._release(store.residency.copies_for_backward.pop(key, ()))  # an earlier forward's, never taken
            store.residency.copies_for_backward[key] = out
            store.residency.stashed_ids.update(id(t) for t in out)
        elif self.phase == "backward" and block in self._left_for_forward() and not store.budget.measuring:
            store.residency.drop_copies_for_forward(key)  # an earlier backward's, never taken
            store.residency.copies_for_forward[key] = out
            store.residency.forward_stashed_ids.update(id(t) for t in out)

    def _left_for_forward(self) -> frozenset[int]:
        """The blocks this backward leaves for the next forward: the first ``len(reused_by_forward)`` layer
        blocks the memory budget does not keep. A kept block stays anyway, so the next streamed one takes its
        place: the forward's first window then holds as many blocks as without a plan, and starts with one
        copy fewer. Made again when the plan changes (``kept_hosts`` is then a new set)."""
        store = self.store
        if self._left is not None and self._left[0] is store.budget.kept_hosts:
            return self._left[1]
        count = len(self.reused_by_forward)
        kept = set(store.budget.plan.resident_blocks) if store.budget.kept_hosts and store.budget.plan is not None else set()
        streamed = [b for b in range(1, len(store.host.block_names) - 1) if store.host.block_names[b] not in kept]
        left = frozenset(streamed[:count])
        self._left = (store.budget.kept_hosts, left)
        return left

    def _drop_copies_for_backward(self) -> None:
        """Turn-around copies no backward took (another graph's, or an abandoned forward's): gone."""
        for tensors in self.store.residency.copies_for_backward.values():
            self._release(tensors)
        self.store.residency.copies_for_backward.clear()

    def _release(self, tensors: Any) -> None:
        for t in tensors:
            if id(t) in self.store.residency.stashed_ids:
                self.store.residency.stashed_ids.discard(id(t))
                self.store.residency.ledger.on_evict(nbytes(t))
