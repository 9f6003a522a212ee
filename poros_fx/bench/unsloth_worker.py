"""One Unsloth bench row, in a process of its own: ``poros-fx bench --worker unsloth`` (``unsloth.py`` starts it).

Unsloth patches transformers, TRL and torch's checkpointing on import, so ``import unsloth`` must come
before transformers; ``poros_fx`` imports transformers, so the process is started as ``python -c
UNSLOTH_FIRST bench --worker unsloth ...``: Unsloth first, then the ``poros-fx`` command line. The
recipe and the timing are the bench's (``run.run_row``): LoRA r16 alpha 32 on the seven projections
(dropout 0: Unsloth's fast path), AdamW lr 1e-4, batch 1, the same random batches (``run._batches``: one
CPU generator seeded with the bench's seed), the median of ``--steps`` synchronized optimizer steps after
``--warmup``, ``max_memory_allocated`` from the adapter's attachment to the last step. The row (a JSON
object of the fields measured) goes to ``--json``; an Unsloth that cannot be imported gives ``{"error":
"skipped: unsloth not importable (...)"}``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .config import BenchConfig, RowSpec, cap_device_memory

# the worker process's code: Unsloth before anything imports transformers, then the poros-fx command line
# (an Unsloth that fails to import is imported again by run_worker, which writes the "skipped" row)
UNSLOTH_FIRST = ("import contextlib\nwith contextlib.suppress(Exception):\n    import unsloth\n"
                 "from poros_fx.cli import main\nmain()")
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


def measure(spec: RowSpec, config: BenchConfig, checkpoint: Path,
            FastLanguageModel: Any) -> dict[str, Any]:  # noqa: N803 - Unsloth's class
    row: dict[str, Any] = {}
    options = METHODS[spec.method]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda and config.device_memory_cap is not None:
        row["device_memory_cap_gb"] = round(cap_device_memory(device, config.device_memory_cap) / 1e9, 3)
    load_options = {}
    if options["offload"]:
        hf_config = json.loads((checkpoint / "config.json").read_text())
        load_options["offload_layers"] = config.unsloth_offload_layers or hf_config["num_hidden_layers"]
    started = time.perf_counter()
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(checkpoint), max_seq_length=spec.seq, dtype=torch.bfloat16, load_in_4bit=True,
        local_files_only=True, **load_options)
    row["load_s"] = round(time.perf_counter() - started, 1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0, target_modules=LORA_TARGETS, bias="none",
        use_gradient_checkpointing=options["use_gradient_checkpointing"], random_state=config.seed)
    model.train()
    row["unsloth_options"] = {"use_gradient_checkpointing": options["use_gradient_checkpointing"], **load_options}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(config.seed)  # the bench's batches (run._batches)
    batches = []
    for _ in range(spec.accum):
        ids = torch.randint(0, model.config.vocab_size, (config.batch, spec.seq), generator=g)
        batches.append({"input_ids": ids.to(device), "labels": ids.to(device)})

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> float:
        sync()
        start = time.perf_counter()
        total = 0.0
        for batch in batches:
            loss = model(**batch, use_cache=False).loss / spec.accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        row["loss"] = float(total)
        return time.perf_counter() - start

    first = step()
    for _ in range(config.warmup - 1):
        step()
    times = [step() for _ in range(config.steps)]
    median = statistics.median(times)
    row.update(s_per_step=round(median, 5), first_step_s=round(first, 3), steps=len(times),
               compile_s=round(max(0.0, first - median), 3))  # Unsloth compiles on the first step too
    if cuda:
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    return row


def run_worker(spec: RowSpec, config: BenchConfig, checkpoint: Path) -> None:
    """Measure one Unsloth row on the checkpoint folder and write it to ``config.json_path``."""
    try:
        import unsloth  # noqa: F401 - imported first by UNSLOTH_FIRST; here again for its version or its error
        from unsloth import FastLanguageModel
    except Exception as e:  # noqa: BLE001 - ImportError, or Unsloth's own refusal without a GPU
        config.json_path.write_text(json.dumps({"error": f"skipped: unsloth not importable ({_first_line(e)})"}))
        return
    row: dict[str, Any] = {"unsloth": getattr(unsloth, "__version__", None)}
    try:
        row.update(measure(spec, config, checkpoint, FastLanguageModel))
    except Exception as e:  # noqa: BLE001 - OOM or any failure: the row records it
        row["error"] = _first_line(e)
    config.json_path.write_text(json.dumps(row))
