"""The side-by-side benchmark behind ``poros-fx bench``: PEFT baselines and poros, one JSON matrix.

    poros-fx bench --models 7b --json out/bench.json          # on the GPU
    poros-fx bench --models 0.5b,7b --methods poros --block-sizes 1,2,4 --json out/bench.json
    poros-fx bench --device cpu --models tiny --steps 2       # CPU smoke run
    poros-fx bench --nproc 2 --models 7b --json out/multi.json   # the multi-GPU rows (multi_gpu.py), in out/multi/

Methods (``METHODS``): ``peft_resident`` (PEFT LoRA on a bitsandbytes NF4 base, eager),
``peft_checkpointing`` (the same + non-reentrant activation checkpointing), ``compiled_resident``
(the same under plain ``torch.compile``/Inductor; opt-in, 0.5B/7B only), ``compiled_regional`` (each
decoder layer under plain ``torch.compile``, resident) and ``compiled_regional_checkpointing`` (the same
with activation checkpointing), ``poros`` (streamed, one row per block size; the default options, so
prefetch "auto" and the device's codegen), ``poros_eager`` / ``poros_inductor`` (each codegen by name),
``poros_resident`` (``options={"stream": False}``), ``poros_budget`` (``options={"memory_budget":
--memory-budget}``: after the first step the blocks that fit stay resident), ``poros_saved``
(``options={"save_activations": every layer}``: no block recomputed, each still reloaded for its
backward) and ``poros_budget_saved`` (both: a kept block is neither reloaded nor recomputed), ``poros_graphs``,
``poros_saved_graphs``, ``poros_budget_graphs`` and ``poros_budget_saved_graphs`` (the same with
``options={"cuda_graphs": True}``: each region call replayed from a CUDA graph; two untimed steps, warm-up and
recording; their peak adds the graphs' pool), ``poros_micro_major``
(``options={"block_major": False}``: accumulated micro-batches one after the other; every other poros
method runs an accumulation row block-major, ``runtime/accumulate.py``) and, opt-in, ``poros_tensor_copies`` (``options={"group_copies": False}``: a copy per tensor
instead of per block) and ``poros_prefetch1`` (``options={"prefetch": 1}``: the fixed depth that was the
default before "auto"). The peer, Unsloth (``unsloth.py``): ``unsloth_resident``
(``get_peft_model(use_gradient_checkpointing=False)``), ``unsloth_checkpointing`` (``"unsloth"``: activations
to host memory) and ``unsloth_offload`` (``from_pretrained(offload_layers=N)``, every decoder layer unless
``--unsloth-offload-layers``), each in a process of its own (``unsloth_worker.py``, ``import unsloth``
before transformers) on a checkpoint of the same random-init weights written once under ``--checkpoints``;
without Unsloth the row says "skipped: unsloth not importable". Models: random-init
Qwen2.5 shapes (0.5b/7b/32b/72b), or ``tiny`` (a 2-layer qwen2 config, for CPU runs). Recipe: LoRA
r16 alpha 32 dropout 0.05 on all seven projections, AdamW, batch 1; one row per (seq, accum) pair of
the grid (``star``: the first seq and accum, plus each other seq at the first accum and each other
accum at the first seq; ``full``: every pair).

How the models are built: one ``poros_fx.io.loader.from_config`` call per model size, shared by every
row of that size. ``from_config`` generates and NF4-quantizes the base one tensor at a time on the
device and keeps it in the host store, so a 72B never exists in bf16 anywhere. The PEFT baselines
need the same NF4 base resident on the device: ``poros_fx.unprepare`` puts each tensor back where
``from_config`` left it (host memory), and ``model.to(device)`` then moves it tensor by tensor (a
quantized ``Params4bit`` carries its quant state along), so the device never holds more than the
NF4 base either; ``poros_fx.prepare`` takes it back into the store for the next poros row. This
reuses the loader's exact code path instead of a second builder, and every method trains the very
same weights (same seed), so their losses are comparable. Rows are ordered to switch between the
two states at most twice per (seq, accum) pair.

Per row: median seconds per optimizer step over ``--steps`` steps after ``--warmup`` steps
(``torch.cuda.synchronize`` around ``time.perf_counter`` on CUDA), ``max_memory_allocated`` over the
whole row (warm-up and compilation included; null on CPU), achieved H2D GB/s (the poros store's
``bytes_loaded`` during the timed steps over their time; poros rows only), the floor
``2 x streamed bytes x accum / pinned bandwidth`` (streamed bytes: what the blocks load in one pass,
the base without the gathered embedding table; each micro-batch streams it forward and again
for the backward; null on CPU), the first step's extra seconds over the median (compiled methods),
and the ratio of s/step to ``peft_resident`` of the same model, seq and accum (recomputed over the
whole merged file). A row that fails records ``"error": "ExceptionClass: first line"`` and the run
goes on. Results merge into an existing JSON (same model/method/block_size/seq/accum replaced), so
several device calls build one matrix. The JSON, the markdown table and the PNG plot are rewritten
after every row, so a call killed at its time limit keeps every row it finished; ``--time-budget``
stops starting rows once exceeded (the one in flight finishes) and says so in the JSON and markdown.
``--compile-warm`` (``warm.py``): each compiled row runs in a fresh Inductor cache (``first_step_cold_s``,
``compile_cold_s``), then the bench runs it again in a second process on that cache
(``first_step_warm_s``, ``compile_warm_s``).

Put a previous run's JSON at the ``--json`` path to extend it.

Modules: ``methods`` (what a row runs), ``config`` (the command line's choices, the rows planned),
``run`` (building the model, measuring a row, the run loop), ``unsloth`` / ``unsloth_worker`` (the
peer's rows), ``warm`` (compile cold and warm), ``report`` (JSON merging, markdown, plot), ``multi_gpu``
(the multi-GPU rows), ``options`` (the help of every option of ``poros-fx bench``, which ``cli/app.py``
declares).
"""

from .config import (DEFAULT_ACCUMS, DEFAULT_BLOCK_SIZES, DEFAULT_CHECKPOINTS, DEFAULT_METHODS, DEFAULT_MODELS,
                     DEFAULT_SEQS, MODEL_ORDER, MULTI_METHODS, NO_CUDA_MESSAGE, SIZES, BenchConfig, MultiGpuConfig,
                     RowSpec, make_config, make_multi_config, model_name, plan, shapes)
from .methods import METHODS, Method, Runner, State
from .report import load, markdown, merge, plot, ratios, save, start_run, upsert, write_outputs
from .run import ModelHolder, environment, measure_pinned_h2d, run, run_row
from .options import HELP, MODELS_HELP

__all__ = ["BenchConfig", "METHODS", "Method", "ModelHolder", "MultiGpuConfig", "RowSpec", "Runner", "State",
           "environment", "load", "make_config", "make_multi_config", "markdown", "measure_pinned_h2d", "merge",
           "model_name", "plan", "plot",
           "ratios", "run", "run_row", "save", "shapes", "start_run", "upsert", "write_outputs",
           "DEFAULT_ACCUMS", "DEFAULT_BLOCK_SIZES", "DEFAULT_CHECKPOINTS", "DEFAULT_METHODS", "DEFAULT_MODELS",
           "DEFAULT_SEQS", "HELP", "MODEL_ORDER", "MODELS_HELP", "MULTI_METHODS", "NO_CUDA_MESSAGE", "SIZES"]
