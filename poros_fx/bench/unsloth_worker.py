"""One Unsloth bench row, in a process of its own: run as a script by path, never imported.

    python poros_fx/bench/unsloth_worker.py --checkpoint DIR --method unsloth_resident --seq 512 \
        --accum 1 --steps 10 --warmup 1 --out row.json

Unsloth patches transformers, TRL and torch's checkpointing on import, so ``import unsloth`` must come
before transformers; ``poros_fx`` imports transformers, so this file imports nothing of ours (a script
run by path does not import its packages). The recipe and the timing are the bench's (``run.run_row``):
LoRA r16 alpha 32 on the seven projections (dropout 0: Unsloth's fast path), AdamW lr 1e-4, batch 1,
the same random batches (``run._batches``: one CPU generator seeded with ``--seed``), the median of
``--steps`` synchronized optimizer steps after ``--warmup``, ``max_memory_allocated`` from the adapter's
attachment to the last step. The row (a JSON object of the fields measured) goes to ``--out``; an
Unsloth that cannot be imported gives ``{"error": "skipped: unsloth not importable (...)"}``.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# run by path, this folder is sys.path[0]: its config.py / run.py / report.py must not shadow anything
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# what each method asks of Unsloth: get_peft_model's use_gradient_checkpointing, and whether
# from_pretrained streams the decoder layers (block swap needs per-layer checkpointing to save memory)
METHODS = {
    "unsloth_resident": {"use_gradient_checkpointing": False, "offload": False},
    "unsloth_checkpointing": {"use_gradient_checkpointing": "unsloth", "offload": False},
    "unsloth_offload": {"use_gradient_checkpointing": "unsloth", "offload": True},
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="absolute path of the checkpoint folder")
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offload-layers", type=int, default=None, help="unsloth_offload: layers swapped (default all)")
    p.add_argument("--out", required=True, help="the row as JSON")
    return p


def measure(args: argparse.Namespace, FastLanguageModel) -> dict:  # noqa: N803 - Unsloth's class
    import torch

    row: dict = {}
    spec = METHODS[args.method]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    load_options = {}
    if spec["offload"]:
        config = json.loads((Path(args.checkpoint) / "config.json").read_text())
        load_options["offload_layers"] = args.offload_layers or config["num_hidden_layers"]
    started = time.perf_counter()
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=args.checkpoint, max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=True,
        local_files_only=True, **load_options)
    row["load_s"] = round(time.perf_counter() - started, 1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0, target_modules=LORA_TARGETS, bias="none",
        use_gradient_checkpointing=spec["use_gradient_checkpointing"], random_state=args.seed)
    model.train()
    row["unsloth_options"] = {"use_gradient_checkpointing": spec["use_gradient_checkpointing"], **load_options}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(args.seed)  # the bench's batches (run._batches)
    batches = []
    for _ in range(args.accum):
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
        batches.append({"input_ids": ids.to(device), "labels": ids.to(device)})

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> float:
        sync()
        start = time.perf_counter()
        total = 0.0
        for batch in batches:
            loss = model(**batch, use_cache=False).loss / args.accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        row["loss"] = float(total)
        return time.perf_counter() - start

    first = step()
    for _ in range(args.warmup - 1):
        step()
    times = [step() for _ in range(args.steps)]
    median = statistics.median(times)
    row.update(s_per_step=round(median, 5), first_step_s=round(first, 3), steps=len(times),
               compile_s=round(max(0.0, first - median), 3))  # Unsloth compiles on the first step too
    if cuda:
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    return row


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        import unsloth  # noqa: F401 - before transformers: it patches transformers, TRL and torch on import
        from unsloth import FastLanguageModel
    except Exception as e:  # noqa: BLE001 - ImportError, or Unsloth's own refusal without a GPU
        out.write_text(json.dumps({"error": f"skipped: unsloth not importable ({_first_line(e)})"}))
        return 0
    row: dict = {"unsloth": getattr(unsloth, "__version__", None)}
    try:
        row.update(measure(args, FastLanguageModel))
    except Exception as e:  # noqa: BLE001 - OOM or any failure: the row records it
        row["error"] = _first_line(e)
    out.write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
