"""First-step (compile) time of a tiny NF4 Qwen2 on the CPU: python probe_region_compile.py LAYERS 1 [regions 0|1].
Quoted in docs/benchmarks.md; the per-layer cost is the difference of two depths over their layer difference."""
import torch, poros_fx, time, sys, logging
from poros_fx.models.tiny import tiny_lora_model, demo_batches
layers = int(sys.argv[1]); nf4 = sys.argv[2] == "1"
regions = len(sys.argv) < 4 or sys.argv[3] == "1"
m = tiny_lora_model("qwen2", layers=layers, nf4=nf4)
poros_fx.prepare(m, device="cpu", regions=regions)
b = demo_batches(1, seq=16)[0]
c = torch.compile(m, backend="poros")
t = time.perf_counter(); c(**b, use_cache=False).loss.backward(); t1 = time.perf_counter() - t
t = time.perf_counter(); c(**b, use_cache=False).loss.backward(); t2 = time.perf_counter() - t
print(f"layers {layers} nf4 {nf4} regions {regions}: first {t1:.1f} s, second {t2*1e3:.0f} ms")
