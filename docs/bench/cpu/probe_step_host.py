"""Host-overhead proxy: median seconds per training step of a tiny NF4 Qwen2 on the CPU (kernels are tiny)."""
import statistics, sys, time, torch
import poros_fx
from poros_fx.models.tiny import lora_model, tiny_config, demo_batches
layers = int(sys.argv[1])
torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=layers), dropout=0.1, nf4=True, dtype=torch.bfloat16)
poros_fx.prepare(model, device="cpu")
step = torch.compile(model, backend="poros")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
b = demo_batches(1, seq=32)[0]
times = []
for i in range(34):
    t = time.perf_counter()
    step(**b, use_cache=False).loss.backward(); opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
print(f"layers={layers} median step {statistics.median(times[4:])*1e3:.1f} ms (first {times[0]:.1f} s)")
