"""Block-major accumulation: the N micro-batches of an optimizer step go through each block together.

Micro-batch-major accumulation runs forward and backward of micro-batch 0, then of micro-batch 1,
..., so every micro-batch copies the whole base twice. Block-major loads each block once per
optimizer step for the forward and once for the backward, and runs every micro-batch through it
while it is on the device: the copies per optimizer step do not grow with N.

The user's code does not change: it still calls the compiled model and ``loss.backward()`` once per
micro-batch, in order (``@poros_fx.step(accumulate=N)``, ``PorosTrainer`` with
``gradient_accumulation_steps``, ``poros-fx train --accumulate``, or a loop inside
``with poros_fx.block_major(model, micro_batches):``). Knowing the step's micro-batches, this
module turns those calls around:

* **Forward.** At micro-batch 0's forward, the compiled forward graph's inputs for every other
  micro-batch are found: a graph input that is a tensor of ``micro_batches[0]`` (by identity) is
  the tensor at the same place in ``micro_batches[i]``; model tensors (parameters, buffers, the host
  store) are the same for all. The graph then runs once for all N (``runtime/lockstep.py``), and
  micro-batch ``i``'s forward call gets its outputs, after a check that it was called with exactly
  the inputs the speculation used.
* **Random numbers.** Micro-batch ``i`` must draw the dropout masks it draws in micro-batch order,
  where its forward starts from the state micro-batch ``i - 1``'s forward left. Those states are
  found first by replaying the graph's draws (``runtime/draws.py``) N times; each micro-batch then
  runs on its own state, and the states its forward ends with must equal the replayed ones (else
  ``PorosExactnessError``, before anything is returned). Between the forward calls the generator is
  kept where micro-batch order has it, and drawing in between (user code) raises.
* **Backward.** The first N-1 backward calls keep their inputs (saved tensors, gradients of the
  outputs) and return no gradients; the N-th runs the backward graph for all N, summing each
  parameter's gradients in the order the backwards were called, starting from the ``.grad`` the
  parameter had, so that ``.grad`` ends with the bits autograd's accumulation gives micro-batch by
  micro-batch. ``.grad`` holds the sum once the last micro-batch's backward has run (not before).

Whatever cannot be taken this way (micro-batches of different shapes, a graph input found neither in
the model nor in the micro-batch, a step split into several graphs, an input that needs its own
gradient) runs micro-batch-major, exactly as without block-major, with a warning that says why. Once
outputs have been handed out, a call that breaks the speculation raises ``PorosExactnessError``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import PorosConfigError, PorosExactnessError
from ..handles import get_store, unwrap
from . import draws as draws_mod
from .lengths import mark_dynamic
from .rng import Generators

logger = logging.getLogger("poros_fx")

Path = tuple[Any, ...]
FALLBACK_ADVICE = ("it runs micro-batch-major (exact, but every micro-batch copies the base); "
                   "options={'block_major': False} silences this")


def tensor_paths(batch: Any, prefix: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a micro-batch (nested mappings, lists and tuples)."""
    if isinstance(batch, torch.Tensor):
        yield prefix, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from tensor_paths(value, (*prefix, key))
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from tensor_paths(value, (*prefix, i))


def at_path(batch: Any, path: Path) -> Any:
    for key in path:
        batch = batch[key]
    return batch


def _show_path(path: Path) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)


def _same_input(given: Any, expected: Any) -> bool:
    """The very tensor the outputs were computed from; a size (an int the graph takes) by value: Python
    makes a new int object for each length above 256."""
    if isinstance(given, torch.Tensor) or isinstance(expected, torch.Tensor):
        return given is expected
    return type(given) is type(expected) and given == expected


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad


class BlockMajorStep:
    """One optimizer step's micro-batches, run block-major through ``store``'s graphs (module docstring).

    ``shared``: objects every micro-batch's model call passes as they are, besides the model's own
    tensors (the Trainer's ``num_items_in_batch``)."""

    def __init__(self, model: torch.nn.Module, store: Any, micro_batches: Sequence[Any], shared: Sequence[Any] = ()) -> None:
        self.model = model
        self.store = store
        self.micro_batches = list(micro_batches)
        self.n = len(self.micro_batches)
        self.shared_extra = [x for x in shared if isinstance(x, torch.Tensor)]
        self.off: str | None = None  # why this step runs micro-batch-major
        self.forward_graph: Any = None  # the forward GraphRuntime the step's outputs came from
        self.expected: list[list[Any]] = []  # each micro-batch's forward inputs
        self.per_micro_batch: frozenset[int] = frozenset()  # forward input positions that differ between them
        self.paths: dict[int, Path] = {}  # those positions -> where they are in a micro-batch
        self.versions: list[dict[int, int]] = []  # their version counters when the outputs were computed
        self.outputs: list[Any] = []
        self.forwards_handed_out = 0  # micro-batches whose forward outputs were handed to the caller
        self.states: list[tuple[torch.Tensor, ...]] = []  # generator states before micro-batch i's forward
        self.generators: Generators | None = None
        self.drawing_generators: tuple[int, ...] = ()  # generators the forward draws from
        self.pending: list[list[Any]] = []  # backward inputs kept until the N-th backward
        self.backward_done = False

    # -- the runtime's entry -------------------------------------------------------------------------

    def call(self, runtime: Any, compiled: Callable, args: list) -> Any:
        """Run ``compiled`` (a forward or backward graph of ``runtime``) for this call, block-major
        where it can."""
        if runtime.phase == "forward":
            return self._forward(runtime, compiled, args)
        return self._backward(runtime, compiled, args)

    @property
    def finished(self) -> bool:
        """Every micro-batch's forward was handed out and the summed backward has run (or the step runs
        micro-batch-major)."""
        return self.off is not None or (self.forwards_handed_out >= self.n and self.backward_done)

    def close(self) -> None:
        """End the step: drop what it kept. A backward still waiting for the others (some micro-batches'
        backward never ran) would lose its gradients: raise."""
        waiting, self.pending, self.outputs, self.expected = len(self.pending), [], [], []
        if waiting and not self.backward_done:
            raise PorosExactnessError(
                f"block-major accumulation: the backward ran for {waiting} of the step's {self.n} micro-batches; "
                "their gradients are summed only when all have run, so they were not applied. Call backward for "
                "every micro-batch of the step, or run with options={'block_major': False}")

    # -- forward -------------------------------------------------------------------------------------

    def _forward(self, runtime: Any, compiled: Callable, args: list) -> Any:
        size = runtime.input_elements(args)
        if self.off is not None or (self.forward_graph is not None and self.forwards_handed_out >= self.n):
            return runtime.execute(lambda: compiled(args), size=size)
        if self.forward_graph is None:
            reason = self._speculate(runtime, args)
            if reason is not None:
                self._fall_back(reason)
                return runtime.execute(lambda: compiled(args), size=size)
            if self.n < 2:  # nothing to run together
                self.off = "one micro-batch"
                return runtime.execute(lambda: compiled(args), size=size)
            self.forward_graph = runtime
            self.outputs = runtime.execute(lambda: self._run_forward(runtime), runs=self.n, size=size)
            return self._serve(args, check_rng=False)
        if runtime is not self.forward_graph:
            raise PorosExactnessError(
                f"block-major accumulation: micro-batch {self.forwards_handed_out}'s forward ran another compiled "
                "graph than micro-batch 0's (its inputs differ in shape, or in a Python value the graph was "
                "specialized on), but its outputs were already computed with micro-batch 0's graph. Give every "
                "micro-batch of a step the same shapes and arguments, or run with options={'block_major': False}")
        return self._serve(args, check_rng=True)

    def _speculate(self, runtime: Any, args: list) -> str | None:
        """Every micro-batch's inputs for ``runtime``'s graph from micro-batch 0's (``self.expected``),
        or why they cannot be found."""
        schedule = runtime.schedule
        names = [b.name for b in schedule.blocks]
        if schedule.layers_from_loads or "embed" not in names or "head" not in names:
            return "the step is split into several graphs (a graph break inside the model)"
        refusal = runtime.lockstep_refusal()
        if refusal is not None:
            return refusal
        hooked = gradient_hooks(self.model)
        if hooked:
            return (f"{hooked[0]} has a gradient hook (register_hook / register_post_accumulate_grad_hook), which "
                    "sees one micro-batch's gradient at a time in micro-batch order, and only their sum here")
        first_batch_paths = {id(t): path for path, t in tensor_paths(self.micro_batches[0])}
        known = self._model_tensors()
        per: dict[int, Path] = {}
        sizes = runtime.size_inputs()
        for position, value in enumerate(args):
            if position in sizes:
                continue  # a tensor size of the graph: the same for micro-batches of one shape (checked below)
            if not isinstance(value, torch.Tensor):
                return f"graph input {position} is {type(value).__name__} {value!r}, not a tensor"
            if id(value) in known:
                continue
            path = first_batch_paths.get(id(value))
            if path is None:
                return (f"graph input {position} (a {value.dtype} tensor of shape {tuple(value.shape)}) is neither a "
                        "tensor of the model nor a tensor of micro_batches[0]: pass the micro-batches' tensors to "
                        "the model as they are (move them to the device before the step, not inside it)")
            if value.requires_grad:
                return f"{_show_path(path)} requires grad (each micro-batch would need its own input gradient)"
            per[position] = path
        lists = [list(args)]
        for i, batch in enumerate(self.micro_batches[1:], start=1):
            row = list(args)
            for position, path in per.items():
                try:
                    value = at_path(batch, path)
                except (KeyError, IndexError, TypeError):
                    return f"micro-batch {i} has no {_show_path(path)}"
                if not isinstance(value, torch.Tensor) or _meta(value) != _meta(args[position]):
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    return (f"micro-batch {i}'s {_show_path(path)} is {got} where micro-batch 0's is "
                            f"{tuple(args[position].shape)} {args[position].dtype}: micro-batches of different "
                            "shapes run micro-batch-major (pad them to one length for block-major)")
                row[position] = value
            lists.append(row)
        self.expected = lists
        self.paths = per
        self.per_micro_batch = frozenset(per)
        # an in-place edit of a later micro-batch before its forward call would not reach the outputs
        # computed now: its tensors' version counters are checked when each is handed out
        self.versions = [{p: row[p]._version for p in per} for row in lists]
        return None

    def _model_tensors(self) -> set[int]:
        found = {id(t) for t in self.model.parameters()} | {id(t) for t in self.model.buffers()}
        found |= {id(e.host) for e in self.store.host.entries.values()}
        found |= {id(t) for t in self.shared_extra}
        return found

    def _fall_back(self, reason: str) -> None:
        """Run this step micro-batch-major, and say why (a warning once per model, the log after that)."""
        self.off = reason
        message = f"poros block-major accumulation is off for this step: {reason}; {FALLBACK_ADVICE}"
        if self.store.residency.block_major_warned:
            logger.info("%s", message)
        else:
            self.store.residency.block_major_warned = True
            warnings.warn(message + " (warned once per prepared model)", stacklevel=4)

    def _run_forward(self, runtime: Any) -> list:
        """The forward graph for every micro-batch at once, each on the generator state micro-batch order
        gives it (found by replaying the graph's draws, checked against what it drew)."""
        lockstep, devices = runtime.lockstep_plan(self.per_micro_batch)
        step_draws = runtime.draws_at(self.expected[0])
        generators = Generators(devices)
        start = generators.get()
        states = [start]
        for _ in range(self.n):
            draws_mod.replay(step_draws)
            states.append(generators.get())
        current = list(states[:-1])

        def switch(i: int) -> None:
            generators.set(current[i])

        def switched(i: int) -> None:
            current[i] = generators.get()

        try:
            outputs = lockstep.run([list(a) for a in self.expected], switch=switch, switched=switched)
        except BaseException:
            generators.set(start)
            raise
        wrong = [i for i in range(self.n) if not Generators.same(current[i], states[i + 1])]
        if wrong:
            generators.set(start)
            raise PorosExactnessError(
                f"block-major accumulation could not reproduce micro-batch order's random numbers for graph "
                f"{runtime.schedule.graph_id}: micro-batch {wrong[0]}'s forward drew differently from the replay of "
                f"its draws ({len(step_draws)} generator calls). Run with options={{'block_major': False}} (and please "
                "report the model)")
        self.states, self.generators = states, generators
        self.store.residency.ledger.block_major_steps += 1
        self.store.residency.ledger.block_major_micro_batches += self.n
        self.drawing_generators = tuple(k for k in range(len(devices))
                                        if not all(torch.equal(s[k], start[k]) for s in states))
        return outputs

    def _serve(self, args: list, check_rng: bool) -> Any:
        i = self.forwards_handed_out
        expected = self.expected[i]
        if len(args) != len(expected) or any(not _same_input(a, b) for a, b in zip(args, expected)):
            position = next((p for p, (a, b) in enumerate(zip(args, expected)) if not _same_input(a, b)), len(args))
            raise PorosExactnessError(
                f"block-major accumulation: micro-batch {i}'s forward got other inputs than micro_batches[{i}] "
                f"holds (graph input {position} differs), but its outputs were computed from micro_batches[{i}]. "
                "Call the model with each micro-batch's tensors as they are, in order, once per micro-batch, "
                "or run with options={'block_major': False}")
        changed = [p for p, version in self.versions[i].items() if expected[p]._version != version]
        if changed:
            path = _show_path(self.paths[changed[0]])
            raise PorosExactnessError(
                f"block-major accumulation: micro-batch {i}'s {path} was changed in place after micro-batch 0's "
                f"forward, which already computed micro-batch {i}'s outputs from it as it was. Edit every micro-batch "
                "before the step starts (or give the model a new tensor instead of editing one), or run with "
                "options={'block_major': False}")
        generators = self.generators
        if check_rng and self.drawing_generators:
            now = generators.get()
            if any(not torch.equal(now[k], self.states[i][k]) for k in self.drawing_generators):
                raise PorosExactnessError(
                    f"block-major accumulation: random numbers were drawn between micro-batch {i - 1}'s forward and "
                    f"micro-batch {i}'s; micro-batch order would give micro-batch {i} other dropout masks than the "
                    "ones it drew at micro-batch 0's forward. Draw them before the step or after it, or run "
                    "with options={'block_major': False}")
        if self.drawing_generators:
            after = generators.get()
            generators.set(tuple(self.states[i + 1][k] if k in self.drawing_generators else after[k]
                                 for k in range(len(after))))
        out, self.outputs[i] = self.outputs[i], None
        self.forwards_handed_out += 1
        args.clear()
        return out

    # -- backward ------------------------------------------------------------------------------------

    def _backward(self, runtime: Any, compiled: Callable, args: list) -> Any:
        this_step = (self.off is None and self.forward_graph is not None and not self.backward_done
                and runtime.schedule is self.forward_graph.schedule)
        if not this_step:
            return runtime.execute(lambda: compiled(args))
        if not self.pending:
            reason = runtime.lockstep_refusal()
            if reason is not None:  # the forwards ran block-major; their backwards run one by one
                self.backward_done = True
                warnings.warn(f"poros block-major accumulation: the backward runs micro-batch by micro-batch: {reason}",
                              stacklevel=4)
                return runtime.execute(lambda: compiled(args))
        self.pending.append(list(args))
        args.clear()
        if len(self.pending) < self.n:
            return (None,) * runtime.num_outputs
        pending, self.pending = self.pending, []
        self.backward_done = True
        return runtime.execute(lambda: self._run_backward(runtime, pending), runs=len(pending))

    def _run_backward(self, runtime: Any, pending: list[list[Any]]) -> tuple:
        """The backward graph for every kept call, each parameter's gradients summed in call order,
        starting from its ``.grad``, which is then cleared so that autograd stores the sum."""
        first = pending[0]
        per = frozenset(p for p in range(len(first)) if any(row[p] is not first[p] for row in pending[1:]))
        lockstep = runtime.backward_plan(per)
        inputs = self.expected[0]  # the forward's inputs: output p is the gradient of input p
        initial: list[Any] = [None] * len(lockstep.outputs)
        taken = []
        for p in range(len(initial)):
            if p < len(inputs) and isinstance(inputs[p], torch.Tensor) and inputs[p].grad is not None:
                initial[p] = inputs[p].grad
                taken.append(inputs[p])
        sums = lockstep.run(pending, initial=initial)
        for t in taken:
            t.grad = None
        return tuple(sums)


def gradient_hooks(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s trainable parameters with a gradient hook."""
    return [name for name, p in model.named_parameters() if p.requires_grad
            and (getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))]


def runs_block_major(model: torch.nn.Module, micro_batches: Sequence[Any], *, stream: bool = True,
                     block_major_option: bool | None = None, data_parallel: bool = False) -> bool:
    """The one place that decides whether an optimizer step's micro-batches run block-major, for
    ``@poros_fx.step``, ``PorosTrainer`` and ``poros-fx train`` alike. They do with two or more
    micro-batches of a streamed, prepared model, unless ``block_major_option`` (the compile option;
    ``None``: ``prepare``'s ``block_major``) turns it off; under ``DistributedDataParallel``
    (``data_parallel``) they do not, with a warning once per model (its forward hands the graph other
    tensors than the micro-batch's, and its gradient all-reduce runs per backward). Whatever a step
    meets later that micro-batch order would do differently (a gradient hook, random numbers inside a
    ``torch.cond`` branch, micro-batches of different shapes) is checked when it starts, before
    anything runs, and the step then runs micro-batch after micro-batch with the warning saying why
    (``BlockMajorStep``)."""
    store = get_store(model)
    wanted = store.block_major if block_major_option is None and store is not None else block_major_option
    if store is None or not stream or not wanted or len(micro_batches) < 2:
        return False
    if data_parallel:
        reason = ("the model runs under DistributedDataParallel (block-major there is not validated: DDP's forward "
                  "hands the graph its own tensors and all-reduces every backward)")
        if not store.residency.block_major_warned:
            store.residency.block_major_warned = True
            warnings.warn(f"poros block-major accumulation is off: {reason}; {FALLBACK_ADVICE}", stacklevel=3)
        return False
    return True


def step_context(model: torch.nn.Module, micro_batches: Sequence[Any], *, stream: bool = True,
                 block_major_option: bool | None = None, data_parallel: bool = False,
                 shared: Sequence[Any] = ()) -> contextlib.AbstractContextManager:
    """``block_major(model, micro_batches)`` where ``runs_block_major`` says so, else a context that does
    nothing (the micro-batches run one after the other)."""
    if runs_block_major(model, micro_batches, stream=stream, block_major_option=block_major_option,
                        data_parallel=data_parallel):
        return block_major(model, micro_batches, shared=shared)
    return contextlib.nullcontext()


@contextlib.contextmanager
def block_major(model: torch.nn.Module, micro_batches: Sequence[Any], *, shared: Sequence[Any] = ()) -> Iterator[BlockMajorStep]:
    """Run the forwards and backwards of ``micro_batches`` (one optimizer step) block-major.

    Inside, call the compiled model once per micro-batch, in order, with the micro-batch's tensors as
    they are (on the device already), and ``backward`` once per micro-batch, as for micro-batch-major
    accumulation; the result is bit-identical to it (see the module docstring)::

        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in next_four]
        with poros_fx.block_major(model, micro_batches):
            for mb in micro_batches:
                (step_model(**mb).loss / 4).backward()
        optimizer.step()

    ``model`` is the prepared model (not its ``torch.compile`` wrapper); ``shared``: other tensors the
    model calls receive, the same for every micro-batch (the Trainer's ``num_items_in_batch``)."""
    step = begin(model, micro_batches, shared=shared)
    try:
        yield step
    except BaseException:
        end(model, step, check=False)
        raise
    end(model, step)


def begin(model: torch.nn.Module, micro_batches: Sequence[Any], *, shared: Sequence[Any] = ()) -> BlockMajorStep:
    """Start a block-major step on ``model``'s store (``block_major``'s first half; the Trainer's hook)."""
    model = unwrap(model)
    store = get_store(model)
    if store is None:
        raise PorosConfigError("block-major accumulation streams a prepared model: call poros_fx.prepare(model) first")
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise PorosConfigError(f"block_major needs the step's micro-batches as a non-empty list, got "
                               f"{type(micro_batches).__name__}")
    if store.residency.accumulation is not None:
        raise PorosConfigError("a block-major step of this model is already running (nested block_major, or one "
                               "left open); end it first")
    for batch in micro_batches:  # every length from one compile (runtime/lengths.py)
        mark_dynamic(batch)
    store.residency.accumulation = BlockMajorStep(model, store, micro_batches, shared)
    return store.residency.accumulation


def end(model: torch.nn.Module, step: BlockMajorStep, check: bool = True) -> None:
    """End ``step`` (``block_major``'s second half): ``check`` raises if a backward still waits."""
    store = get_store(model)
    if store is not None and store.residency.accumulation is step:
        store.residency.accumulation = None
    if check:
        step.close()
    else:
        with contextlib.suppress(PorosExactnessError):
            step.close()
