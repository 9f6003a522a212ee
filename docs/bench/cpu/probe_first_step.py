"""Seconds of the first (compiling) step of a tiny NF4 Qwen2 with LAYERS layers on the CPU.

    python docs/bench/cpu/probe_first_step.py LAYERS"""
import sys
import time

import torch

import poros_fx
from poros_fx.models.tiny import demo_batches, lora_model, tiny_config

torch.manual_seed(0)
model = lora_model(tiny_config("qwen2", layers=int(sys.argv[1])), dropout=0.05, nf4=True, dtype=torch.bfloat16)
poros_fx.prepare(model, device="cpu")
step = torch.compile(model, backend="poros")
batch = demo_batches(1, seq=32)[0]
t = time.perf_counter()
step(**batch, use_cache=False).loss.backward()
print(f"first step {time.perf_counter() - t:.2f} s")
