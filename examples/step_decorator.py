"""``@poros_fx.step`` on your own step function, with gradient accumulation, on a tiny built-in model.

    python examples/step_decorator.py            # CPU, a few seconds after compilation

The model is prepared and compiled by the decorator on its first call; the optimizer stays yours.
"""

import torch

import poros_fx
from poros_fx.models.tiny import demo_batches, tiny_lora_model


@poros_fx.step(accumulate=2)
def train_step(model, batch):
    loss = model(**batch, use_cache=False).loss / 2  # the decorator does not rescale: a mean over 2
    loss.backward()
    return loss


def main() -> None:
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batches = demo_batches(8, seq=32)
    for step in range(4):
        losses = train_step(model, batches[2 * step:2 * step + 2])
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {sum(loss.item() for loss in losses):.4f}")
    s = poros_fx.stats(model)
    print(f"peak resident base {s['peak_resident_base_bytes']} of {s['host_bytes']} bytes, "
          f"recomputed blocks {s['recomputed_blocks']}")
    print(poros_fx.report(model))


if __name__ == "__main__":
    main()
