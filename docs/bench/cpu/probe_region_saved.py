"""Bytes a decoder layer's region saves for its backward, at a real shape with one layer, on the CPU.

    python docs/bench/cpu/probe_region_saved.py SHAPE      # qwen3-30b-a3b, gpt-oss-120b (models/configs/)

One layer of SHAPE (random init, NF4 base with NF4 experts, LoRA on the family's default targets), one
streamed step of 512 tokens with the eager codegen; prints, per region, how many tensors its forward
saves for its backward and their bytes at 512 tokens."""
import sys
import time

import torch

import poros_fx
from poros_fx.handles import get_store
from poros_fx.models.tiny import add_lora, base_model, lora_targets, shape_config

TOKENS = 512
config = shape_config(sys.argv[1])
config.num_hidden_layers = 1
if getattr(config, "layer_types", None):
    config.layer_types = config.layer_types[:1]
started = time.time()
model = add_lora(base_model(config, dtype=torch.bfloat16, nf4=True), targets=list(lora_targets(config.model_type)),
                 dropout=0.0)
print(f"built in {time.time() - started:.1f} s", flush=True)
poros_fx.prepare(model, device="cpu")
step = torch.compile(model, backend="poros", options={"codegen": "eager"})
ids = torch.randint(0, 1000, (1, TOKENS))
step(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def size(s) -> int:
    """A size at this step's tokens (a symbol's hint is the traced call's)."""
    return int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)


for region in get_store(model).regions.regions:
    outputs = next(iter(region.forward.graph.find_nodes(op="output"))).args[0]
    saved = [n.meta["val"] for n in outputs[region.num_outputs:] if isinstance(n.meta.get("val"), torch.Tensor)]
    total = sum(torch.Size([size(s) for s in v.shape]).numel() * v.element_size() for v in saved)
    print(f"layers {region.layers}: {len(saved)} saved tensors, {total} bytes at {TOKENS} tokens")
