"""How far an N-rank poros run is from a one-process run with the same global batch (they are not equal).

    torchrun --standalone --nproc-per-node 2 benchmarks/scripts/ddp_vs_one.py --out ddp_vs_one.json   # CPU (gloo) or GPUs

Every rank trains the same prepared tiny model (or ``--model 0.5b`` etc. on GPUs) streamed, under
DDP, on its own rows of each global batch; then rank 0 trains an independent copy in one process on
the whole global batch (the ranks' rows stacked), and writes the largest absolute difference per step
of the loss (the ranks' mean against the single loss), of the adapter weights and of the AdamW state.
LoRA dropout is 0 here: with dropout each rank draws its own masks, so the two runs would not even
compute the same function. They differ only by rounding: DDP sums gradients already averaged per rank
and divides by N (``all_reduce`` of ``grad / N``), the single process averages over all rows at once,
and the matmuls see other shapes. Nothing here asserts; the numbers go into docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist


def _model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import poros_fx
    from poros_fx.models.tiny import lora_model, qwen25_config, tiny_config

    config = tiny_config("qwen2", layers=args.layers) if args.model == "tiny" else qwen25_config(args.model)
    if args.model != "tiny":
        config.num_hidden_layers = args.layers
    model = lora_model(config, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, dropout=0.0,
                       seed=0, device=device)
    return poros_fx.prepare(model, device=device)


def _train(model: torch.nn.Module, step_model, batches: list[torch.Tensor]) -> dict[str, list]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    out: dict[str, list] = {"loss": [], "weights": [], "state": []}
    for ids in batches:
        loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.detach().double().cpu())
        out["weights"].append([p.detach().double().cpu().clone() for p in params])
        out["state"].append([t.detach().double().cpu().clone() for p in params
                             for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])])
    return out


def _max(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rows", type=int, default=1, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="ddp_vs_one.json")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")

    from poros_fx import distributed

    ranks = distributed.init_process_group()
    torch.set_num_threads(1)
    device = distributed.rank_device(ranks)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    vocab = 256 if args.model == "tiny" else 151936
    global_batches = [torch.randint(0, vocab, (world * args.rows, args.seq), generator=g) for _ in range(args.steps)]

    model = _model(args, device)
    ddp = torch.compile(distributed.data_parallel(model), backend="poros")
    mine = [b[rank * args.rows:(rank + 1) * args.rows].to(device) for b in global_batches]
    with distributed.no_ddp_optimizer():
        ranked = _train(model, ddp, mine)
    losses = [None] * world
    dist.all_gather_object(losses, ranked["loss"])
    dist.destroy_process_group()
    if rank != 0:
        return

    torch._dynamo.reset()
    single_model = _model(args, device)
    single = _train(single_model, torch.compile(single_model, backend="poros"), [b.to(device) for b in global_batches])
    mean_loss = [torch.stack([losses[r][i] for r in range(world)]).mean() for i in range(args.steps)]
    result = {"ranks": world, "rows_per_rank": args.rows, "seq": args.seq, "model": args.model, "layers": args.layers,
              "device": device.type, "torch": torch.__version__,
              "per_step": [{"step": i + 1,
                            "loss_ranks_mean": mean_loss[i].item(), "loss_one_process": single["loss"][i].item(),
                            "loss_abs_diff": abs(mean_loss[i] - single["loss"][i]).item(),
                            "weights_max_abs_diff": _max(ranked["weights"][i], single["weights"][i]),
                            "adamw_state_max_abs_diff": _max(ranked["state"][i], single["state"][i])}
                           for i in range(args.steps)]}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
