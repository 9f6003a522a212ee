"""First (compiling) step of a 2-layer gpt-oss layout (one sliding, one full layer) with NF4 experts on the
CPU: seconds, the second step's seconds, its loss and poros' compile phases, as one JSON line.

    python docs/bench/cpu/probe_gptoss_first_step.py CODEGEN [HIDDEN [EXPERTS]]

HIDDEN (default 192) is also each expert's width; EXPERTS defaults to gpt-oss's 128."""
import json
import sys
import time

import torch

import poros_fx
from poros_fx.models.tiny import add_lora, base_model, demo_batches, lora_targets, tiny_config

codegen = sys.argv[1]
hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 192
config = tiny_config("gpt_oss", layers=2, hidden=hidden, heads=4, kv_heads=2, intermediate=hidden,
                     num_local_experts=int(sys.argv[3]) if len(sys.argv) > 3 else 128, num_experts_per_tok=4)
model = add_lora(base_model(config, dtype=torch.bfloat16, nf4=True), targets=list(lora_targets("gpt_oss")), dropout=0.0)
poros_fx.prepare(model, device="cpu")
step = torch.compile(model, backend="poros", options={"codegen": codegen})
batch = demo_batches(1, vocab=256, seq=32, batch=1, seed=0)[0]
t = time.perf_counter()
step(**batch, use_cache=False).loss.backward()
first = time.perf_counter() - t
t = time.perf_counter()
loss = step(**batch, use_cache=False).loss
loss.backward()
second = time.perf_counter() - t
print(json.dumps({"first_s": round(first, 2), "second_s": round(second, 3), "loss": float(loss),
                  "compile": poros_fx.stats(model)["compile"]}, default=str))
