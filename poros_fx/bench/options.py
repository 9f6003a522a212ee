"""The help of every ``poros-fx bench`` option (``cli/app.py`` declares them): one text per option."""

from __future__ import annotations

from .config import DEFAULT_METHODS, MULTI_METHODS, MULTI_TIMEOUT_S, MULTI_WARMUP
from ..models.tiny import SHAPE_CONFIGS
from .methods import METHODS

MODELS_HELP = f"comma-separated: tiny, 0.5b, 7b, 32b, 72b (Qwen2.5 shapes), {', '.join(SHAPE_CONFIGS)}"
MULTI_ONLY = "multi-GPU rows (--nproc) only"
HELP = {
    "models": MODELS_HELP + "; with --nproc, the first",
    "methods": f"comma-separated: {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS.split(','))}); with --nproc: "
               f"{', '.join(MULTI_METHODS)} (default: both)",
    "block_sizes": "poros block sizes (one row each)",
    "seqs": "sequence lengths; the first is the base; with --nproc, the first",
    "accums": "gradient accumulation; the first is the base",
    "grid": "star: base pair + each other seq / accum alone; full: every pair",
    "steps": "timed optimizer steps per row",
    "warmup": f"untimed steps first (the first compiles); default 1, {MULTI_WARMUP} with --nproc",
    "batch": f"rows per rank per step (default 1); {MULTI_ONLY}",
    "device": "cuda, or cpu (with --models tiny) for a smoke run",
    "json": "results; merged into when it exists (with --nproc: its path without the suffix is the results folder)",
    "md": "markdown table (default: JSON path with .md)",
    "plot": "PNG plot (default: JSON path with .png)",
    "time_budget": "seconds; no new row starts after them",
    "profile": "profile one extra step per row: Chrome trace into DIR, summary into the row's 'profile'",
    "memory_profile": "one extra step per row under the CUDA allocator's history: snapshot (memory_viz pickle) into "
                      "DIR, the allocations alive at the step's peak into the row's 'memory_profile'",
    "memory_budget": "poros_budget, poros_budget_saved and their _graphs rows: their memory_budget (e.g. 24GB)",
    "compiled_resident": "add compiled_resident (plain torch.compile/Inductor; 0.5B and 7B only)",
    "checkpoints": "unsloth_*: the random-init checkpoint of each model is written (once) under DIR",
    "unsloth_offload_layers": "unsloth_offload: decoder layers Unsloth swaps from host memory (default: all)",
    "compile_warm": "compiled rows: compile_s cold (a fresh Inductor cache) and warm (a second process, same cache)",
    "device_memory_cap": "cap the device memory of every row's process (e.g. 24GB: a 24 GB card on a larger one; "
                         "torch.cuda.set_per_process_memory_fraction); a row past it records its out-of-memory error",
    "expert_lora": "LoRA on every layer's experts too (PEFT's target_parameters, by full path; LoRA dropout 0 for "
                   "every target, which PEFT requires there); models without experts keep attention/MLP LoRA",
    "sequence_chunks": "streamed poros rows: each decoder layer in this many token chunks (the sequence_chunks "
                       "option; default 1)",
    "nproc": "several GPUs of this host instead: poros on 1 and on NPROC processes and FSDP2 with CPU offload on "
             "NPROC, each row a torchrun job (multi_bench.json, multi_bench.md and logs/ in the results folder)",
    "rows": f"rows to run instead of the default ones (e.g. poros:1,poros:4); {MULTI_ONLY}",
    "layers": f"decoder layers to build (default: the model's); {MULTI_ONLY}",
    "quantization": f"nf4 (default) or bf16 base; {MULTI_ONLY}",
    "row_timeout": f"seconds one row may run (default {MULTI_TIMEOUT_S}); {MULTI_ONLY}",
    "worker": "one row in this process, as the bench starts it: multi-gpu (a torchrun rank) or unsloth",
}
