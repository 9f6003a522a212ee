"""Probe: Dynamo-only and poros first-step time, fp32 vs NF4. Usage: probe_nf4_compile.py LAYERS NF4(0|1)."""
import time, sys, torch
import poros_fx
from poros_fx.models.tiny import lora_model, tiny_config, demo_batches
layers = int(sys.argv[1]); nf4 = sys.argv[2] == "1"
torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=layers), dropout=0.1, nf4=nf4, dtype=torch.bfloat16 if nf4 else torch.float32)
poros_fx.prepare(model, device="cpu")
captured = {}
def dyn(gm, ex):
    captured["n"] = len(gm.graph.nodes); return gm.forward
b = demo_batches(1)[0]
t = time.perf_counter(); torch.compile(model, backend=dyn)(**b, use_cache=False); d = time.perf_counter() - t
torch._dynamo.reset()
t = time.perf_counter(); out = torch.compile(model, backend="poros")(**b, use_cache=False); out.loss.backward(); p = time.perf_counter() - t
print(f"nf4={nf4} layers={layers} dynamo-only {d:.1f}s ({captured['n']} nodes), poros first step {p:.1f}s")
