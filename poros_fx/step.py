"""``@poros_fx.step``: run the user's own training-step function with its model streamed by poros.

The decorator finds every ``nn.Module`` argument of the call, prepares it (``poros_fx.prepare``) the
first time it sees it unprepared, and calls the function with that argument replaced by
``torch.compile(module, backend="poros", options=...)``. Everything else stays the user's: the loss,
``backward``, the optimizer, ``zero_grad``. With ``accumulate=N`` the function is called once per
micro-batch of a list of N.

Example::

    import torch, poros_fx

    @poros_fx.step(accumulate=2)
    def train_step(model, batch):
        loss = model(**batch).loss / 2      # the decorator does not rescale: divide here if you want a mean
        loss.backward()
        return loss

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for micro_batches in loader:            # lists of 2 batches
        losses = train_step(model, micro_batches)   # [loss of batch 0, loss of batch 1]
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable, Generic, ParamSpec, TypeVar, overload

import torch
from torch import nn

from .distributed import no_ddp_optimizer
from .errors import PorosConfigError
from .handles import check_no_checkpointing, get_store
from .options import given_options, prepare_options
from .prepare import prepare, set_trace_options
from .runtime import accumulate as accumulation
from .runtime.lengths import mark_dynamic

P = ParamSpec("P")
R = TypeVar("R")

# instance attribute of a model holding its step wrappers (see PorosStep._compiled)
KEEP_ALIVE_ATTR = "_poros_step_wrappers"


class PorosStep(Generic[P, R]):
    """A step function whose ``nn.Module`` arguments run through the poros backend.

    Without ``accumulate``, ``train_step(model, batch)`` returns what the function returns. With
    ``accumulate=N``, the first argument that is not an ``nn.Module`` (in the function's parameter
    order) must be a list or tuple of exactly N micro-batches; the function is called once per
    micro-batch, in order, with the other arguments unchanged, and the call returns the list of the N
    return values. The losses are not rescaled: a function that wants the mean divides by N itself.

    ``nn.Module`` arguments without any parameter (a loss module, say) are passed through unchanged.
    A prepared model keeps the settings it was prepared with; the options given here override them at
    compile time (``torch.compile`` ``options``), as they would by hand.
    """

    def __init__(self, fn: Callable[P, R], *, accumulate: int | None = None,
                 device: str | torch.device | None = None, **options: Any) -> None:
        if accumulate is not None and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
            raise PorosConfigError(f"accumulate must be an integer >= 1 (micro-batches per call), got {accumulate!r}")
        options = {"stream": True, **given_options(options)}  # bad options raise here, at decoration
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.accumulate = accumulate
        self.options = options
        self.device = device
        self._signature = inspect.signature(fn)
        # id(module) -> (module, its host store, compiled wrapper), all weak: the compiled wrapper holds
        # the module, so a strong reference here would keep every model (and its pinned host store) alive
        # as long as the decorated function. The model holds its wrapper instead (KEEP_ALIVE_ATTR, a plain
        # cycle the garbage collector frees with the model). Not the host store: the backend's compiled
        # graphs, cached by Dynamo, reference the store, which would pin the model until dynamo.reset().
        self._compiled: dict[int, tuple[weakref.ref[nn.Module], weakref.ref[Any], weakref.ref[nn.Module]]] = {}

    def compiled(self, module: nn.Module) -> nn.Module:
        """``module`` prepared (if it was not) and compiled with this step's options; one wrapper per module.
        A ``DistributedDataParallel`` module is compiled as a whole; the model inside must be prepared."""
        from torch.nn.parallel import DistributedDataParallel

        if hasattr(module, "_orig_mod"):
            raise PorosConfigError("pass the model itself to a @poros_fx.step function, not torch.compile(model): "
                                   "the decorator compiles it with the poros backend")
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        entry = self._compiled.get(id(module))
        if entry is not None:
            mod_ref, store_ref, wrapper_ref = entry
            wrapper = wrapper_ref()
            store = store_ref()
            # a dead module's id can be reused; an unprepared / re-prepared model needs a new wrapper
            if mod_ref() is module and store is not None and get_store(inner) is store and wrapper is not None:
                return wrapper
        # drop entries of models that are gone (their wrappers went with them)
        for key in [k for k, (mod_ref, _, _) in self._compiled.items() if mod_ref() is None or k == id(module)]:
            del self._compiled[key]
        if get_store(inner) is None:  # prepare's defaults, as every other surface has them
            if inner is not module:
                raise PorosConfigError("a DistributedDataParallel module over an unprepared model: prepare the model "
                                       "before wrapping it (poros_fx.prepare(model), or load_pretrained / from_config, "
                                       "then poros_fx.distributed.data_parallel(model)); DDP made over the unprepared "
                                       "model holds the whole frozen base as its parameters")
            prepare(module, device=self.device, **prepare_options(self.options))
        else:  # prepare checked an unprepared model; this one may have had checkpointing switched on since
            check_no_checkpointing(inner)
        store = get_store(inner)
        set_trace_options(inner, self.options)  # what the model's forward reads while Dynamo traces it
        wrapper = torch.compile(module, backend="poros", options=dict(self.options))
        # written to __dict__ directly: nn.Module.__setattr__ would register the wrapper as a submodule.
        # Keyed by this decorator so re-compiling (after a re-prepare) replaces the stale wrapper.
        inner.__dict__.setdefault(KEEP_ALIVE_ATTR, {})[id(self)] = wrapper
        self._compiled[id(module)] = (weakref.ref(module), weakref.ref(store), weakref.ref(wrapper))
        return wrapper

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R | list[R]:
        bound = self._signature.bind(*args, **kwargs)
        slots = _Slots(bound, self._signature)
        modules: list[tuple[str, Any]] = []
        micro: tuple[str, Any] | None = None  # slot of the micro-batch list: the first argument not a module
        for slot in slots.all():
            if isinstance(slots.get(slot), nn.Module):
                modules.append(slot)
            elif micro is None:
                micro = slot
        name = getattr(self, "__name__", "step")
        if not modules:
            raise PorosConfigError(f"{name}: no nn.Module argument; @poros_fx.step streams the model passed "
                                   "to the step function, e.g. train_step(model, batch)")
        if self.accumulate is not None:  # checked before anything prepares the user's model
            micro_batches = slots.get(micro) if micro is not None else None
            where = "the batch argument" if micro is None else repr(micro[0] if micro[1] is None else f"{micro[0]}[{micro[1]!r}]")
            if not isinstance(micro_batches, (list, tuple)):
                raise PorosConfigError(f"{name} has accumulate={self.accumulate}: pass a list of {self.accumulate} "
                                       f"micro-batches as {where}, got {type(micro_batches).__name__}")
            if len(micro_batches) != self.accumulate:
                raise PorosConfigError(f"{name} has accumulate={self.accumulate} but got {len(micro_batches)} "
                                       f"micro-batches in {where}")
        for slot in slots.all():  # every length from one compile (runtime/lengths.py)
            if slot not in modules:
                mark_dynamic(slots.get(slot))
        streamed = []
        for slot in modules:
            module = slots.get(slot)
            if next(module.parameters(), None) is not None:  # a parameterless loss module has nothing to stream
                slots.set(slot, self.compiled(module))
                streamed.append(module)
        from torch.nn.parallel import DistributedDataParallel

        ddp = any(isinstance(m, DistributedDataParallel) for m in streamed)
        with no_ddp_optimizer() if ddp else contextlib.nullcontext():  # docs/distributed.md
            return self._run(bound, slots, micro, streamed, ddp)

    def _run(self, bound: inspect.BoundArguments, slots: "_Slots", micro: Any, streamed: list[nn.Module],
             ddp: bool) -> Any:
        if self.accumulate is None:
            return self.fn(*bound.args, **bound.kwargs)
        micro_batches = slots.get(micro)
        with contextlib.ExitStack() as block_major_steps:
            for module in streamed:  # each block loaded once for all micro-batches, where it can (runtime/accumulate.py)
                inner = module.module if ddp and hasattr(module, "module") else module
                block_major_steps.enter_context(accumulation.step_context(
                    inner, list(micro_batches), stream=self.options["stream"],
                    block_major_option=self.options.get("block_major"), data_parallel=ddp))
            results = []
            for micro_batch in micro_batches:
                slots.set(micro, micro_batch)
                results.append(self.fn(*bound.args, **bound.kwargs))
        return results

    def __repr__(self) -> str:
        return f"<poros_fx.step {getattr(self, '__qualname__', '?')} accumulate={self.accumulate} options={self.options}>"


class _Slots:
    """The call's arguments in the function's parameter order, ``*args`` / ``**kwargs`` entries included,
    each addressed as ``(parameter name, None | index | key)`` so it can be read and replaced."""

    def __init__(self, bound: inspect.BoundArguments, signature: inspect.Signature) -> None:
        self.bound = bound
        self.kinds = {name: p.kind for name, p in signature.parameters.items()}

    def all(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for name, value in self.bound.arguments.items():
            if self.kinds[name] is inspect.Parameter.VAR_POSITIONAL:
                out.extend((name, i) for i in range(len(value)))
            elif self.kinds[name] is inspect.Parameter.VAR_KEYWORD:
                out.extend((name, key) for key in value)
            else:
                out.append((name, None))
        return out

    def get(self, slot: tuple[str, Any]) -> Any:
        name, key = slot
        value = self.bound.arguments[name]
        return value if key is None else value[key]

    def set(self, slot: tuple[str, Any], new: Any) -> None:
        name, key = slot
        if key is None:
            self.bound.arguments[name] = new
        elif self.kinds[name] is inspect.Parameter.VAR_POSITIONAL:
            value = list(self.bound.arguments[name])
            value[key] = new
            self.bound.arguments[name] = tuple(value)
        else:
            self.bound.arguments[name] = {**self.bound.arguments[name], key: new}


@overload
def step(fn: Callable[P, R], /) -> PorosStep[P, R]: ...


@overload
def step(*, accumulate: int | None = None, device: str | torch.device | None = None,
         **options: Any) -> Callable[[Callable[P, R]], PorosStep[P, R]]: ...


def step(fn: Callable[P, R] | None = None, /, *, accumulate: int | None = None,
         device: str | torch.device | None = None,
         **options: Any) -> PorosStep[P, R] | Callable[[Callable[P, R]], PorosStep[P, R]]:
    """Decorate a training-step function so its model arguments are streamed by poros.

    ``@step`` or ``@step(accumulate=N, device=..., **options)``. ``options`` are the backend's
    (``options.PorosOptions``: ``block_size``, ``prefetch``, ``stream``, ``codegen``, ``memory_budget``,
    ``block_major``, ``chunked_loss``, ``offload_boundaries``, ``save_activations``, ``cuda_graphs``,
    ``least_memory``, ...), checked at decoration. A model that is not prepared yet is prepared on the
    first call with ``device`` and the options ``prepare`` takes (``options.PREPARE_DEFAULTS`` for the
    rest).
    With ``accumulate=N`` the call takes a list of N micro-batches and returns the list of the N
    results; the function is called on each in order and the decorator does not rescale the loss.
    Streamed, the N micro-batches run block-major (``runtime/accumulate.py``: each block loaded once
    for all of them, the adapter bit-identical to micro-batch order); pass the micro-batches with
    their tensors on the model's device and hand them to the model as they are. ``block_major=False``
    runs them one after the other.

    Example::

        @poros_fx.step
        def train_step(model, batch):
            loss = model(**batch).loss
            loss.backward()
            return loss

        loss = train_step(model, batch)   # model is prepared and compiled on the first call
        optimizer.step()
        optimizer.zero_grad()
    """
    given_options(options)  # a misspelled option raises where it is written, before a function is decorated

    def decorate(f: Callable[P, R]) -> PorosStep[P, R]:
        return PorosStep(f, accumulate=accumulate, device=device, **options)

    if fn is not None:
        if not callable(fn):
            raise PorosConfigError(f"@poros_fx.step decorates a function; got {fn!r} (use keywords: "
                                   "@poros_fx.step(accumulate=4))")
        return decorate(fn)
    return decorate
