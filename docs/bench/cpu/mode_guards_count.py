import sys, time
import torch, poros_fx
from poros_fx.models.tiny import tiny_config, lora_model, demo_batches
layers=int(sys.argv[1]); torch.set_num_threads(1)
model = lora_model(tiny_config("qwen2", layers=layers, hidden=64, vocab=256), dropout=0.1)
poros_fx.prepare(model, device="cpu", codegen="eager")
step = torch.compile(model, backend="poros")
batch = demo_batches(1, seq=32, batch=1)[0]
step(**batch, use_cache=False).loss.backward()
# the guard check alone: the cache entry's guard manager on the same inputs
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
import inspect
fn = model.forward.__func__ if hasattr(model.forward, "__func__") else model.forward
entries = []
for code in {type(model)._call_impl.__code__, type(model).forward.__code__}:
    entries += _debug_get_cache_entry_list(code)
print("cache entries", len(entries))
for e in entries:
    gm = e.guard_manager
    text = str(gm) if hasattr(gm, "__str__") else ""
    print("guard lines", len(text.splitlines()))
