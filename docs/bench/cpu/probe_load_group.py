"""Time spent in ``GraphRuntime.load_group`` per step of an 8-layer tiny NF4 Qwen2 on the CPU, and the
RNG wrappers' dispatch cost against the same calls made directly (one small dropout).

    python docs/bench/cpu/probe_load_group.py

To time it, the probe replaces the method on the class with a timing wrapper, in this process only."""
import time

import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

import poros_fx
from poros_fx.runtime import executor
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

spent = {"s": 0.0, "calls": 0}
original = executor.GraphRuntime.load_group


def timed(self, *args, **kwargs):
    t = time.perf_counter()
    out = original(self, *args, **kwargs)
    spent["s"] += time.perf_counter() - t
    spent["calls"] += 1
    return out


executor.GraphRuntime.load_group = timed  # this probe process only
torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=8), dropout=0.05, nf4=True, dtype=torch.bfloat16)
poros_fx.prepare(model, device="cpu")
step = torch.compile(model, backend="poros")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
batch = demo_batches(1, seq=32)[0]
for i in range(25):
    if i == 5:
        spent.update(s=0.0, calls=0)
        started = time.perf_counter()
    step(**batch, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
per_step = (time.perf_counter() - started) / 20
print(f"step {per_step * 1e3:.1f} ms; load_group {spent['s'] / 20 * 1e3:.2f} ms/step over {spent['calls'] / 20:.0f} calls")

x = torch.randn(32, 64, dtype=torch.bfloat16)
dropout = torch.ops.aten.native_dropout.default
state = torch.get_rng_state()


def us(f, n=2000):
    for _ in range(100):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def plain_with():
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    out = dropout(x, 0.05, True)
    torch.set_rng_state(current)
    return out


print(f"run_and_save_rng_state {us(lambda: run_and_save_rng_state(dropout, x, 0.05, True)):.1f} us, "
      f"plain {us(lambda: (torch.get_rng_state(), dropout(x, 0.05, True))):.1f} us")
print(f"run_with_rng_state {us(lambda: run_with_rng_state(state, dropout, x, 0.05, True)):.1f} us, "
      f"plain {us(plain_with):.1f} us")
