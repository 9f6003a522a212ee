"""Probe: nested_compile_region on prepared layers, each host tensor given its own storage first.
Usage: probe_nested_region.py LAYERS REGION(0|1) NF4(0|1)."""
import ctypes, time, types, sys, torch
import poros_fx
from poros_fx.prepare import get_store
from poros_fx.models.tiny import lora_model, tiny_config, demo_batches
layers = int(sys.argv[1]); region = sys.argv[2] == "1"; nf4 = sys.argv[3] == "1"
torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=layers), dropout=0.1, nf4=nf4, dtype=torch.bfloat16 if nf4 else torch.float32)
poros_fx.prepare(model, device="cpu")
store = get_store(model)
for e in store.entries.values():  # each host tensor its own storage over the same arena bytes
    h = e.host
    n = h.numel() * h.element_size()
    if n == 0: continue
    buf = (ctypes.c_uint8 * n).from_address(h.data_ptr())
    t = torch.frombuffer(buf, dtype=torch.uint8).view(h.dtype).view(h.shape)
    h.data = t
if region:
    f = None
    for layer in model.get_base_model().model.layers:
        f = f or torch.compiler.nested_compile_region(type(layer).forward)
        layer.forward = types.MethodType(f, layer)
cap = {}
def be(gm, ex):
    cap["gm"] = gm; return gm.forward
t0 = time.perf_counter()
out = torch.compile(model, backend=be)(**demo_batches(1)[0], use_cache=False)
gm = cap["gm"]
print(f"ok dynamo {time.perf_counter()-t0:.1f}s nodes", len(gm.graph.nodes), sum("invoke_subgraph" in str(n.target) for n in gm.graph.nodes))
