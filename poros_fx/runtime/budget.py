"""A memory budget: which blocks stay on the device for the whole run, so fewer bytes cross the link.

With ``memory_budget`` set, the first step runs fully streamed and measures its own peak (on CUDA
``torch.cuda.max_memory_allocated``, everything the process allocates; on the CPU the ledger's base
bytes). That is the streamed minimum: a budget below it raises ``PorosOOMError`` naming it. The rest,
``budget - streamed peak``, is spent on blocks that then stay resident: loaded once, never evicted
and never loaded again, so each one takes ``2 x its bytes`` off every later step. The plan keeps the
head first (the backward's first block), then layer blocks spread evenly over the layers
(``_fitting``): a kept block computes while the next streamed one copies, and under a budget on CUDA
both directions load two blocks ahead (``compiler/backend.py``, ``depth.py``) so that copy starts as
the kept block does.

What the step itself adds on top of what was allocated when it started (its *transient*: boundary
activations, of every micro-batch when they run block-major, the loaded blocks, gradients, logits)
is measured once, in that first step. With CUDA graphs (``runtime/cuda_graphs.py``) a step that replays
them counts their pool too, which the allocator's counters do not see while a graph writes it. What stays allocated between steps can grow after it: the
optimizer's state appears at the first ``optimizer.step()``, after the first step's backward. So every
later training forward checks ``allocated now (less the kept blocks) + transient + kept blocks``
against the budget before it runs, and gives kept blocks back until it fits, keeping what stays spread
over the layers; ``adjustments`` in the plan say when and why.

Resident blocks are still recomputed in the backward (only their loads are skipped): the graphs and
kernels do not change with the plan, so streamed == ``stream=False`` holds for every budget, and the
plan can change between steps without a recompile. Predicted peak = allocated between steps +
transient + resident bytes (each resident block's streamed copy is already inside the transient, so
this over-predicts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import PorosOOMError
from ..options import AUTO as AUTO_BUDGET
from ..units import decimal_bytes, parse_size  # noqa: F401  (parse_size: the budget's parser, also imported from here)
from .arena import nbytes
from .residency import cache_key


@dataclasses.dataclass
class ResidencyPlan:
    budget: int  # bytes
    streamed_peak: int  # measured in the first (fully streamed) step
    measured_on: str  # "cuda: max_memory_allocated" | "cpu: base bytes (ledger)"
    resident_blocks: list[str]  # block names that stay on the device
    resident_bytes: int
    streamed_bytes_per_step: int  # base bytes copied per pass pair (forward + backward) with the plan
    streamed_bytes_per_step_before: int  # ... without it
    transient: int = 0  # what the first step added to what was allocated when it started
    predicted_peak: int = 0  # allocated between steps (kept blocks aside) + transient + resident bytes
    adjustments: list[str] = dataclasses.field(default_factory=list)  # kept blocks given back later, and why
    measured_size: int = 0  # elements of the measured step's inputs (x micro-batches): longer steps re-measure
    last_peak: int = 0  # the last training step's measured peak (CUDA; the ledger's base bytes on the CPU)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False)
class BudgetState:
    """A prepared model's memory budget: what was asked for, the bytes it came to, the step measuring for
    it, and the plan made from that measurement (which blocks stay resident)."""

    memory_budget: int | None = None  # bytes the step may use on the device; None: stream all
    request: int | str | None = None  # what was asked for ("24GB", "auto"): a new request plans anew
    source: str | None = None  # how "auto" became memory_budget (resolve_budget)
    measuring: bool = False  # the training step in flight (fully streamed) is measuring its peak for the plan
    start_allocated: int = 0  # bytes allocated when the step in flight started, less its loads'
    measuring_size: int = 0  # input elements of the step being measured
    start_captures: int = 0  # CUDA graphs captured when the step in flight started (runtime/cuda_graphs.py)
    notes: list[str] = dataclasses.field(default_factory=list)  # the plan's history across re-measurements
    plan: ResidencyPlan | None = None  # made after the measuring step when there is a budget
    kept_hosts: set[int] = dataclasses.field(default_factory=set)  # ids of host tensors the plan keeps resident


AUTO_MARGIN_FRACTION = 20  # "auto" leaves 1/20 of the device's memory (at least AUTO_MARGIN_MIN) unused
AUTO_MARGIN_MIN = 1 << 30


def resolve_budget(value: int | str | None, device: torch.device) -> tuple[int | None, str | None]:
    """A ``memory_budget`` as bytes, and for ``"auto"`` how it was found: on CUDA what the device has free
    now plus what torch's allocator already holds there, less a margin (1/20 of the device, at least
    1 GiB: fragmentation, other libraries' workspaces); on the CPU no budget (a budget plans device memory,
    and the CPU's is the host's)."""
    if value != AUTO_BUDGET:
        return parse_size(value), None
    if device.type != "cuda":
        return None, f"memory_budget 'auto' on {device}: no budget (every block streams every step)"
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    margin = max(AUTO_MARGIN_MIN, total // AUTO_MARGIN_FRACTION)
    budget = max(free + held - margin, 1)
    return budget, (f"auto: {decimal_bytes(free)} free on {device} + {decimal_bytes(held)} held by torch, "
                    f"less a margin of {decimal_bytes(margin)}")


def plan(store: Any, budget: int, streamed_peak: int, measured_on: str, transient: int | None = None) -> ResidencyPlan:
    """The blocks of ``store`` that stay resident under ``budget`` (see the module docstring)."""
    if budget < streamed_peak:
        raise PorosOOMError(f"memory_budget {decimal_bytes(budget)} is below what the fully streamed step needs: its first step "
                            f"peaked at {decimal_bytes(streamed_peak)} ({measured_on}); the smallest budget that works is "
                            f"{streamed_peak} bytes ({decimal_bytes(streamed_peak)}), or stream with a smaller block_size / prefetch")
    sizes = store.host.block_bytes()
    keep = _fitting(sizes, budget - streamed_peak)
    kept = sum(sizes[i] for i in keep)
    before = _streamed_bytes(sizes)
    return ResidencyPlan(budget=budget, streamed_peak=streamed_peak, measured_on=measured_on,
                         resident_blocks=[store.host.block_names[i] for i in sorted(keep)], resident_bytes=kept,
                         streamed_bytes_per_step=before - 2 * kept, streamed_bytes_per_step_before=before,
                         transient=streamed_peak if transient is None else transient,
                         predicted_peak=streamed_peak + kept)


def _streamed_bytes(sizes: list[int]) -> int:
    # every block that loads base bytes loads them twice per pass pair (forward, recompute); a gathering
    # embedding loads none (its rows come from the host store)
    return 2 * sum(sizes)


def _fitting(sizes: list[int], room: int) -> list[int]:
    """Blocks kept in ``room`` bytes: the last block first (the head: the backward's first block), then
    layer blocks spread evenly over the layers. A load waits for the compute stream to reach it (one or
    two blocks ahead, ``copies.py``), so a run of kept blocks leaves the copy stream idle while it
    computes; a kept block between streamed ones computes while the next streamed block copies. 72B
    under 24 GB (H200, one call): the last 36 of 80 layers kept, 1.187 s a step; 35 spread, 1.032 s
    (``docs/bench/h200_budget_spread``)."""
    loaded = [i for i, n in enumerate(sizes) if n]
    keep: list[int] = []
    if loaded and sizes[loaded[-1]] <= room:
        keep.append(loaded[-1])
        room -= sizes[loaded[-1]]
    layers = loaded[:-1]
    count = len(layers)
    while count > 0:  # the most evenly spread blocks that fit (fewer when blocks differ in size)
        chosen = _spread(layers, count)
        if sum(sizes[i] for i in chosen) <= room:
            break
        count -= 1
    chosen = _spread(layers, count) if count > 0 else []
    room -= sum(sizes[i] for i in chosen)
    keep += chosen
    for i in reversed(layers):  # what room is left (blocks of unequal size), from the last layer back
        if i not in chosen and sizes[i] <= room:
            keep.append(i)
            room -= sizes[i]
    return keep


def _spread(blocks: list[int], count: int) -> list[int]:
    """``count`` of ``blocks`` evenly spaced, the last of them always among them: 3 of 8 -> 2, 5, 7."""
    step = len(blocks) / count
    return [blocks[len(blocks) - 1 - int(j * step)] for j in range(count)][::-1]


def estimate(sizes: list[int], names: list[str], budget: int, streamed_peak: int) -> tuple[list[str], int, int]:
    """For ``poros-fx check``: (blocks kept, bytes kept, base bytes copied per pass pair) for a budget and
    an estimated streamed peak, by the rule ``plan`` applies to the measured one."""
    keep = _fitting(sizes, budget - streamed_peak) if budget >= streamed_peak else []
    kept = sum(sizes[i] for i in keep)
    return [names[i] for i in sorted(keep)], kept, _streamed_bytes(sizes) - 2 * kept


def describe(store: Any) -> str:
    """The budget and, after the first step, its plan, in one line (``poros_fx.report``, the dumps)."""
    if store.budget.memory_budget is None:
        return store.budget.source or "no budget: every block streams every step"
    source = f" ({store.budget.source})" if store.budget.source else ""
    p = store.budget.plan
    if p is None:
        return f"budget {decimal_bytes(store.budget.memory_budget)}{source}: planned after the first (fully streamed) step"
    kept = ", ".join(p.resident_blocks) or "none"
    return (f"budget {decimal_bytes(p.budget)}{source}: streamed peak {decimal_bytes(p.streamed_peak)} (the first step's, measured), resident "
            f"{kept} ({decimal_bytes(p.resident_bytes)}), predicted peak {decimal_bytes(p.predicted_peak)}, base copied per forward + "
            f"backward {decimal_bytes(p.streamed_bytes_per_step)} (was {decimal_bytes(p.streamed_bytes_per_step_before)}; once per "
            "micro-batch, or once per optimizer step when its micro-batches run block-major)"
            + "".join(f"; {note}" for note in p.adjustments))


def redump(store: Any) -> None:
    """Rewrite the dumped schedule of every graph of ``store`` that dumps: it shows the plan."""
    for schedule in list(store.schedules):
        if getattr(schedule, "dumper", None) is not None:
            schedule.dumper.schedule(schedule)


def resident_hosts(store: Any, plan: ResidencyPlan) -> set[int]:
    """ids of the host tensors the plan keeps: every entry read by a resident block (a layer's span and
    its member tensors alike)."""
    keep = {store.host.block_names.index(name) for name in plan.resident_blocks}
    return {id(e.host) for e in store.host.entries.values() if e.blocks and set(e.blocks) <= keep}


def _allocated(store: Any) -> int:
    """What counts against the budget now: CUDA's allocated bytes; on the CPU the ledger's base bytes."""
    if store.device.type == "cuda":
        return torch.cuda.memory_allocated(store.device)
    return store.residency.ledger.resident_bytes


def _load_window(store: Any) -> int:
    """Device bytes allocated between steps that belong to the steps' loads, which a step's transient holds:
    the copies the last backward left for the next forward, and the CUDA graphs' load slots
    (``load_slots.py``) they may lie in. Not part of what stays allocated between steps."""
    graphs = store.residency.region_graphs if store.device.type == "cuda" else None  # off CUDA the ledger counts, no slots
    if graphs is None:
        return store.residency.copies_for_forward_bytes()
    return graphs.load_slots.nbytes() + store.residency.copies_for_forward_bytes(unless=graphs.load_slots.holds)


def measures_next(store: Any, size: int) -> bool:
    """Whether the next training forward, on inputs of ``size`` elements, measures a new plan
    (``start_measuring``): the first step under a budget, or one larger than the plan was measured on."""
    if store.budget.memory_budget is None or store.budget.measuring:
        return False
    return store.budget.plan is None or size > store.budget.plan.measured_size


def before_training_forward(store: Any, size: int) -> None:
    """Before a streamed training forward whose inputs hold ``size`` elements (times the micro-batches run
    together): a step that measures a new plan starts without the copies the last backward left for it,
    then ``start_measuring``."""
    if measures_next(store, size):  # a measuring step starts with nothing of the last one
        store.residency.drop_copies_for_forward()
    start_measuring(store, size)


def start_measuring(store: Any, size: int) -> None:
    """Before a training forward of a store with a budget, whose inputs hold ``size`` elements (times
    the micro-batches run together). The first one, and one larger than any measured before (a longer
    sequence: more activations than the plan was made for), runs fully streamed and measures its peak
    (CUDA's peak counter is the process's; this resets it): kept blocks are given back first. A later one
    checks the plan against what is allocated now (``fit``) and starts measuring its own peak."""
    if store.budget.memory_budget is None or store.budget.measuring:
        return
    p = store.budget.plan
    if p is not None and size > p.measured_size:
        notes = p.adjustments + [f"at forward run {store.residency.ledger.forward_runs + 1}: a step of {size} input elements, "
                                 f"more than the {p.measured_size} the plan was measured on: its kept blocks were "
                                 "given back and the step measured fully streamed"]
        store.forget_plan()
        store.budget.notes = notes
        p = None
    if p is not None:
        # the peak since the last forward started also covers its backward's end and the optimizer step
        # after it, which the check after the backward did not see (the copies that backward left for this
        # forward are on the device through it); the same counter, so only what rose above the peak that
        # check saw, and above the budget, is new
        peak, _ = _step_peak(store)
        _give_back_over(store, peak - max(p.last_peak, p.budget), peak,
                        f"before forward run {store.residency.ledger.forward_runs + 1}: the last step with the optimizer step after it")
        fit(store)
    else:
        store.budget.measuring = True
        store.budget.measuring_size = size
    store.budget.start_allocated = _allocated(store) - _load_window(store)
    store.residency.ledger.start_step()
    if store.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(store.device)
    store.budget.start_captures = store.residency.region_graphs.counters.captures if store.residency.region_graphs is not None else 0


def _step_peak(store: Any) -> tuple[int, str]:
    """The peak since the training forward in flight (or last) started, and how it was measured."""
    if store.device.type != "cuda":
        return store.residency.ledger.step_peak, "cpu: base bytes on the device (ledger)"
    peak, how = torch.cuda.max_memory_allocated(store.device), "cuda: max_memory_allocated over the step"
    graphs = store.residency.region_graphs
    if graphs is not None and graphs.counters.captures == store.budget.start_captures:
        # replayed CUDA graphs write their pool, which the allocator's counters do not see (a step that
        # recorded allocated its pool's tensors like any other, and max_memory_allocated saw them)
        peak += graphs.pool_bytes()
        how += " + the CUDA graphs' pool"
    return peak, how


def measure_and_plan(store: Any) -> None:
    """After a training step of a store with a budget: a measuring step makes the plan from its peak; a
    step that ran with a plan and peaked above the budget gives kept blocks back for the next one."""
    if store.budget.memory_budget is None:
        return
    peak, how = _step_peak(store)
    if store.budget.measuring and store.budget.request == AUTO_BUDGET and store.budget.memory_budget < peak:
        # "auto" never refuses a step that ran: it keeps nothing and says so
        store.budget.source = (f"{store.budget.source}; {decimal_bytes(store.budget.memory_budget)} is below the streamed "
                               f"step's measured peak, so nothing is kept")
        store.budget.memory_budget = peak
    if store.budget.measuring:
        store.budget.plan = plan(store, store.budget.memory_budget, peak, how, transient=peak - store.budget.start_allocated)
        store.budget.plan.measured_size = store.budget.measuring_size
        store.budget.plan.adjustments = store.budget.notes + store.budget.plan.adjustments
        store.budget.notes = []
        store.budget.kept_hosts = resident_hosts(store, store.budget.plan)
        store.budget.measuring = False
        store.budget.plan.last_peak = peak
        redump(store)
        return
    if store.budget.plan is None:
        return
    store.budget.plan.last_peak = peak
    _give_back_over(store, peak - store.budget.plan.budget, peak, f"after forward run {store.residency.ledger.forward_runs}: the step")


def _give_back_over(store: Any, over: int, peak: int, what: str) -> None:
    """A step that peaked at ``peak``, ``over`` bytes above the plan's budget (nothing when ``over <= 0``):
    the next step gets that much back (``_keep_within``)."""
    p = store.budget.plan
    if over <= 0:
        return
    before = p.resident_bytes
    given = _keep_within(store, p, p.resident_bytes - over)
    p.transient += before - p.resident_bytes  # the measured step needed that much more than the plan said
    p.adjustments.append(f"{what} peaked at {decimal_bytes(peak)}, above the budget; gave back {len(given)} kept "
                         f"block(s){_listed(given)}")
    redump(store)


def fit(store: Any) -> None:
    """Before a training forward with a plan: if what stays allocated between steps grew since the plan
    (the optimizer's state, the user's tensors), give kept blocks back (``_keep_within``) until
    ``allocated - kept + transient + kept`` fits the budget; ``PorosOOMError`` if nothing kept is left
    to give and it still does not."""
    p = store.budget.plan
    resident = sum(nbytes(t) for t in store.residency.resident_cache.values() if id(t) in store.residency.kept_ids)
    baseline = _allocated(store) - resident - _load_window(store)
    p.predicted_peak = baseline + p.transient + p.resident_bytes
    if p.predicted_peak <= p.budget:
        return
    given = _keep_within(store, p, p.budget - baseline - p.transient)
    p.predicted_peak = baseline + p.transient + p.resident_bytes
    if p.predicted_peak > p.budget and store.budget.request == AUTO_BUDGET:
        p.adjustments.append(f"after forward run {store.residency.ledger.forward_runs}: {decimal_bytes(baseline)} stays allocated "
                             f"between steps; nothing is kept and the budget 'auto' follows the step "
                             f"({decimal_bytes(p.predicted_peak)})")
        p.budget = store.budget.memory_budget = p.predicted_peak
    if p.predicted_peak > p.budget:
        smallest = baseline + p.transient
        raise PorosOOMError(f"memory_budget {decimal_bytes(p.budget)} no longer holds the streamed step: {decimal_bytes(baseline)} stays "
                            f"allocated between steps now (the optimizer's state, tensors of your own) and the step "
                            f"adds {decimal_bytes(p.transient)}; the smallest budget that works now is {smallest} bytes "
                            f"({decimal_bytes(smallest)})")
    if given:
        p.adjustments.append(f"after forward run {store.residency.ledger.forward_runs}: {decimal_bytes(baseline)} stays allocated between "
                             f"steps (was {decimal_bytes(store.budget.start_allocated)} when the first step started: optimizer state?); "
                             f"gave back {len(given)} kept block(s){_listed(given)}")
        redump(store)


def _keep_within(store: Any, p: ResidencyPlan, room: int) -> list[str]:
    """Keep of the plan's kept blocks what fits in ``room`` bytes, chosen by the plan's own rule among them
    (``_fitting``: the head, then spread evenly), so the blocks given back are spread over the layers too:
    giving back the earliest left a run of streamed layers whose copies the compute could not hide (72B
    under 24 GB gave back layers.2..8 after the first step). Returns the names given back."""
    sizes = store.host.block_bytes()
    kept = {store.host.block_names.index(name) for name in p.resident_blocks}
    among = [n if i in kept else 0 for i, n in enumerate(sizes)]
    keep = set(_fitting(among, room)) if room > 0 else set()
    given = [name for name in p.resident_blocks if store.host.block_names.index(name) not in keep]
    for name in given:
        _release_block(store, store.host.block_names.index(name))
    p.resident_blocks = [name for name in p.resident_blocks if store.host.block_names.index(name) in keep]
    resident = sum(sizes[i] for i in keep)
    p.streamed_bytes_per_step += 2 * (p.resident_bytes - resident)
    p.resident_bytes = resident
    store.budget.kept_hosts = resident_hosts(store, p)
    return given


def _listed(names: list[str], shown: int = 6) -> str:
    """`` (a, b, c)`` for an adjustment's note; the first ``shown`` and a count past them."""
    if not names:
        return " (none left to give)"
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return f" ({', '.join(names[:shown])}{more})"


def _release_block(store: Any, index: int) -> None:
    """Drop the kept device copies of block ``index`` (the next step streams it again)."""
    for entry in store.host.entries.values():
        if entry.blocks and index in entry.blocks:
            tensor = store.residency.resident_cache.pop(cache_key(entry.host), None)
            booked = store.residency.kept_ids.pop(id(tensor), None) if tensor is not None else None
            if booked:
                store.residency.ledger.on_evict(nbytes(tensor))

