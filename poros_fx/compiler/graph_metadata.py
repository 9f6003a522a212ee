"""Node metadata that must not outlive a model: the module classes Dynamo records for every node.

``prepare`` gives each model's modules classes of their own. Dynamo guards on those classes weakly and
drops a compiled graph when they die (the model was freed or unprepared); a compiled graph that holds
them itself (``nn_module_stack``, ``source_fn_stack`` in its nodes' metadata, and in the metadata of
the graphs it was made from, which AOTAutograd and the regions keep) keeps a dropped model's graphs
cached, counting toward Dynamo's recompile limit. ``forget_module_classes`` puts the classes' names
in their place; the passes read module paths only::

    before: meta["nn_module_stack"] = {"L__self___model_norm": ("model.norm", <class Qwen2RMSNorm>)}
    after:  meta["nn_module_stack"] = {"L__self___model_norm": ("model.norm", "Qwen2RMSNorm")}
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

MODULE_METADATA = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack")


def forget_module_classes(gm: fx.GraphModule) -> None:
    """Replace the module classes in ``gm``'s node metadata (and its subgraphs') by their names."""
    for n in (n for module in gm.modules() if isinstance(module, fx.GraphModule) for n in module.graph.nodes):
        for key in MODULE_METADATA:
            value = n.meta.get(key)
            # in place: graphs made from one another share these dicts and lists
            if isinstance(value, dict):
                value.update({k: _named(v) for k, v in value.items()})
            elif isinstance(value, list):
                value[:] = [_named(v) for v in value]


def _named(entry: Any) -> Any:
    if isinstance(entry, tuple):
        return tuple(getattr(x, "__qualname__", x) if isinstance(x, type) else x for x in entry)
    return entry
