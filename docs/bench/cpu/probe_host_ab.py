"""Host-overhead proxy for an A/B between two checkouts: median ms per training step of a tiny NF4 Qwen2
(dropout 0.05) on the CPU, whose kernels are tiny, so the step is the host's Python and dispatch.

    python docs/bench/cpu/probe_host_ab.py LAYERS MODE     # MODE: eager | resident | poros

Used in host_time_probes.md, alternating the two checkouts with `git stash` between runs."""
import statistics
import sys
import time

import torch

import poros_fx
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

layers, mode = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=layers), dropout=0.05, nf4=True, dtype=torch.bfloat16)
if mode == "eager":
    step = model
else:
    poros_fx.prepare(model, device="cpu")
    step = torch.compile(model, backend="poros", options={"stream": mode == "poros"})
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
batch = demo_batches(1, seq=32)[0]
times = []
for _ in range(44):
    t = time.perf_counter()
    step(**batch, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t)
print(f"{mode} layers={layers} median step {statistics.median(times[4:]) * 1e3:.1f} ms (first {times[0]:.1f} s)")
