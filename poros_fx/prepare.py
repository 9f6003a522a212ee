"""``prepare``: move a model's frozen base into the host store and route every read through ``poros::load``.

After ``prepare`` the module tree is the user's own (same classes as far as ``isinstance`` can tell,
same parameter names, same adapter), with two changes:

* every frozen tensor's data lives in the host store: views of one exact-size host arena
  (page-locked for CUDA, see ``runtime/arena.py``), so nothing of the base stays on the compute
  device between uses;
* each module holding frozen tensors gets a subclass of its own class whose ``weight`` / ``bias``
  attributes are properties returning ``poros::load(host, device)`` (bitsandbytes ``Linear4bit``
  gets a forward that loads the packed weight and its quant state the same way and then calls the
  very ``bnb.matmul_4bit`` the original forward calls).

``unprepare`` reverses both.
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Callable

import torch
from torch import nn

from . import attention
from .adapter_hooks import follow
from .compiler import ops
from .compiler.regions import CODEGENS, RegionTable, layer_forward, mode_modules
from .compiler.regions import state as regions_state
from .errors import NoBlocksError, PorosConfigError
from .families import Family, layer_list, resolve
from .runtime.arena import HostArena, aligned
from .runtime.store import HostEntry, HostStore

logger = logging.getLogger("poros_fx")

STORE_ATTR = "_poros_store"
ENTRY_ATTR = "_poros_entry"


AUTO = "auto"  # prefetch depth measured from the first forward run (runtime/depth.py)


def check_block_options(block_size: Any, prefetch: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise PorosConfigError(f"block_size must be an integer >= 1 (decoder layers per streamed block), got {block_size!r}")
    if prefetch != AUTO and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise PorosConfigError(f"prefetch must be an integer >= 0 (blocks loaded ahead of the one computing) or "
                               f"'auto' (measured), got {prefetch!r}")


def parse_prefetch(text: str) -> int | str:
    """A command line's ``--prefetch``: ``auto`` or an integer >= 0."""
    try:
        value: int | str = int(text)
    except ValueError:
        value = text  # "auto", or refused just below
    check_block_options(1, value)
    return value


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")  # one CPU device: "cpu:0" (accelerate's device under torch.distributed) is "cpu"
    if device.type not in ("cpu", "cuda"):
        raise PorosConfigError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PorosConfigError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or device=None")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_problem(text: str) -> str | None:
    """What is wrong with a command line's ``--device`` (cpu or cuda[:N], cuda only where torch sees one),
    or ``None``; shared by the demo's and the CLI's option checks."""
    try:
        kind = torch.device(text).type
    except RuntimeError:  # torch cannot parse it
        kind = None
    if kind not in ("cpu", "cuda"):
        return f"must be cpu or cuda (or cuda:N), got {text!r}"
    if kind == "cuda" and not torch.cuda.is_available():
        return (f"{text!r} was asked for but torch sees no CUDA device (torch {torch.__version__}); use --device cpu, "
                "or leave it out")
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a ``torch.compile`` wrapper."""
    return getattr(model, "_orig_mod", model)


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module inside a PEFT wrapper (or the model itself)."""
    model = unwrap(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def get_store(model: nn.Module) -> HostStore | None:
    return getattr(unwrap(model), STORE_ATTR, None)


def block_names(num_layers: int, block_size: int) -> list[str]:
    names = ["embed"]
    for start in range(0, num_layers, block_size):
        end = min(start + block_size, num_layers) - 1
        names.append(f"layers.{start}" if start == end else f"layers.{start}-{end}")
    return names + ["head"]


def module_blocks(family: Family, num_layers: int, block_size: int) -> Callable[[str], int]:
    """``module name -> block index`` (0 embed, 1.. layer blocks, last head) for a causal LM's modules."""
    head = len(block_names(num_layers, block_size)) - 1
    layer_re = re.compile(rf"^{re.escape(family.layers)}\.(\d+)(\.|$)")

    def block_of(module_name: str) -> int:
        m = layer_re.match(module_name)
        if m:
            return 1 + int(m.group(1)) // block_size
        if any(module_name == e or module_name.startswith(e + ".") for e in (family.embed, *family.embed_extras)):
            return 0
        return head  # final norm, lm_head, anything after the layers

    return block_of


HEAD_CHUNK_BYTES = 256 * 2**20  # an lm_head over twice this is loaded in row chunks of about this size


def head_chunk_count(nbytes: int, rows: int, requested: int | None = None) -> int:
    """How many row chunks an lm_head of ``nbytes`` is loaded in: ``requested``, or (``None``) one while
    it is at most ``2 x HEAD_CHUNK_BYTES`` and chunks of about ``HEAD_CHUNK_BYTES`` above that."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise PorosConfigError(f"head_chunks must be an integer >= 1 (or None: automatic), got {requested!r}")
        return min(requested, rows)
    return 1 if nbytes <= 2 * HEAD_CHUNK_BYTES else min(rows, -(-nbytes // HEAD_CHUNK_BYTES))


def prepare(model: nn.Module, device: str | torch.device | None = None, block_size: int = 1,
            prefetch: int | str = AUTO,
            *, family: Family | str | None = None, head_chunks: int | None = None, codegen: str | None = None,
            regions: bool = True, memory_budget: int | str | None = None, block_major: bool = True,
            _arena: HostArena | None = None) -> nn.Module:
    """Move the frozen base of ``model`` into a host store; returns ``model`` (changed in place).

    ``device`` is the compute device (``None``: CUDA when present, else CPU); what is not frozen base
    (the adapter's trainable parameters, with their gradients, and the buffers, e.g. rotary
    ``inv_freq``) is moved there, as ``model.to(device)`` would move it (``unprepare`` leaves it
    there). ``block_size`` decoder layers are streamed together; ``prefetch`` blocks are loaded ahead of the one computing (``"auto"``:
    one in the forward; the backward's depth comes from the forward's measured copy and compute times).
    ``family`` registers an architecture that is not validated (``poros_fx.user_asserted(...)``), or
    names a validated one (``"qwen2"``, see ``poros_fx.VALIDATED``).
    Gradient checkpointing must be off (``PorosConfigError`` otherwise): the backend recomputes each
    block itself.
    ``head_chunks``: row chunks the lm_head weight is loaded in (``None``: one up to 512 MiB, chunks of
    about 256 MiB above, so a 32B/72B head, 1.6/2.5 GB in bf16, is never resident whole). Chunked, the
    logits are ``cat`` of per-chunk matmuls: exact against ``stream=False`` (same graph), but no longer
    bitwise equal to an eager run's single matmul (its backward sums the chunks' products).
    ``codegen``: how compiled regions run, ``"inductor"`` (fused kernels) or ``"eager"`` (the aten
    graph, equal to the eager loop); ``None``: the default for the device (``default_codegen``).
    ``regions``: each decoder layer becomes one compiled region under ``torch.compile``, traced once per
    distinct layer structure (``compiler/regions.py``); ``False`` traces every layer into the step's
    graph (the path before regions, for an architecture the region tracer cannot take).
    ``memory_budget``: device bytes the step may use (``"24GB"``, or an int); the first step streams
    everything and measures its peak, then the blocks that fit in the rest stay resident (loaded once,
    never reloaded; ``runtime/budget.py``). ``None``: stream every block, every step.
    ``block_major``: gradient accumulation inside ``poros_fx.block_major`` (``@poros_fx.step(accumulate=N)``,
    ``PorosTrainer``, ``poros-fx train --accumulate``) runs each block for all micro-batches of the step
    while it is loaded (``runtime/accumulate.py``); ``False``: micro-batch after micro-batch.
    """
    check_block_options(block_size, prefetch)
    if not isinstance(block_major, bool):
        raise PorosConfigError(f"block_major must be True or False, got {block_major!r}")
    from .runtime.budget import parse_size

    budget = parse_size(memory_budget)
    codegen = check_codegen(codegen)
    device = resolve_device(device)
    if hasattr(model, "_orig_mod"):
        raise PorosConfigError("prepare the model before torch.compile: poros_fx.prepare(model) then torch.compile(model, backend='poros')")
    if get_store(model) is not None:
        raise PorosConfigError("model is already prepared; call poros_fx.unprepare(model) first to change its settings")
    check_no_checkpointing(model)
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    fam = resolve(getattr(config, "model_type", None), family, lm)
    try:
        layers = lm.get_submodule(fam.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        found = layer_list(lm)
        raise NoBlocksError(f"found no decoder layers at {type(lm).__name__}.{fam.layers}; poros-fx streams a model "
                            f"block by block and needs that list (family {fam.model_type!r} says it is there)"
                            + (f"; this model's layer list is {found!r}: user_asserted({fam.model_type!r}, "
                               f"layers={found!r}, ...)" if found and found != fam.layers else ""))
    _place_on_device(model, device)  # after every check above: a refused model is left where it was

    names = block_names(len(layers), block_size)
    store = HostStore(device=device, block_size=block_size, prefetch=prefetch, family=fam, block_names=names,
                      codegen=codegen or default_codegen(device), memory_budget=budget, block_major=block_major)
    block_of = module_blocks(fam, len(layers), block_size)
    attention_undo = attention.use(config)  # SDPA as eager calls it, also under torch.compile
    if attention_undo is not None:
        store.undo.append(attention_undo)

    reader_blocks: dict[int, set[int]] = {}
    owners: list[tuple[str, nn.Module, list[str]]] = []
    adapters = adapter_parameters(lm)  # an inactive adapter is frozen too, but it is no part of the base
    for mod_name, module in lm.named_modules():
        frozen = [n for n, p in module._parameters.items()
                  if p is not None and not p.requires_grad and id(p) not in adapters]
        if not frozen:
            continue
        owners.append((mod_name, module, frozen))
        for n in frozen:
            readers = reader_blocks.setdefault(id(module._parameters[n]), set())
            if not _gathers(module):  # a gathering embedding copies rows, not its table: no block load
                readers.add(block_of(mod_name))

    if not owners:
        raise PorosConfigError("nothing to stream: every parameter of the model is trainable. poros-fx streams a frozen "
                               "base: attach an adapter (peft.get_peft_model freezes the base) or freeze the base "
                               "(model.requires_grad_(False)) before prepare")
    needed = _arena_bytes(owners)
    if _arena is not None and _arena.capacity < needed:  # the loader's arena, already holding the tensors
        raise AssertionError(f"the loader's host arena holds {_arena.capacity} bytes, prepare needs {needed}")
    store.arena = _arena if _arena is not None else HostArena(needed)
    head = lm.get_output_embeddings() if callable(getattr(lm, "get_output_embeddings", None)) else None
    chunked_head = None
    if head is not None and type(head).forward is nn.Linear.forward and not head.weight.requires_grad:
        count = head_chunk_count(head.weight.numel() * head.weight.element_size(), head.out_features, head_chunks)
        if count > 1:
            chunked_head = head
            bounds = [round(i * head.out_features / count) for i in range(count + 1)]
            head._poros_row_chunks = tuple(zip(bounds[:-1], bounds[1:]))
            store.head_chunks = count
    elif head_chunks not in (None, 1):
        raise PorosConfigError(f"head_chunks={head_chunks!r}: this model's output layer is not a frozen nn.Linear "
                               f"({type(head).__name__}); it can only be loaded whole")
    classes: dict[tuple[type, bool], type] = {}
    for mod_name, module, frozen in owners:
        if _is_linear4bit(module):
            _move_linear4bit(store, mod_name, module, reader_blocks)
            frozen = [n for n in frozen if n != "weight"]
        for n in frozen:
            _move_param(store, f"{mod_name}.{n}" if mod_name else n, module._parameters[n],
                        tuple(sorted(reader_blocks[id(module._parameters[n])])))
        original = type(module)
        # a module's frozen tensors may have any names (Gated DeltaNet's A_log, dt_bias): one property each
        key = (original, module is chunked_head, tuple(sorted(set(frozen) | {"weight", "bias"})))
        if key not in classes:
            classes[key] = _poros_class(original, module, chunked=module is chunked_head, names=key[2])
        module.__class__ = classes[key]
        module._poros_device = device
        module._poros_frozen = tuple(frozen)
        store.undo.append(lambda module=module, original=original: _restore_class(module, original))
    if regions:
        _make_regions(store, layers)
    if device.type == "cuda":
        store.arena.pin()  # one exact-size page-locked range (see runtime/arena.py)
    setattr(model, STORE_ATTR, store)
    if unwrap(model) is not lm:
        setattr(lm, STORE_ATTR, store)
    if logger.isEnabledFor(logging.INFO):
        from .tools.report import report

        logger.info("%s", report(model))
    return model



def check_codegen(codegen: Any) -> str | None:
    if codegen is not None and codegen not in CODEGENS:
        raise PorosConfigError(f"codegen must be 'inductor' (fused kernels per region) or 'eager' (aten calls, equal "
                               f"to the eager loop), got {codegen!r}")
    return codegen


def default_codegen(device: torch.device) -> str:
    """The codegen a prepared model's regions get unless asked otherwise: ``"inductor"`` on CUDA (fused
    kernels; streamed == ``stream=False`` bit for bit, tested on the H200), ``"eager"`` on the CPU (aten
    calls, also bit-equal to the plain eager loop, and no C++ compile for a CPU run)."""
    return "inductor" if device.type == "cuda" else "eager"


def _make_regions(store: HostStore, layers: nn.ModuleList) -> None:
    """Each decoder layer gets a class whose forward is one ``poros::region`` call under torch.compile
    (``compiler/regions.py``), and the store a table of the regions traced from them."""
    store.regions = RegionTable(list(layers))
    hosts = {id(e.host) for e in store.entries.values()}
    classes: dict[type, type] = {}
    for index, layer in enumerate(layers):
        before = type(layer)
        if before not in classes:
            classes[before] = type(before.__name__, (before,), {"__module__": before.__module__,
                                                                "forward": layer_forward,
                                                                "_poros_layer_class": before})
        layer.__class__ = classes[before]
        layer._poros_table = store.regions.handle
        layer._poros_layer = index
        layer._poros_device = store.device
        _list_tensors(layer, hosts)
        block = _host_block(store, layer._poros_hosts)
        layer._poros_block = block
        layer._poros_block_views = None if block is None else tuple(
            (t.data_ptr() - block.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) for t in layer._poros_hosts)
        if block is not None:
            name = f"{store.family.layers}.{index} (its {len(layer._poros_hosts)} host tensors, side by side)"
            _add_entry(store, name, block, store.device, (1 + index // store.block_size,),
                       members=tuple(layer._poros_hosts))

        def undo(layer=layer, before=before):
            layer.__class__ = before
            block = layer.__dict__.get("_poros_block")
            if block is not None:
                block.__dict__.pop(ENTRY_ATTR, None)
            for attr in ("_poros_table", "_poros_layer", "_poros_own", "_poros_hosts", "_poros_layout", "_poros_block",
                         "_poros_block_views", "_poros_device", "_poros_modules", "_poros_adapters", "_poros_writes"):
                layer.__dict__.pop(attr, None)

        store.undo.append(undo)
    follower = follow(list(layers), lambda layer: _list_tensors(layer, hosts))
    store.followers.append(follower)  # alive as long as the store (adapter_hooks.py)
    store.undo.append(follower.remove)


def _list_tensors(layer: nn.Module, hosts: set[int]) -> None:
    """The layer's tensors as plain lists, in ``regions.state`` order: Dynamo reads them far faster than
    ``named_parameters()`` (compiler/regions.py). Host tensors (``hosts``: their ids) are loaded."""
    tensors = [t for _, t in regions_state(layer)]
    layer._poros_modules, layer._poros_adapters = mode_modules(layer)
    layer._poros_own = [t for t in tensors if id(t) not in hosts]
    layer._poros_hosts = [t for t in tensors if id(t) in hosts]
    own, host = iter(range(len(tensors))), iter(range(len(tensors)))
    layer._poros_layout = tuple(("host", next(host)) if id(t) in hosts else ("own", next(own)) for t in tensors)


def _host_block(store: HostStore, hosts: list[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 tensor over the arena bytes of ``hosts`` (a decoder layer's host tensors) when they lie
    side by side there, with nothing else between them (prepare places a layer's tensors one after the
    other; the loader's checkpoint order may not); else ``None``."""
    if not hosts or any(not store.arena.holds(h) or not h.is_contiguous() for h in hosts):
        return None
    start = min(h.data_ptr() for h in hosts)
    end = max(h.data_ptr() + h.numel() * h.element_size() for h in hosts)
    mine = {id(h) for h in hosts}
    for entry in store.entries.values():
        ptr = entry.host.data_ptr()
        if id(entry.host) not in mine and not entry.spans and start <= ptr < end:
            return None
    storage = hosts[0].untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, start - storage.data_ptr(), (end - start,))


def unprepare(model: nn.Module) -> nn.Module:
    """Put every frozen tensor back on the device it came from and restore the module classes."""
    model = unwrap(model)
    store = get_store(model)
    if store is None:
        raise PorosConfigError("model is not prepared (poros_fx.prepare was not called on it, or unprepare already ran)")
    for undo in reversed(store.undo):
        undo()
    store.resident_cache.clear()
    if store.arena is not None:
        store.arena.unpin()
    model.__dict__.pop("_poros_step_wrappers", None)  # @poros_fx.step's compiled wrappers of this model
    for holder in {id(model): model, id(causal_lm(model)): causal_lm(model)}.values():
        if hasattr(holder, STORE_ATTR):
            delattr(holder, STORE_ATTR)
    return model


# -- moving tensors ---------------------------------------------------------------------------------

def _arena_bytes(owners: list[tuple[str, nn.Module, list[str]]]) -> int:
    """Bytes (aligned) of every tensor ``prepare`` will move: frozen parameters once each (a tied pair is
    one tensor), and for bitsandbytes ``Linear4bit`` the packed weight and its quant-state tensors."""
    seen: dict[int, torch.Tensor] = {}
    for _, module, frozen in owners:
        for n in frozen:
            seen.setdefault(id(module._parameters[n]), module._parameters[n])
        if _is_linear4bit(module) and module._parameters["weight"].quant_state is not None:
            for t in quant_state_tensors(module._parameters["weight"].quant_state).values():
                seen.setdefault(id(t), t)
    return sum(aligned(t.numel() * t.element_size()) for t in seen.values())


def _host_copy(store: HostStore, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in the store's host arena. ``place`` copies with plain ``copy_`` on purpose:
    ``Params4bit.to`` would move its quant state as a side effect."""
    return store.arena.place(t.data)


def _move_param(store: HostStore, name: str, param: torch.Tensor, blocks: tuple[int, ...]) -> None:
    if id(param) in store.entries:
        return  # a tied tensor, already moved under its first name
    origin = param.device
    param.data = _host_copy(store, param)
    _add_entry(store, name, param, origin, blocks)

    def undo(param=param, origin=origin):
        param.data = param.data.to(origin)
        param.__dict__.pop(ENTRY_ATTR, None)

    store.undo.append(undo)


_QS_BUFFERS = ("absmax", "offset", "absmax2", "code2")


def _is_linear4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def quant_state_tensors(qs: Any) -> dict[str, torch.Tensor]:
    """The quant-state tensors NF4/FP4 kernels read (``qs.code``, the 4-bit table, is built into them)."""
    found = {"absmax": qs.absmax}
    if qs.nested:
        found.update(offset=qs.offset, absmax2=qs.state2.absmax, code2=qs.state2.code)
    return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}


def _move_linear4bit(store: HostStore, mod_name: str, module: nn.Module, reader_blocks: dict[int, set[int]]) -> None:
    """The packed weight becomes a plain frozen Parameter on the host; quant-state tensors become
    non-persistent buffers (graph inputs for Dynamo) in the host store. The ``Params4bit`` is set aside
    (its data pointing at the host copy) so ``unprepare`` can put it back."""
    params4bit = module._parameters["weight"]
    qs = params4bit.quant_state
    if qs is None:
        raise PorosConfigError(f"{mod_name}: bitsandbytes Linear4bit is not quantized yet (move it to a device first)")
    if getattr(qs, "packing_format_for_cpu", False):
        raise PorosConfigError(f"{mod_name}: weight was repacked for CPU inference; reload the model for training")
    blocks = tuple(sorted(reader_blocks[id(params4bit)]))
    origin = params4bit.device
    packed = nn.Parameter(_host_copy(store, params4bit), requires_grad=False)
    params4bit.data = packed.data  # the set-aside Params4bit must not keep device memory alive
    _add_entry(store, f"{mod_name}.weight", packed, origin, blocks)
    module._parameters["weight"] = packed
    module._poros_quant_state = qs
    module._poros_matmul_op = ops.matmul_4bit_applies(qs.nested, qs.state2.blocksize if qs.nested else None)
    for key, tensor in quant_state_tensors(qs).items():
        buf = nn.Parameter(_host_copy(store, tensor), requires_grad=False)
        _add_entry(store, f"{mod_name}.weight.quant_state.{key}", buf, tensor.device, blocks)
        module.register_buffer(f"poros_qs_{key}", buf, persistent=False)
    # the QuantState object now points at the host copies, so nothing of it stays on the device
    set_quant_state(qs, {k: getattr(module, f"poros_qs_{k}").data for k in quant_state_tensors(qs)})
    code_origin = qs.code.device if isinstance(qs.code, torch.Tensor) else None
    if code_origin is not None:
        qs.code = qs.code.to("cpu")

    def undo(module=module, qs=qs, params4bit=params4bit, origin=origin, code_origin=code_origin):
        params4bit.data = module._parameters["weight"].data.to(origin)
        module._parameters["weight"] = params4bit
        set_quant_state(qs, {k: module._buffers[f"poros_qs_{k}"].data.to(origin) for k in _QS_BUFFERS
                              if f"poros_qs_{k}" in module._buffers})
        for key in _QS_BUFFERS:
            module._buffers.pop(f"poros_qs_{key}", None)
        module.__dict__.pop("_poros_quant_state", None)
        module.__dict__.pop("_poros_matmul_op", None)
        if code_origin is not None:
            qs.code = qs.code.to(code_origin)

    store.undo.append(undo)


def _add_entry(store: HostStore, name: str, host: torch.Tensor, origin: torch.device, blocks: tuple[int, ...],
               members: tuple[torch.Tensor, ...] = ()) -> None:
    entry = HostEntry(name=name, host=host, origin_device=origin, blocks=blocks, store_ref=weakref.ref(store),
                      members=members)
    store.entries[id(host)] = entry
    setattr(host, ENTRY_ATTR, entry)


def set_quant_state(qs: Any, tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if key == "absmax2":
            qs.state2.absmax = t
        elif key == "code2":
            qs.state2.code = t
        else:
            setattr(qs, key, t)


# -- the module subclasses --------------------------------------------------------------------------

def _load_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor | None:
        param = self._parameters.get(name)
        if param is None or param.requires_grad or self.__dict__.get("_poros_describing"):
            return param
        return ops.load(param, self._poros_device)

    return property(get, doc=f"{name}, loaded from the poros host store onto the compute device")


def _describe_without_loading(self: nn.Module) -> str:
    """The original ``extra_repr`` (``nn.Linear``'s reads ``self.bias is not None``; PEFT prints layers in
    ``disable_adapter()``), with ``weight`` / ``bias`` the host tensors: describing a module loads nothing."""
    self.__dict__["_poros_describing"] = True
    try:
        return type(self)._poros_original_class.extra_repr(self)
    finally:
        del self.__dict__["_poros_describing"]


def _poros_class(original: type, module: nn.Module, chunked: bool = False,
                 names: tuple[str, ...] = ("bias", "weight")) -> type:
    namespace: dict[str, Any] = {"__module__": original.__module__, "_poros_original_class": original,
                                 "extra_repr": _describe_without_loading}
    if chunked:
        namespace["forward"] = _chunked_linear_forward
    if _is_linear4bit(module):
        namespace["forward"] = _linear4bit_forward
        namespace["bias"] = _load_property("bias")
    else:
        if _gathers(module):
            namespace["forward"] = _embedding_forward
        for name in names:
            namespace[name] = _load_property(name)
    return type(original.__name__, (original,), namespace)


def _restore_class(module: nn.Module, original: type) -> None:
    module.__class__ = original
    for attr in ("_poros_device", "_poros_frozen", "_poros_quant_state", "_poros_row_chunks"):
        module.__dict__.pop(attr, None)


# Embedding subclasses whose forward is ``nn.Embedding.forward(ids) * self.embed_scale.to(weight.dtype)``
# (Gemma 3's and Gemma 4's scaled word embeddings; Gemma 4's per-layer table is one too): their rows are
# gathered and scaled the same way
SCALED_EMBEDDINGS = frozenset({"Gemma3TextScaledWordEmbedding", "Gemma4TextScaledWordEmbedding"})


def _scaled(module: nn.Module) -> bool:
    original = getattr(type(module), "_poros_original_class", type(module))
    return original.__name__ in SCALED_EMBEDDINGS and isinstance(module._buffers.get("embed_scale"), torch.Tensor)


def gathers_rows(module: nn.Module) -> bool:
    """Whether a prepared ``module`` looks rows up in the host store instead of loading its table: a
    plain ``nn.Embedding`` (its class keeps ``nn.Embedding.forward``), or a scaled one of Gemma's
    (``SCALED_EMBEDDINGS``), without ``max_norm`` (which would rewrite the table). Other subclasses
    with a forward of their own load the table as a block."""
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    original = getattr(type(module), "_poros_original_class", type(module))
    return original.forward is nn.Embedding.forward or _scaled(module)


def _gathers(module: nn.Module) -> bool:
    return gathers_rows(module) and not module.weight.requires_grad


def _embedding_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` with the rows gathered from the host store (padding_idx,
    scale_grad_by_freq and sparse only shape the table's gradient, and the table is frozen); a scaled
    embedding (``SCALED_EMBEDDINGS``) multiplies them by its scale as its own forward does."""
    weight = self._parameters["weight"]
    rows = ops.gather(weight, input, self._poros_device)
    return rows * self.embed_scale.to(weight.dtype) if _scaled(self) else rows


def _chunked_linear_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the weight loaded in row chunks: each chunk's rows are loaded, give
    their slice of the output features, and are dead before the next chunk's matmul."""
    weight, bias, device = self._parameters["weight"], self._parameters.get("bias"), self._poros_device
    outs = []
    for start, stop in self._poros_row_chunks:
        b = None if bias is None else bias[start:stop] if bias.requires_grad else ops.load(bias[start:stop], device)
        outs.append(torch.nn.functional.linear(x, ops.load(weight[start:stop], device), b))
    return torch.cat(outs, dim=-1)


def _linear4bit_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward`` (0.49/0.50) with the packed weight and quant state loaded;
    the matmul is ``poros::matmul_4bit`` (the same kernels as ``bnb.matmul_4bit``, one op for Dynamo to
    trace, see ops.py) where it applies, else ``bnb.matmul_4bit`` itself."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    device = self._poros_device
    host_qs = self._poros_quant_state
    nested = host_qs.nested
    absmax2 = ops.load(self.poros_qs_absmax2, device) if nested else None
    code2 = ops.load(self.poros_qs_code2, device) if nested else None
    absmax = ops.load(self.poros_qs_absmax, device)
    offset = ops.load(self.poros_qs_offset, device) if nested else None
    packed = ops.load(self._parameters["weight"], device)
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    if bias is not None:
        bias = bias.to(x.dtype).to(self.compute_dtype)
    if self._poros_matmul_op and (bias is None or not bias.requires_grad):
        # matmul_4bit's B.view(-1, 1) of packed.t() is packed itself: [(N*K+1)//2, 1]
        return ops.MATMUL_4BIT(x, packed, list(host_qs.shape), absmax, host_qs.blocksize, host_qs.quant_type,
                               host_qs.dtype, absmax2, code2, offset, host_qs.state2.blocksize if nested else 0,
                               host_qs.state2.dtype if nested else torch.float32, bias).to(inp_dtype)
    state2 = None
    if nested:
        state2 = QuantState(absmax=absmax2, code=code2, blocksize=host_qs.state2.blocksize, dtype=host_qs.state2.dtype)
    quant_state = QuantState(absmax=absmax, shape=host_qs.shape, code=None, blocksize=host_qs.blocksize,
                             quant_type=host_qs.quant_type, dtype=host_qs.dtype, offset=offset, state2=state2)
    return bnb.matmul_4bit(x, packed.t(), bias=bias, quant_state=quant_state).to(inp_dtype)


# -- checks and placement of what is not base (used by prepare, the backend, @step) --------------------

CHECKPOINTING_MESSAGE = (
    "gradient (activation) checkpointing is on{where}: poros already recomputes each block in the backward, "
    "from its own reload of the base and with the forward's RNG state, and cannot nest a second recompute "
    "(torch.utils.checkpoint) inside its graphs. Turn it off (model.gradient_checkpointing_disable(), or leave "
    "TrainingArguments.gradient_checkpointing False); the activation memory stays one block's either way.")


def checkpointing_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose Hugging Face gradient checkpointing is switched on
    (``gradient_checkpointing_enable()`` sets ``module.gradient_checkpointing = True`` on each layer)."""
    return [name or type(m).__name__ for name, m in unwrap(model).named_modules()
            if getattr(m, "gradient_checkpointing", False) is True]


def check_no_checkpointing(model: nn.Module) -> None:
    """Raise ``PorosConfigError`` when ``model`` has gradient checkpointing switched on."""
    on = checkpointing_modules(model)
    if on:
        shown = ", ".join(on[:2]) + (f" and {len(on) - 2} more" if len(on) > 2 else "")
        raise PorosConfigError(CHECKPOINTING_MESSAGE.format(where=f" ({shown})"))


def adapter_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of every PEFT adapter in ``model``, the inactive ones (frozen) included:
    what a PEFT tuner layer keeps under its ``adapter_layer_names`` (``lora_A``, ``lora_B``, ...)."""
    found: set[int] = set()
    for module in model.modules():
        for name in getattr(module, "adapter_layer_names", ()):
            holder = getattr(module, name, None)
            if isinstance(holder, (nn.Module, nn.ParameterDict)):
                found.update(id(p) for p in holder.parameters())
    return found


def _place_on_device(model: nn.Module, device: torch.device) -> None:
    """Move what is not frozen base to ``device``: trainable parameters and every adapter's (their
    ``.data``, so the Parameter objects, and an optimizer built on them, stay the same; their gradients
    too) and the buffers. The frozen base parameters go to the host store instead (prepare, below)."""
    adapters = adapter_parameters(model)
    for module in model.modules():
        for param in module._parameters.values():
            if param is None or (not param.requires_grad and id(param) not in adapters) or param.device == device:
                continue
            grad, moved = param.grad, param.data.to(device)
            if torch._has_compatible_shallow_copy_type(param.data, moved):  # CPU <-> CUDA, as Module._apply
                param.data = moved
            else:  # another tensor type (the meta device): swap the contents, the object stays the same
                param.grad = None
                torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=True))
            if grad is not None:
                param.grad = grad.to(device)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
