"""``prepare``: move a model's frozen base into the host store and route every read through ``poros::load``.

After ``prepare`` the module tree is the user's own (same classes as far as ``isinstance`` can tell,
same parameter names, same adapter), with two changes:

* every frozen tensor's data lives in the host store: views of one exact-size host arena
  (page-locked for CUDA, see ``runtime/arena.py``), so the base is on the compute device only while a
  graph uses it, apart from the turn-around copies (a training backward's last blocks wait there for
  the next forward, ``runtime/turnaround.py``) and the blocks a ``memory_budget`` keeps;
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

from . import attention, loss
from .adapter_hooks import follow
from .compiler import ops
from .compiler.regions import RegionTable, check_no_dora_on_nf4, check_no_parameter_lora, layer_forward, mode_modules
from .compiler.regions import state as regions_state
from .compiler.regions.recorded import check_no_router_logits_with_chunks, install_recorders
from .compiler.regions.parameter_lora import check_targets_adapted, is_parameter_lora, target_parameters
from .compiler.regions.sequence_chunks import CHUNKS_ATTR, MLP_ATTR
from .errors import NoBlocksError, PorosConfigError
from .families import Family, layer_list, resolve
from .handles import ENTRY_ATTR, STORE_ATTR, causal_lm, check_no_checkpointing, get_store, unwrap
from .host_modules import (QS_BUFFERS, gathers_here, head_rows, is_linear4bit, poros_class, quant_state_tensors, restore_class,
                           set_quant_state)
from .options import PorosOptions, default_codegen, prepare_settings, resolve_device
from .report import report
from .runtime.arena import HostArena, aligned
from .runtime.budget import BudgetState, resolve_budget
from .runtime.host_tensors import HostEntry, HostTensors
from .runtime.store import HostStore

logger = logging.getLogger("poros_fx")


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


def prepare(model: nn.Module, device: str | torch.device | None = None, *, family: Family | str | None = None,
            head_chunks: int | None = None, regions: bool = True, _arena: HostArena | None = None,
            **options: Any) -> nn.Module:
    """Move the frozen base of ``model`` into a host store; returns ``model`` (changed in place).

    ``device`` is the compute device (``None``: CUDA when present, else CPU); what is not frozen base
    (the adapter's trainable parameters, with their gradients, and the buffers, e.g. rotary
    ``inv_freq``) is moved there, as ``model.to(device)`` would move it (``unprepare`` leaves it
    there). ``family`` registers an architecture that is not validated (``poros_fx.user_asserted(...)``),
    or names a validated one (``"qwen2"``, see ``poros_fx.VALIDATED``).
    Gradient checkpointing must be off (``PorosConfigError`` otherwise): the backend recomputes each
    block itself.
    ``head_chunks``: row chunks the lm_head weight is loaded in (``None``: one up to 512 MiB, chunks of
    about 256 MiB above, so a 32B/72B head, 1.6/2.5 GB in bf16, is never resident whole). Chunked, the
    logits are ``cat`` of per-chunk matmuls: exact against ``stream=False`` (same graph), but no longer
    bitwise equal to an eager run's single matmul (its backward sums the chunks' products).
    ``regions``: each decoder layer becomes one compiled region under ``torch.compile``, traced once per
    distinct layer structure (``compiler/regions/``); ``False`` traces every layer into the step's graph
    (for an architecture the region tracer cannot take).
    ``options``: the streaming options set at prepare (``options.PREPARE_DEFAULTS``: ``block_size``,
    ``prefetch``, ``codegen``, ``memory_budget``, ``block_major``, ``chunked_loss``,
    ``offload_boundaries``), each as ``options.PorosOptions`` declares it; the model keeps them, and the
    same option given at compile time overrides them.
    """
    settings = prepare_settings(options)
    block_size, prefetch, codegen = settings["block_size"], settings["prefetch"], settings["codegen"]
    memory_budget, block_major = settings["memory_budget"], settings["block_major"]
    chunked_loss, offload_boundaries = settings["chunked_loss"], settings["offload_boundaries"]
    sequence_chunks = settings["sequence_chunks"]
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
    targets = target_parameters(model)
    for index, layer in enumerate(layers):
        check_no_dora_on_nf4(layer)
        if not regions:
            check_no_parameter_lora(layer)
        check_targets_adapted(layer, targets, index)
    attention.check_no_dropout(config)
    install_recorders(lm)  # a mixture of experts' router logits: hooks in place before Dynamo traces a call
    _place_on_device(model, device)  # after every check above: a refused model is left where it was

    names = block_names(len(layers), block_size)
    budget, budget_source = resolve_budget(memory_budget, device)
    store = HostStore(device=device, prefetch=prefetch, family=fam,
                      host=HostTensors(block_size=block_size, block_names=names),
                      codegen=codegen or default_codegen(device), block_major=block_major,
                      budget=BudgetState(memory_budget=budget, request=memory_budget, source=budget_source),
                      offload_boundaries=offload_boundaries, sequence_chunks=sequence_chunks)
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
            if not gathers_here(module):  # a gathering embedding copies rows, not its table: no block load
                readers.add(block_of(mod_name))

    if not owners:
        raise PorosConfigError("nothing to stream: every parameter of the model is trainable. poros-fx streams a frozen "
                               "base: attach an adapter (peft.get_peft_model freezes the base) or freeze the base "
                               "(model.requires_grad_(False)) before prepare")
    needed = _arena_bytes(owners)
    if _arena is not None and _arena.capacity < needed:  # the loader's arena, already holding the tensors
        raise AssertionError(f"the loader's host arena holds {_arena.capacity} bytes, prepare needs {needed}")
    store.host.arena = _arena if _arena is not None else HostArena(needed)
    head = lm.get_output_embeddings() if callable(getattr(lm, "get_output_embeddings", None)) else None
    chunked_head = None
    loss_rows = loss_chunks = None
    if head is not None and type(head).forward is nn.Linear.forward and not head.weight.requires_grad:
        count = head_chunk_count(head.weight.numel() * head.weight.element_size(), head.out_features, head_chunks)
        if count > 1:
            chunked_head = head
            head._poros_row_chunks = loss.row_chunks(head.out_features, count)
            store.host.head_chunks = count
        if loss.chunkable_head(head):
            loss_rows = head_rows(head)
            loss_chunks = (head._poros_row_chunks if head_chunks is not None and count > 1 else
                           loss.row_chunks(head.out_features, loss.loss_chunk_count(head.out_features, count)))
    elif head_chunks not in (None, 1):
        raise PorosConfigError(f"head_chunks={head_chunks!r}: this model's output layer is not a frozen nn.Linear "
                               f"({type(head).__name__}); it can only be loaded whole")
    if chunked_loss and loss_rows is None:
        raise PorosConfigError(f"chunked_loss=True: this model's output layer ({type(head).__name__}) is not a frozen "
                               "nn.Linear, so its logits cannot be computed a row range at a time")
    classes: dict[tuple[type, bool], type] = {}
    for mod_name, module, frozen in owners:
        if is_linear4bit(module):
            _move_linear4bit(store, mod_name, module, reader_blocks)
            frozen = [n for n in frozen if n != "weight"]
        for n in frozen:
            _move_param(store, f"{mod_name}.{n}" if mod_name else n, module._parameters[n],
                        tuple(sorted(reader_blocks[id(module._parameters[n])])))
        original = type(module)
        # a module's frozen tensors may have any names (Gated DeltaNet's A_log, dt_bias): one property each;
        # weight and bias where the module has them (a bias of None too), so hasattr stays as it was (PEFT
        # reads a wrapped module's device off .weight when it has one)
        names = set(frozen) | ({"weight", "bias"} & module._parameters.keys())
        key = (original, module is chunked_head, tuple(sorted(names)))
        if key not in classes:
            classes[key] = poros_class(original, module, chunked=module is chunked_head, names=key[2])
        module.__class__ = classes[key]
        module._poros_device = device
        module._poros_frozen = tuple(frozen)
        store.undo.append(lambda module=module, original=original: restore_class(module, original))
    if regions:
        check_no_router_logits_with_chunks(config, sequence_chunks)
        _make_regions(store, layers, lm)
    elif sequence_chunks > 1:
        raise PorosConfigError(f"sequence_chunks={sequence_chunks} runs each decoder layer's MLP and projections in "
                               "token chunks inside its region; prepare(..., regions=False) has no regions: leave one of the two out")
    store.undo.append(loss.install(lm, fam.layers.rpartition(".")[0], loss_rows, loss_chunks or (), chunked_loss,
                                   no_training_cache=fam.status == "validated"))
    store.lm_ref = weakref.ref(lm)
    if device.type == "cuda":
        store.host.arena.pin()  # one exact-size page-locked range (see runtime/arena.py)
    setattr(model, STORE_ATTR, store)
    if unwrap(model) is not lm:
        setattr(lm, STORE_ATTR, store)
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", report(model))
    return model


def _make_regions(store: HostStore, layers: nn.ModuleList, lm: nn.Module) -> None:
    """Each decoder layer gets a class whose forward is one ``poros::region`` call under torch.compile
    (``compiler/regions/``), and the store a table of the regions traced from them."""
    store.regions = RegionTable(list(layers))
    hosts = {id(e.host) for e in store.host.entries.values()}
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
        set_layer_chunks(layer, store.family.mlp, store.sequence_chunks)
        _list_tensors(layer, hosts, lm)
        block = _host_block(store, layer._poros_hosts)
        layer._poros_block = block
        layer._poros_block_views = None if block is None else tuple(
            (t.data_ptr() - block.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) for t in layer._poros_hosts)
        if block is not None:
            name = f"{store.family.layers}.{index} (its {len(layer._poros_hosts)} host tensors, side by side)"
            _add_entry(store, name, block, store.device, (1 + index // store.host.block_size,),
                       members=tuple(layer._poros_hosts))

        def undo(layer=layer, before=before):
            layer.__class__ = before
            block = layer.__dict__.get("_poros_block")
            if block is not None:
                block.__dict__.pop(ENTRY_ATTR, None)
            for attr in ("_poros_table", "_poros_layer", "_poros_own", "_poros_hosts", "_poros_layout", "_poros_block",
                         "_poros_block_views", "_poros_device", "_poros_modules", "_poros_adapters", "_poros_writes",
                         CHUNKS_ATTR, MLP_ATTR):
                layer.__dict__.pop(attr, None)

        store.undo.append(undo)
    follower = follow(list(layers), lambda layer: _list_tensors(layer, hosts, lm))
    store.followers.append(follower)  # alive as long as the store (adapter_hooks.py)
    store.undo.append(follower.remove)


def _list_tensors(layer: nn.Module, hosts: set[int], lm: nn.Module) -> None:
    """The layer's tensors as plain lists, in ``regions.state`` order: Dynamo reads them far faster than
    ``named_parameters()`` (compiler/regions/). Host tensors (``hosts``: their ids) are loaded. LoRA on a
    parameter marks ``lm`` (``loss.PARAMETER_LORA_ATTR``): its layers must run as regions, so no call builds
    a cache (a layer given one runs inline, where Dynamo cannot trace PEFT's parametrization)."""
    check_no_dora_on_nf4(layer)  # an adapter attached after prepare comes through here too
    for module in layer.modules():
        if is_parameter_lora(module):
            # PEFT places an adapter attached after prepare where the wrapped module's first parameter is: a
            # module without a weight (experts) has only host tensors there
            _place_on_device(module, layer._poros_device)
            lm.__dict__[loss.PARAMETER_LORA_ATTR] = True
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
    if not hosts or any(not store.host.arena.holds(h) or not h.is_contiguous() for h in hosts):
        return None
    start = min(h.data_ptr() for h in hosts)
    end = max(h.data_ptr() + h.numel() * h.element_size() for h in hosts)
    layer_hosts = {id(h) for h in hosts}
    for entry in store.host.entries.values():
        ptr = entry.host.data_ptr()
        if id(entry.host) not in layer_hosts and not entry.spans and start <= ptr < end:
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
    store.residency.resident_cache.clear()
    if store.host.arena is not None:
        store.host.arena.unpin()
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
        if is_linear4bit(module) and module._parameters["weight"].quant_state is not None:
            for t in quant_state_tensors(module._parameters["weight"].quant_state).values():
                seen.setdefault(id(t), t)
    return sum(aligned(t.numel() * t.element_size()) for t in seen.values())


def _host_copy(store: HostStore, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in the store's host arena. ``place`` copies with plain ``copy_`` on purpose:
    ``Params4bit.to`` would move its quant state as a side effect."""
    return store.host.arena.place(t.data)


def _move_param(store: HostStore, name: str, param: torch.Tensor, blocks: tuple[int, ...]) -> None:
    if id(param) in store.host.entries:
        return  # a tied tensor, already moved under its first name
    origin = param.device
    param.data = _host_copy(store, param)
    _add_entry(store, name, param, origin, blocks)

    def undo(param=param, origin=origin):
        param.data = param.data.to(origin)
        param.__dict__.pop(ENTRY_ATTR, None)

    store.undo.append(undo)


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
        set_quant_state(qs, {k: module._buffers[f"poros_qs_{k}"].data.to(origin) for k in QS_BUFFERS
                              if f"poros_qs_{k}" in module._buffers})
        for key in QS_BUFFERS:
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
    store.host.entries[id(host)] = entry
    setattr(host, ENTRY_ATTR, entry)


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


def set_trace_options(model: nn.Module, options: dict) -> None:
    """Apply the options the model's own forward reads while Dynamo traces it (``chunked_loss``) and its
    regions are traced with (``sequence_chunks``) to the prepared ``model``, before it is compiled; the
    backend checks that they match (``@poros_fx.step``, ``PorosTrainer``, ``poros-fx train`` call this)."""
    if options.get("chunked_loss") is not None:
        loss.set_chunked_loss(causal_lm(unwrap(model)), options["chunked_loss"])
    store = get_store(model)
    chunks = options.get("sequence_chunks")
    if chunks is not None and store is not None and chunks != store.sequence_chunks:
        PorosOptions.from_dict({"sequence_chunks": chunks})
        if store.regions is None and chunks > 1:
            raise PorosConfigError(f"sequence_chunks={chunks} runs each decoder layer's MLP and projections in token "
                                   "chunks inside its region; this model was prepared with regions=False")
        check_no_router_logits_with_chunks(causal_lm(unwrap(model)).config, chunks)
        store.sequence_chunks = chunks
        for layer in causal_lm(unwrap(model)).get_submodule(store.family.layers):
            set_layer_chunks(layer, store.family.mlp, chunks)


def set_layer_chunks(layer: nn.Module, mlp: str, chunks: int) -> None:
    """Mark a prepared decoder layer for ``sequence_chunks``: its region traces its MLP (the submodule named
    ``mlp``) in ``chunks`` token chunks. The marks are plain attributes, so they are part of the region's
    fingerprint; ``chunks=1`` removes them."""
    if chunks <= 1:
        layer.__dict__.pop(CHUNKS_ATTR, None)
        layer.__dict__.pop(MLP_ATTR, None)
        return
    if not mlp or not isinstance(layer._modules.get(mlp), nn.Module):
        raise PorosConfigError(f"sequence_chunks={chunks}: decoder layer {type(layer).__name__} has no MLP submodule "
                               f"{mlp!r} to run in token chunks (the family's mlp=...; user_asserted(..., mlp='name') "
                               "names it)")
    layer.__dict__[CHUNKS_ATTR] = chunks
    layer.__dict__[MLP_ATTR] = mlp
