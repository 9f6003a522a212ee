import sys, time
import torch
import poros_fx
import poros_fx.compiler.regions.ops as ops
from poros_fx.models.tiny import tiny_config, lora_model, demo_batches
layers = int(sys.argv[1]); exp = sys.argv[2]
torch.manual_seed(0); torch.set_num_threads(1)
if exp == "nomode":
    ops.mode_entry = lambda layer: "@m"
if exp == "flags":
    ops.mode_entry = lambda layer: "@" + "".join(["1" if m.training else "0" for m in layer._poros_modules])
if exp == "adapters":
    ops.mode_entry = lambda layer: "@" + "".join([f"|{'0' if m._disable_adapters else '1'}{m._active_adapter}{tuple(m.scaling.items())}" for m in layer._poros_adapters])
config = tiny_config("qwen2", layers=layers, hidden=64, vocab=256)
model = lora_model(config, dtype=torch.float32, dropout=0.1)
poros_fx.prepare(model, device="cpu", codegen="eager")
step = torch.compile(model, backend="poros")
batch = demo_batches(1, seq=32, batch=1)[0]
t = time.perf_counter(); out = step(**batch, use_cache=False); out.loss.backward(); first = time.perf_counter() - t
from torch._dynamo.utils import compile_times
ct = dict(l.split(", ") for l in compile_times(repr="str", aggregate=True).splitlines()[2:] if ", " in l)
keys = ["bytecode_tracing", "get_fake_value", "OutputGraph.call_user_compiler", "aot_trace_joint_graph", "aot_collect_metadata", "build_guards", "_compile.compile_inner"]
print(f"{exp} layers={layers} first={first:.2f}", " ".join(f"{k.split('.')[-1]}={float(ct.get(k,0)):.2f}" for k in keys))
