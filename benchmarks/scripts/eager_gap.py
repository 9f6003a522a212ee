"""Where does a compiled step part from eager? One forward+backward, LoRA grads compared per tensor.

    python benchmarks/scripts/eager_gap.py --device cuda --shape 0.5b --deterministic

For each attention implementation (sdpa, eager) and each backend (aot_eager, poros streamed), prints
whether the loss is equal to eager's, how many adapter gradients differ, the largest difference, and
the deepest layer whose gradients still match (the backward runs from the last layer down, so the
first layer that differs is where the paths part).
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

import poros_fx
from poros_fx.models.tiny import demo_batches, lora_model, qwen25_config, tiny_config


def grads_of(backend: str, config, args, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    model = lora_model(config, dtype=getattr(torch, args.dtype), nf4=args.nf4, dropout=0.0, device=args.device)
    step = model
    if backend == "poros":
        poros_fx.prepare(model, device=args.device)
        step = torch.compile(model, backend="poros")
    elif backend != "eager":
        step = torch.compile(model, backend=backend)
    loss = step(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nf4", action="store_true")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rows = []
    for attn in ("sdpa", "eager"):
        config = tiny_config("qwen2") if args.shape == "tiny" else qwen25_config(args.shape)
        config._attn_implementation = attn
        batch = {k: v.to(args.device) for k, v in demo_batches(1, vocab=config.vocab_size, seq=args.seq, batch=1)[0].items()}
        ref_loss, ref = grads_of("eager", config, args, batch)
        again_loss, again = grads_of("eager", config, args, batch)
        for backend in ("eager-again", "aot_eager", "poros"):
            loss, got = (again_loss, again) if backend == "eager-again" else grads_of(backend, config, args, batch)
            differ = [n for n in ref if not torch.equal(ref[n], got[n])]
            layers = sorted({int(m.group(1)) for n in differ if (m := re.search(r"layers\.(\d+)\.", n))})
            worst = max(((ref[n].float() - got[n].float()).abs().max().item() for n in differ), default=0.0)
            row = dict(attn=attn, backend=backend, loss_equal=bool(torch.equal(ref_loss, loss)),
                       grads_differ=f"{len(differ)}/{len(ref)}", max_grad_diff=worst,
                       deepest_differing_layer=max(layers) if layers else None,
                       first_module=min(differ, key=lambda n: -int(re.search(r"layers\.(\d+)\.", n).group(1))
                                        if re.search(r"layers\.(\d+)\.", n) else 0) if differ else None)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
